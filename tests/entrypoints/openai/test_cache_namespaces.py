"""Tenant namespaces of the prefix cache: each key's (or client's) requests reach the engine with their own
salt and tenant name, `cache_salt` splits a namespace further, and `--shared-cache-keys` joins trusted keys."""
from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from meshserve.config import ConfigError
from meshserve.entrypoints.openai.api_server import build_app
from meshserve.entrypoints.openai.cache_namespaces import CacheNamespaces, key_fingerprint, parse_shared_cache_keys
from meshserve.entrypoints.openai.server_options import server_options
from tests.entrypoints.openai.fake_server import AdminFakeEngine
from tests.entrypoints.openai.test_api import MODEL

KEY_A, KEY_B, KEY_C = "sk-tenant-a", "sk-tenant-b", "sk-tenant-c"
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def tenancies(client_addr=("127.0.0.1", 40000), requests=(), **options):
    """The tenancy of each (key, path, body) request as the engine received it."""
    engine = AdminFakeEngine()
    with TestClient(build_app(engine, options=server_options({}, **options)), client=client_addr) as client:
        for key, path, body in requests:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            assert client.post(path, json=body, headers=headers).status_code == 200
    return [call["tenancy"] for call in engine.calls]


def test_each_key_has_its_own_namespace_and_no_key_reaches_the_engine():
    a1, a2, b = tenancies(api_keys=(KEY_A, KEY_B), requests=[
        (KEY_A, "/v1/completions", COMPLETION), (KEY_A, "/v1/chat/completions", CHAT),
        (KEY_B, "/v1/completions", COMPLETION)])
    assert a1.cache_salt == a2.cache_salt != b.cache_salt
    assert a1.tenant == "key:" + key_fingerprint(KEY_A) and b.tenant == "key:" + key_fingerprint(KEY_B)
    for tenancy in (a1, b):
        assert KEY_A not in repr(tenancy) and KEY_B not in repr(tenancy)


def test_cache_salt_splits_a_namespace_and_never_joins_another():
    plain, salted, salted_again, other_key_salted = tenancies(api_keys=(KEY_A, KEY_B), requests=[
        (KEY_A, "/v1/completions", COMPLETION), (KEY_A, "/v1/completions", {**COMPLETION, "cache_salt": "s1"}),
        (KEY_A, "/v1/chat/completions", {**CHAT, "cache_salt": "s1"}),
        (KEY_B, "/v1/completions", {**COMPLETION, "cache_salt": "s1"})])
    assert salted.cache_salt == salted_again.cache_salt
    assert len({plain.cache_salt, salted.cache_salt, other_key_salted.cache_salt}) == 3


def test_keyless_clients_are_named_by_their_address():
    (local,) = tenancies(requests=[(None, "/v1/completions", COMPLETION)])
    (remote,) = tenancies(client_addr=("203.0.113.9", 40000), allow_unauthenticated=True,
                          requests=[(None, "/v1/completions", COMPLETION)])
    assert local.tenant == "client:127.0.0.1" and remote.tenant == "client:203.0.113.9"
    assert local.cache_salt != remote.cache_salt


def test_an_empty_cache_salt_is_refused():
    with TestClient(build_app(AdminFakeEngine())) as client:
        assert client.post("/v1/completions", json={**COMPLETION, "cache_salt": ""}).status_code == 400


def test_the_operator_shares_a_namespace_among_a_group_of_keys():
    group = f"{key_fingerprint(KEY_A)},{key_fingerprint(KEY_B)}"
    a, b, c = tenancies(api_keys=(KEY_A, KEY_B, KEY_C), shared_cache_keys=group, requests=[
        (key, "/v1/completions", COMPLETION) for key in (KEY_A, KEY_B, KEY_C)])
    assert a.cache_salt == b.cache_salt != c.cache_salt
    assert a.tenant != b.tenant  # still two tenants to the scheduler


def test_star_shares_one_namespace_among_everyone():
    namespaces = CacheNamespaces("*")
    salts = {namespaces.tenancy(owner).cache_salt for owner in ("key:0123456789abcdef", "client:10.0.0.1")}
    assert len(salts) == 1


def test_groups_parse_and_bad_ones_are_refused():
    a, b, c = (key_fingerprint(k) for k in (KEY_A, KEY_B, KEY_C))
    assert parse_shared_cache_keys(f"{a}, {b} ; {c}") == (frozenset({a, b}), frozenset({c}))
    assert parse_shared_cache_keys("") == ()
    for bad in ("not-a-fingerprint", f"{a};{a},{b}", KEY_A):
        with pytest.raises(ConfigError):
            server_options({}, shared_cache_keys=bad)
