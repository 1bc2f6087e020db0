"""meshserve: serving Mixture-of-Experts language models."""
from __future__ import annotations

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # lazy, so `import meshserve` (the CLI, the master process) does not pull in torch
    if name == "LLM":
        from meshserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from meshserve.core.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
