"""meshserve: serving Mixture-of-Experts language models."""
from __future__ import annotations

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # lazy: every process imports this package first, and it must stay light
    if name == "LLM":
        from meshserve.engine.llm import LLM  # keeps torch out of the CLI and the master process

        return LLM
    if name == "SamplingParams":
        from meshserve.wire.sampling_params import SamplingParams  # start-up: msgspec only when asked for

        return SamplingParams
    raise AttributeError(name)
