"""One frontend of a multi-TE deployment: a job executor behind the OpenAI API.

`meshserve serve --deployment` runs the first frontend in its own process and, when the deployment
asks for more job executors (`job_executors: N`), starts the others with this module; every TE
registers with all of them, so any frontend can take any request (deepserve §3: JE replicas).
"""
from __future__ import annotations

import logging
import signal

import msgspec

from meshserve.config.router import RouterConfig
from meshserve.entrypoints.openai.server_options import server_options
from meshserve.router.pd_heatmap import PDHeatmap

logger = logging.getLogger(__name__)


def make_job_executor(config: RouterConfig, heatmap_path: str | None = None, predictor_path: str | None = None):
    """The JE of a frontend, with the P/D heatmap and the length predictor its routing policy may use."""
    # keeps torch out of `meshserve` start-up: only a serving router needs it
    from meshserve.router.router import Router

    heatmap = predictor = None
    if heatmap_path:
        heatmap = PDHeatmap.load(heatmap_path)
    if predictor_path:
        # keeps torch out of the router unless a predictor is given
        from meshserve.router.length_predictor import LengthPredictor

        predictor = LengthPredictor.load(predictor_path)
    return Router(config, heatmap=heatmap, predictor=predictor)


def run_frontend(router: dict, host: str, port: int, heatmap: str | None, predictor: str | None,
                 max_queue_hint: int, log_level: int = logging.INFO, server: dict | None = None) -> None:
    """An extra frontend process (started by `meshserve serve --deployment`, or by the cluster manager);
    serves until SIGTERM. `router`: its job executor's settings (a `RouterConfig` as a dict; its `host` and
    `http_addr` come from `host` and `port`, which a placement on another node rewrites); `server` holds the
    HTTP settings but the keys, which come from the environment."""
    # start-up: fastapi and uvicorn only when serving
    from meshserve.entrypoints.openai.api_server import run_server

    logging.basicConfig(level=log_level, format=f"%(asctime)s frontend:{port} %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us in order
    config = msgspec.convert({**router, "host": host, "http_addr": f"http://{host}:{port}"}, RouterConfig)
    je = make_job_executor(config, heatmap, predictor)
    try:
        logger.info("job executor on http://%s:%d, TEs register at %s", host, port, je.register_addr)
        run_server(je, host, port, log_level=logging.getLevelName(log_level).lower(),
                   served_model_name=je.model_name, max_queue_hint=max_queue_hint,
                   options=server_options(**(server or {})))
    finally:
        je.shutdown()
