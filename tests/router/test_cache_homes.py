"""Named context caches' homes: a job using a cache goes to the TE that pinned it until its ttl ends; a job
creating one, or a job without one, is routed as any other."""
from __future__ import annotations

from meshserve.router.cache_homes import CacheHomes
from meshserve.router.jobs import Job
from meshserve.router.routing import RoutingPolicy, TELoad, TEView
from meshserve.wire.sampling_params import SamplingParams

VIEWS = [TEView(name=name, role="colocated", group="main", load=TELoad()) for name in ("a", "b")]


def job(cache_id: str | None, ttl_s: float | None = None) -> Job:
    return Job("r-0", "r", SamplingParams(), [1, 2, 3], 0, 0.0, None, context_cache_id=cache_id,
               context_cache_ttl_s=ttl_s)


def test_a_job_using_a_cache_goes_to_its_home_while_the_cache_lives():
    homes, routing = CacheHomes(), RoutingPolicy()
    homes.pin("doc", "b", ttl_s=60.0)
    decision = homes.route(job("doc"), VIEWS, routing)
    assert decision is not None and decision.te == "b"
    assert homes.route(job("doc", ttl_s=60.0), VIEWS, routing) is None  # it creates the cache again
    assert homes.route(job(None), VIEWS, routing) is None


def test_an_expired_cache_has_no_home():
    homes, routing = CacheHomes(), RoutingPolicy()
    homes.pin("doc", "b", ttl_s=0.0)  # its ttl ends at once
    assert homes.route(job("doc"), VIEWS, routing) is None and homes.pop("doc") is None


def test_a_deleted_cache_names_its_home_once():
    homes = CacheHomes()
    homes.pin("doc", "a", ttl_s=60.0)
    assert homes.pop("doc") == "a" and homes.pop("doc") is None
