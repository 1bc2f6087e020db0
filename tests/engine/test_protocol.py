"""Both engines the API server drives (the async engine client and the job executor's Router), and the fake
engines of the API tests, provide every member of `EngineClientProtocol`, with its parameters."""
from __future__ import annotations

import inspect
import re

import pytest

from meshserve.engine.async_client import AsyncEngineClient
from meshserve.engine.protocol import EngineClientProtocol
from meshserve.router.router import Router
from tests.entrypoints.openai.fake_server import AdminFakeEngine
from tests.entrypoints.openai.test_api import FakeEngine

ATTRIBUTES = set(EngineClientProtocol.__annotations__)  # plain attributes, which an engine may set in __init__
MEMBERS = ATTRIBUTES | {name for name in vars(EngineClientProtocol) if not name.startswith("_")}


def test_the_protocol_names_what_the_api_server_uses():
    assert MEMBERS == {"model_name", "max_model_len", "tokenizer", "start", "generate", "abort", "healthy",
                       "dead_error", "health", "get_stats", "admin"}


def _assigned_in_source(cls: type, name: str) -> bool:
    """Whether the class (or a meshserve base of it) sets `self.<name>` somewhere."""
    sources = "".join(inspect.getsource(c) for c in cls.__mro__ if c.__module__.startswith("meshserve"))
    return re.search(rf"self\.{name}\s*(:[^=]+)?=", sources) is not None


def _check_methods(cls: type) -> None:
    for name in MEMBERS - ATTRIBUTES:
        wanted, given = getattr(EngineClientProtocol, name), getattr(cls, name, None)
        assert given is not None, f"{cls.__name__} lacks {name}"
        assert isinstance(given, property) == isinstance(wanted, property), f"{cls.__name__}.{name}"
        if isinstance(wanted, property):
            continue
        assert inspect.iscoroutinefunction(given) == inspect.iscoroutinefunction(wanted), f"{cls.__name__}.{name}"
        params = list(inspect.signature(given).parameters)
        wanted_params = list(inspect.signature(wanted).parameters)
        assert params[:len(wanted_params)] == wanted_params, f"{cls.__name__}.{name}{inspect.signature(given)}"


@pytest.mark.parametrize("cls", [AsyncEngineClient, Router])
def test_both_engines_provide_every_member(cls):
    _check_methods(cls)
    for name in ATTRIBUTES:
        assert hasattr(cls, name) or _assigned_in_source(cls, name), f"{cls.__name__} lacks {name}"


@pytest.mark.parametrize("cls", [FakeEngine, AdminFakeEngine])
def test_the_fake_engines_are_engine_clients(cls):
    _check_methods(cls)
    assert isinstance(cls(), EngineClientProtocol)
