"""Authentication of the HTTP API: API keys on /v1, the admin key (or loopback) on operator endpoints,
open health and metrics, the refusal to serve beyond loopback without a key, and the admin CLI's key."""
from __future__ import annotations

import subprocess
import sys

import pytest
from starlette.testclient import TestClient

from meshserve.config import ConfigError
from meshserve.entrypoints.openai.api_server import build_app
from meshserve.entrypoints.openai.server_options import ADMIN_KEY_ENV, API_KEY_ENV, check_bind, server_options
from tests.entrypoints.openai.fake_server import REPO_ROOT, AdminFakeEngine, running_fake_server
from tests.entrypoints.openai.test_api import MODEL, REPLIES, assert_openai_error

API_KEY, OTHER_KEY, ADMIN_KEY = "sk-test-one", "sk-test-two", "admin-secret"
LOOPBACK = ("127.0.0.1", 40000)
REMOTE = ("203.0.113.9", 40000)
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 3}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def client_for(client_addr=LOOPBACK, **options) -> TestClient:
    return TestClient(build_app(AdminFakeEngine(), options=server_options({}, **options)), client=client_addr)


@pytest.fixture
def keyed():
    with client_for(api_keys=(API_KEY, OTHER_KEY), admin_key=ADMIN_KEY) as c:
        yield c


def test_without_keys_the_api_is_open_on_loopback():
    with client_for() as c:
        assert c.post("/v1/completions", json=COMPLETION).json()["choices"][0]["text"] == REPLIES[0][:3]


def test_every_v1_request_needs_a_configured_key(keyed):
    for headers in ({}, bearer("sk-wrong"), {"Authorization": API_KEY}, {"Authorization": "Basic eDp5"}):
        response = keyed.post("/v1/completions", json=COMPLETION, headers=headers)
        error = assert_openai_error(response, 401, "authentication_error")
        assert error["code"] == "invalid_api_key" and response.headers["www-authenticate"] == "Bearer"
        assert_openai_error(keyed.get("/v1/models", headers=headers), 401, "authentication_error")
    for key in (API_KEY, OTHER_KEY):
        assert keyed.post("/v1/completions", json=COMPLETION, headers=bearer(key)).status_code == 200
        assert keyed.get("/v1/models", headers=bearer(key)).json()["data"][0]["id"] == MODEL


def test_health_and_metrics_stay_open(keyed):
    assert keyed.get("/health").json()["status"] == "ok"
    assert keyed.get("/metrics").status_code == 200


def test_refusals_are_counted_in_metrics(keyed):
    keyed.get("/v1/models")
    assert 'meshserve_http_rejected_total{reason="unauthenticated"} 1.0' in keyed.get("/metrics").text


def test_admin_endpoints_need_the_admin_key(keyed):
    for path in ("/admin/eplb/status", "/admin/eplb/load", "/v1/context_caches"):
        assert_openai_error(keyed.get(path), 401, "authentication_error")
        assert_openai_error(keyed.get(path, headers=bearer("wrong")), 401, "authentication_error")
        assert_openai_error(keyed.get(path, headers=bearer(API_KEY)), 403, "permission_error")
        assert keyed.get(path, headers=bearer(ADMIN_KEY)).status_code == 200
    rebalance = keyed.post("/admin/eplb/rebalance", json={}, headers=bearer(API_KEY))
    assert_openai_error(rebalance, 403, "permission_error")
    assert keyed.post("/admin/eplb/rebalance", json={}, headers=bearer(ADMIN_KEY)).json()["phase"] == "idle"


def test_the_admin_key_is_required_even_from_loopback():
    with client_for(LOOPBACK, admin_key=ADMIN_KEY) as c:
        assert_openai_error(c.get("/admin/eplb/status"), 401, "authentication_error")
        assert c.get("/admin/eplb/status", headers=bearer(ADMIN_KEY)).status_code == 200


def test_without_an_admin_key_admin_endpoints_answer_loopback_only():
    with client_for(LOOPBACK) as c:
        assert c.get("/admin/eplb/status").json()["phase"] == "idle"
        assert c.get("/v1/context_caches").json() == {"object": "list", "data": []}
    with client_for(REMOTE, api_keys=(API_KEY,), allow_unauthenticated=False) as c:
        assert_openai_error(c.get("/admin/eplb/status", headers=bearer(API_KEY)), 403, "permission_error")
        assert_openai_error(c.get("/v1/context_caches", headers=bearer(API_KEY)), 403, "permission_error")
        assert c.get("/v1/models", headers=bearer(API_KEY)).status_code == 200


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_loopback_binds_need_no_key(host):
    check_bind(host, server_options({}))


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "example.org"])
def test_binding_beyond_loopback_needs_a_key_or_an_explicit_waiver(host):
    with pytest.raises(ConfigError, match="--allow-unauthenticated"):
        check_bind(host, server_options({}))
    check_bind(host, server_options({}, api_keys=(API_KEY,)))
    check_bind(host, server_options({API_KEY_ENV: API_KEY}))
    check_bind(host, server_options({}, allow_unauthenticated=True))


def test_keys_come_from_the_environment_and_never_show_in_repr():
    options = server_options({API_KEY_ENV: f"{API_KEY}, {OTHER_KEY}", ADMIN_KEY_ENV: ADMIN_KEY})
    assert options.api_keys == (API_KEY, OTHER_KEY) and options.admin_key == ADMIN_KEY
    assert API_KEY not in repr(options) and ADMIN_KEY not in repr(options)
    assert server_options({API_KEY_ENV: "env-key"}, api_keys=["flag-key"]).api_keys == ("flag-key",)


def test_serve_refuses_to_start_beyond_loopback_without_a_key():
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-m", "meshserve.entrypoints.cli", "serve", "--host", "0.0.0.0", "--port", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, env=env)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "refusing to serve on 0.0.0.0 without an API key" in done.stderr


def _eplb_status(base: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    environ = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT), **env}
    return subprocess.run([sys.executable, "-m", "meshserve.entrypoints.cli", "eplb", "status", "--url", base],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, env=environ)


def test_the_eplb_cli_sends_the_admin_key():
    with running_fake_server({}, env={ADMIN_KEY_ENV: ADMIN_KEY}) as (base, _):
        refused = _eplb_status(base, {})
        assert refused.returncode != 0 and "HTTP 401" in refused.stderr
        assert refused.stderr.strip().splitlines()[-1].startswith("meshserve eplb status: error: ")
        shown = _eplb_status(base, {ADMIN_KEY_ENV: ADMIN_KEY})
        assert shown.returncode == 0, shown.stderr
        assert '"phase": "idle"' in shown.stdout
