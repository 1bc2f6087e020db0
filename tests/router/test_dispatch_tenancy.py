"""Every leg the job executor sends carries the job's tenancy: the colocated or prefill leg, the decode leg
and a resumed job; locality routing looks the prompt up under the job's cache salt."""
from __future__ import annotations

from types import SimpleNamespace

from meshserve.core.kv_cache_manager import KVCacheManager
from meshserve.router.cache_homes import CacheHomes
from meshserve.router.dispatch import Dispatcher
from meshserve.router.jobs import Job, JobTable
from meshserve.router.prompt_tree import GlobalPromptTree
from meshserve.router.routing import LoadTracker, RoutingPolicy, TELoad, TEView
from meshserve.wire.client import AddRequest, Tenancy
from meshserve.wire.kv import KVCacheEvents, KVTransferParams, KVTransferRole
from meshserve.wire.sampling_params import SamplingParams

TENANCY = Tenancy(tenant="key:0123456789abcdef", cache_salt="c3" * 16)
BS = 4


class _Registry:
    """The registry's face the dispatcher uses: TE views and records by name."""

    def __init__(self, views: list[TEView]) -> None:
        self._views = views

    @property
    def tes(self) -> dict:
        return {v.name: SimpleNamespace(name=v.name, role=v.role, draining=False,
                                        heartbeat=SimpleNamespace(group=v.group)) for v in self._views}

    def views(self) -> list[TEView]:
        return self._views

    def get(self, name: str):
        return self.tes.get(name)

    def link_down(self, decode: str, prefill: str) -> bool:
        return False


class _Demand:
    def of_te(self, te: str):
        return SimpleNamespace(arrivals=0)


def dispatcher(views: list[TEView], routing: RoutingPolicy) -> tuple[Dispatcher, list]:
    sent: list = []
    d = Dispatcher(_Registry(views), JobTable(LoadTracker()), routing, CacheHomes(), _Demand(), [1], "tcp://je",
                   on_send_failed=lambda record, why: None)
    d.send = lambda record, item: sent.append((record.name, item))
    return d, sent


def job(prompt: list[int]) -> Job:
    return Job("c0", "r0", SamplingParams(max_tokens=4), prompt, 0, 0.0, None, tenancy=TENANCY)


def test_prefill_decode_and_resume_legs_carry_the_tenancy():
    views = [TEView("p0", "prefill", "g", TELoad()), TEView("d0", "decode", "g", TELoad())]
    d, sent = dispatcher(views, RoutingPolicy("round_robin"))
    j = job(list(range(9)))
    d.dispatch(j)
    j.kv_params = KVTransferParams(role=KVTransferRole.CONSUMER, engine="p0")
    d.dispatch_decode(j)
    views.append(TEView("c0", "colocated", "g", TELoad()))
    d.dispatch_resume(j, exclude={"d0"})
    assert [name for name, _ in sent] == ["p0", "d0", "c0"]
    assert all(isinstance(item, AddRequest) and item.tenancy == TENANCY for _, item in sent)


def test_locality_routing_sees_only_the_job_s_namespace():
    tree, kv_manager = GlobalPromptTree(BS), KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(100, 109))
    blocks = kv_manager.alloc_blocks(2)
    kv_manager.insert_prefix(prompt, blocks, 2, cache_salt="other-tenant")
    tree.apply("c1", KVCacheEvents(seq=1, timestamp=0.0, events=kv_manager.drain_events()))
    # c1 caches the prompt for another tenant and is busier: this job goes by load, to c0
    views = [TEView("c0", "colocated", "g", TELoad()), TEView("c1", "colocated", "g", TELoad(num_running=3))]
    d, sent = dispatcher(views, RoutingPolicy("locality", tree=tree))
    d.dispatch(job(prompt))
    assert sent[0][0] == "c0"
    # the same prompt of the tenant that cached it is drawn to c1
    other = Job("c1", "r1", SamplingParams(max_tokens=4), prompt, 0, 0.0, None,
                tenancy=Tenancy(tenant="t", cache_salt="other-tenant"))
    d.dispatch(other)
    assert sent[1][0] == "c1"
