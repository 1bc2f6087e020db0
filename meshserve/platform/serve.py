"""`meshserve serve`: one TE behind the OpenAI-compatible API, in the foreground."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def serve(args: argparse.Namespace) -> int:
    from meshserve.cli import engine_config_from_args, resolve_deployment
    from meshserve.engine.async_client import AsyncEngineClient
    from meshserve.platform.api_server import run_server

    resolve_deployment(args)
    model = args.model
    if model is None:
        from meshserve.models.factory import ensure_default_model

        model = str(ensure_default_model())
    if not (Path(model) / "config.json").is_file():
        raise FileNotFoundError(f"{model} is not a model directory (no config.json)")
    config = engine_config_from_args(args, model)  # before any process starts: bad settings fail fast
    log_level = getattr(logging, args.log_level.upper())
    engine = AsyncEngineClient(config, log_level=log_level)
    try:
        logger.info("serving %s as %r on http://%s:%d", model, engine.model_name, args.host, args.port)
        run_server(engine, args.host, args.port, log_level=args.log_level, served_model_name=engine.model_name,
                   max_queue_hint=config.max_waiting)
    finally:
        engine.shutdown()
    return 0
