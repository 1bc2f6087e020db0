"""POST /admin/faults: closed unless fault injection is turned on; a bad fault is a 400; a good one reaches the
engine as `fault.inject` with the TE it names."""
from __future__ import annotations

from starlette.testclient import TestClient

from meshserve.entrypoints.openai.api_server import build_app
from meshserve.entrypoints.openai.server_options import server_options
from tests.entrypoints.openai.fake_server import AdminFakeEngine
from tests.entrypoints.openai.test_api import assert_openai_error

LOOPBACK = ("127.0.0.1", 40000)


def _client(engine: AdminFakeEngine, environ: dict[str, str] | None = None, **options) -> TestClient:
    return TestClient(build_app(engine, options=server_options(environ or {}, **options)), client=LOOPBACK)


def test_fault_injection_is_off_by_default():
    engine = AdminFakeEngine()
    with _client(engine) as client:
        response = client.post("/admin/faults", json={"kind": "kill"})
    assert_openai_error(response, 404, "not_found_error")
    assert "--enable-fault-injection" in response.json()["error"]["message"]
    assert engine.admin_calls == []


def test_a_fault_reaches_the_engine_with_its_te():
    engine = AdminFakeEngine()
    with _client(engine, enable_fault_injection=True) as client:
        ok = client.post("/admin/faults", json={"te": "pd-decode-0", "kind": "stall", "rank": 1, "duration_s": 5})
        assert ok.status_code == 200
    op, args = engine.admin_calls[0]
    assert op == "fault.inject" and args["te"] == "pd-decode-0"
    assert args["fault"]["kind"] == "stall" and args["fault"]["rank"] == 1 and args["fault"]["duration_s"] == 5


def test_the_environment_switch_opens_it_and_bad_faults_are_400():
    engine = AdminFakeEngine()
    with _client(engine, {"MESHSERVE_FAULT_INJECTION": "1"}) as client:
        for body in ({"kind": "melt"}, {"kind": "stall", "duration_s": -1}, {"kind": "kill", "colour": "red"}, [1]):
            assert_openai_error(client.post("/admin/faults", json=body), 400)
    assert engine.admin_calls == []
