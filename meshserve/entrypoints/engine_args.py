"""The engine config of a command that starts an engine (`serve`, `te`): its flags over its `--deployment`."""
from __future__ import annotations

import argparse

from meshserve.config import ConfigError, Deployment, EngineConfig
from meshserve.config.arguments import given_engine_settings
from meshserve.parallel.strategy import ParallelStrategy, StrategyError


def add_deployment_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("parallel layout")
    group.add_argument("--deployment", default=None,
                       help="deployment YAML (one TE: model, parallel strategy, engine settings, as `meshserve "
                            "plan --out` writes; or several TEs under te_groups) or a preset (colocated, "
                            "colocatedN, MpNd such as 1p1d, joined by +); flags given explicitly override it")
    for name, what in (("tp", "attention tensor-parallel degree"), ("dp", "attention data-parallel degree"),
                       ("ep", "expert-parallel degree (MoE TP fills the rest of the world)")):
        group.add_argument(f"--{name}", type=int, default=None,
                           help=f"{what}; shorthand for --parallel 'attn=TP<tp>+DP<dp> moe=TP<tp*dp/ep>+EP<ep>'")


def engine_config_from_args(args: argparse.Namespace, model: str) -> EngineConfig:
    """Defaults, then the deployment file (if any), then the flags given explicitly."""
    given = given_engine_settings(args)
    kwargs = {**(getattr(args, "deployment_engine", None) or {}), **given}
    degrees = {name: getattr(args, name, None) for name in ("tp", "dp", "ep")}
    if any(value is not None for value in degrees.values()):
        if "parallel" in given:
            raise ConfigError("give either --parallel or --tp/--dp/--ep, not both")
        try:
            strategy = ParallelStrategy.from_degrees(**{k: v if v is not None else 1 for k, v in degrees.items()})
        except StrategyError as exc:
            raise ConfigError(str(exc)) from None
        kwargs["parallel"] = str(strategy)
    return EngineConfig.from_kwargs(model, **kwargs)


def resolve_deployment(args: argparse.Namespace) -> None:
    """Read --deployment (if given) into args: its model unless --model is given, and its engine settings."""
    path = getattr(args, "deployment", None)
    if not path:
        return
    deployment = Deployment.load(path)
    args.deployment_engine = deployment.engine
    if getattr(args, "model", None) is None and deployment.model is not None:
        args.model = deployment.model
