"""One frontend of a multi-TE deployment: a job executor behind the OpenAI API.

`meshserve serve --deployment` runs the first frontend in its own process and, when the deployment
asks for more job executors (`job_executors: N`), starts the others with this module; every TE
registers with all of them, so any frontend can take any request (deepserve §3: JE replicas).
"""
from __future__ import annotations

import logging
import signal

from meshserve.entrypoints.openai.server_options import server_options
from meshserve.router.pd_heatmap import PDHeatmap

logger = logging.getLogger(__name__)


def make_job_executor(model: str, host: str, register_port: int, policy: str, heatmap_path: str | None,
                      predictor_path: str | None, served_model_name: str | None = None,
                      manager_addrs: list[str] | None = None, hold_s: float = 0.0, name: str = "",
                      http_addr: str = ""):
    """The JE of a frontend; `manager_addrs`, `hold_s`, `name`, `http_addr`: as Router's (a cluster manager's
    JE reports to it and holds requests while a pool scales from zero)."""
    # keeps torch out of `meshserve` start-up: only a serving router needs it
    from meshserve.router.router import Router

    heatmap = predictor = None
    if heatmap_path:
        heatmap = PDHeatmap.load(heatmap_path)
    if predictor_path:
        # keeps torch out of the router unless a predictor is given
        from meshserve.router.length_predictor import LengthPredictor

        predictor = LengthPredictor.load(predictor_path)
    return Router(model, served_model_name=served_model_name, host=host, register_port=register_port,
                       policy=policy, heatmap=heatmap, predictor=predictor, manager_addrs=list(manager_addrs or ()),
                       hold_s=hold_s, name=name, http_addr=http_addr)


def run_frontend(model: str, host: str, port: int, register_port: int, policy: str, heatmap: str | None,
                 predictor: str | None, served_model_name: str | None, max_queue_hint: int,
                 log_level: int = logging.INFO, server: dict | None = None, manager_addrs: list[str] | None = None,
                 hold_s: float = 0.0, name: str = "") -> None:
    """An extra frontend process (started by `meshserve serve --deployment`, or by the cluster manager);
    serves until SIGTERM. `server` holds the HTTP settings but the keys, which come from the environment.
    `manager_addrs`: cluster managers it reports to; `hold_s`: how long a request may wait for a TE."""
    # start-up: fastapi and uvicorn only when serving
    from meshserve.entrypoints.openai.api_server import run_server

    logging.basicConfig(level=log_level, format=f"%(asctime)s frontend:{port} %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us in order
    je = make_job_executor(model, host, register_port, policy, heatmap, predictor, served_model_name,
                           manager_addrs=manager_addrs, hold_s=hold_s, name=name, http_addr=f"http://{host}:{port}")
    try:
        logger.info("job executor on http://%s:%d, TEs register at %s", host, port, je.register_addr)
        run_server(je, host, port, log_level=logging.getLevelName(log_level).lower(),
                   served_model_name=je.model_name, max_queue_hint=max_queue_hint,
                   options=server_options(**(server or {})))
    finally:
        je.shutdown()
