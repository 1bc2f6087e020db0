"""Fixtures shared by every test area."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Callable[..., Path]:
    """`tiny_model(arch="deepseek_v3", preset="tiny", *, seed=0, overrides=None, name="model")`: the directory
    of a random HF checkpoint (meshserve.models.factory.make_model), written once per session for each
    distinct set of arguments. Tests only read it; one that changes a checkpoint makes its own."""
    # imported here so that collecting the tests that need no model stays free of torch
    from meshserve.models.factory import make_model

    made: dict[str, Path] = {}

    def make(arch: str = "deepseek_v3", preset: str = "tiny", *, seed: int = 0, overrides: dict | None = None,
             name: str = "model") -> Path:
        key = json.dumps([arch, preset, seed, overrides, name], sort_keys=True)
        if key not in made:
            out_dir = tmp_path_factory.mktemp(f"{arch}-{preset}") / name
            made[key] = make_model(arch, preset, out_dir, seed=seed, overrides=overrides)
        return made[key]

    return make
