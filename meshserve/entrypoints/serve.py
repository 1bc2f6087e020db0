"""`meshserve serve`: one TE behind the OpenAI-compatible API, in the foreground."""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import msgspec

from meshserve.config import ConfigError, EngineConfig, RouterConfig
from meshserve.config.arguments import given_engine_settings, given_settings
from meshserve.entrypoints.engine_args import engine_config_from_args, resolve_deployment
from meshserve.entrypoints.openai.frontend import make_job_executor
from meshserve.entrypoints.openai.server_options import ServerOptions, check_bind, server_options_from_args
from meshserve.models.factory import ensure_default_model
from meshserve.utils.processes import free_tcp_port, launch, stop_process

logger = logging.getLogger(__name__)


def resolve_model(model: str | None) -> str:
    """The model directory to serve: the one given, else the default model (created on first use)."""
    if model is None:
        model = str(ensure_default_model())
    if not (Path(model) / "config.json").is_file():
        raise FileNotFoundError(f"{model} is not a model directory (no config.json)")
    return model


def http_options(args: argparse.Namespace) -> ServerOptions:
    """The HTTP server's settings, checked before any engine process starts (a refused bind fails fast)."""
    options = server_options_from_args(args)
    check_bind(args.host, options)
    return options


def router_config(args: argparse.Namespace, model: str, served_model_name: str | None, routing: str) -> RouterConfig:
    """The first job executor's settings: the deployment file's `routing`, then the router flags given."""
    return RouterConfig(**{"model": model, "served_model_name": served_model_name, "host": args.host,
                           "routing": routing, **given_settings(args, RouterConfig)})


def serve(args: argparse.Namespace) -> int:
    # keeps torch out of `meshserve` start-up; fastapi and uvicorn only when serving
    from meshserve.engine.async_client import AsyncEngineClient
    from meshserve.entrypoints.openai.api_server import run_server
    from meshserve.router.deployment import is_multi_te

    options = http_options(args)
    if args.deployment and is_multi_te(args.deployment):
        return serve_deployment(args, options)
    resolve_deployment(args)
    model = resolve_model(args.model)
    config = engine_config_from_args(args, model)  # before any process starts: bad settings fail fast
    log_level = getattr(logging, args.log_level.upper())
    engine = AsyncEngineClient(config, log_level=log_level)
    try:
        logger.info("serving %s as %r on http://%s:%d", model, engine.model_name, args.host, args.port)
        run_server(engine, args.host, args.port, log_level=args.log_level, served_model_name=engine.model_name,
                   max_queue_hint=config.scheduler_config.max_waiting, options=options,
                   on_signal=engine.begin_shutdown)
    finally:
        engine.shutdown()
    return 0


def serve_deployment(args: argparse.Namespace, options: ServerOptions) -> int:
    """Several TEs (each its own processes) behind job executors and the OpenAI API: the first JE runs in
    this process on --port, further ones (`job_executors: N`) on the next ports, each its own process."""
    # start-up: fastapi and uvicorn only when serving
    from meshserve.entrypoints.openai.api_server import run_server
    from meshserve.router.deployment import launch_tes, load_multi

    # the other frontends read the keys from their environment, never from their command line
    os.environ.update(options.secrets_env)
    deployment = load_multi(args.deployment)
    model = resolve_model(args.model or deployment.model)
    overrides = given_engine_settings(args)  # flags given explicitly apply to every TE
    settings = EngineConfig.from_kwargs(model, **overrides)
    if any(getattr(args, name, None) is not None for name in ("tp", "dp", "ep")):
        raise ConfigError("--tp/--dp/--ep set one TE's layout; give each TE group's `parallel` in the deployment file")
    log_level = getattr(logging, args.log_level.upper())
    served_name = settings.model_config.served_model_name
    max_queue = deployment.waiting_room(overrides)  # the frontend admits what all the TEs may hold waiting
    router = router_config(args, model, served_name, deployment.routing)
    je = make_job_executor(router, deployment.heatmap, deployment.predictor)
    register_addrs = [je.register_addr, *args.also_register]
    procs: list = []
    names: list[str] = []
    try:
        for i in range(1, deployment.job_executors):  # JE replicas
            register_port = free_tcp_port(args.host)
            replica = msgspec.structs.replace(router, register_port=register_port)
            procs.append(launch("frontend", router=msgspec.to_builtins(replica), host=args.host, port=args.port + i,
                                heatmap=deployment.heatmap, predictor=deployment.predictor, max_queue_hint=max_queue,
                                log_level=log_level, server=options.public_kwargs()))
            names.append(f"frontend on port {args.port + i}")
            register_addrs.append(f"tcp://{args.host}:{register_port}")
        tes = deployment.tes()
        procs += launch_tes(tes, model, register_addrs, overrides, log_level)
        names += [f"TE {spec.name}" for spec in tes]

        def all_alive() -> None:
            for name, proc in zip(names, procs):
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited during start-up (exit code {proc.returncode})")

        logger.info("job executor: TEs register at %s; starting %d TE(s)", je.register_addr, len(tes))
        timeout = settings.parallel_config.startup_timeout_s + 30
        je.wait_for_tes_blocking(deployment.role_counts(), timeout, alive=all_alive)
        logger.info("serving %s as %r on http://%s:%d through %d TE(s), routing %s", model, je.model_name,
                    args.host, args.port, len(tes), router.routing)
        run_server(je, args.host, args.port, log_level=args.log_level, served_model_name=je.model_name,
                   max_queue_hint=max_queue, options=options)
    except (TimeoutError, RuntimeError) as exc:
        raise ConfigError(str(exc)) from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()  # a TE's master stops its workers and says goodbye
        for proc in procs:
            stop_process(proc, grace_s=15)
        je.shutdown()
    return 0
