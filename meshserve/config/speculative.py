"""Speculative decoding: the model's MTP layers draft tokens the main model verifies in one pass."""
from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from meshserve.config.base import ConfigStruct


class SpeculativeConfig(ConfigStruct, frozen=True):
    speculative: Annotated[Literal["none", "mtp"], Meta(
        description="speculative decoding: mtp drafts with the checkpoint's multi-token-prediction layers "
                    "(DeepSeek-V3 / Kimi-K2 num_nextn_predict_layers)")] = "none"
    num_speculative_tokens: Annotated[int, Meta(
        ge=1, le=8, description="draft tokens per sequence and step (one MTP layer applied recursively when the "
                                "checkpoint has fewer)")] = 1
    speculative_draft_vocab: Annotated[int, Meta(
        ge=0, description="the MTP head scores only this many most frequent tokens (FR-Spec: the head's read is "
                          "most of a draft's cost; the model directory's draft_vocab.json ranks them, else the "
                          "tokenizer's id order); 0: the whole vocabulary")] = 0
    speculative_max_batch: Annotated[int, Meta(
        ge=-1, description="decode batches larger than this run without drafts (where verifying costs more than "
                           "it saves); 0: always draft; -1: the engine measures where drafting pays, per batch size")
    ] = 0

    @property
    def enabled(self) -> bool:
        return self.speculative != "none"

    @property
    def num_draft_tokens(self) -> int:
        """Drafts per sequence and step (0 without speculation)."""
        return self.num_speculative_tokens if self.enabled else 0
