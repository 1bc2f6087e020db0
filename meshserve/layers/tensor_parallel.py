"""Attention tensor parallelism: which piece of a checkpoint tensor a rank keeps, and the sharded layers.

Over an attention TP group of size a, a rank keeps an equal contiguous piece of each
split weight (`Shard`): the output rows of column-parallel projections (its heads, its
MLP columns, its vocabulary slice) and the input columns of row-parallel ones (o_proj,
down_proj), whose partial outputs the group sums. With one rank every helper here is
the plain single-device computation, so the single-rank path is unchanged.

With `oproj=TPk` MLA's o_proj alone is shared over an o_proj group of k DP groups
(`head_sharded_output_projection`); each DP group still computes all heads' attention.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from meshserve.layers.linear import linear
from meshserve.parallel.context import ParallelContext


class _Piece:
    """A contiguous piece of a checkpoint tensor along `dim`; subclasses say where (`bounds`)."""

    dim: int

    def bounds(self, size: int, name: str) -> tuple[int, int]:  # pragma: no cover - abstract
        raise NotImplementedError

    def take(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """The piece of a full tensor (a view)."""
        start, length = self.bounds(tensor.shape[self.dim], name)
        return tensor.narrow(self.dim, start, length)

    def read(self, stored, name: str) -> torch.Tensor:
        """Read only the piece from a safetensors slice handle (`safe_open(...).get_slice(name)`)."""
        shape = stored.get_shape()
        start, length = self.bounds(shape[self.dim], name)
        return stored[(slice(None),) * self.dim + (slice(start, start + length),)]


@dataclass(frozen=True)
class Shard(_Piece):
    """Piece `index` of `parts` equal contiguous pieces of a checkpoint tensor along `dim`."""

    dim: int
    index: int
    parts: int

    def bounds(self, size: int, name: str) -> tuple[int, int]:
        """(start, length) of the piece in a dimension of `size`."""
        if size % self.parts:
            raise ValueError(f"weight {name!r}: dimension {self.dim} of size {size} does not split evenly "
                             f"into {self.parts} parts")
        length = size // self.parts
        return self.index * length, length


@dataclass(frozen=True)
class Span(_Piece):
    """Rows [start, start + length) of a checkpoint tensor along `dim` (an uneven split: packed experts of an
    EP rank whose experts do not split evenly over the ranks)."""

    dim: int
    start: int
    length: int

    def bounds(self, size: int, name: str) -> tuple[int, int]:
        if not 0 <= self.start <= self.start + self.length <= size:
            raise ValueError(f"weight {name!r}: rows [{self.start}, {self.start + self.length}) of dimension "
                             f"{self.dim} are outside its size {size}")
        return self.start, self.length


def attention_tp_shard(parallel: ParallelContext, dim: int) -> Shard | None:
    """This rank's piece along `dim` of a weight split over the attention TP group; None with one rank."""
    if parallel.attn_tp_size == 1:
        return None
    return Shard(dim, parallel.attn_tp_rank, parallel.attn_tp_size)


def attention_tp_part(parallel: ParallelContext, size: int, what: str) -> int:
    """This rank's share of `size` (heads, columns, vocabulary) over the attention TP group."""
    return parallel.shard_range(size, parallel.attn_tp_size, parallel.attn_tp_rank, what)[1]


def row_parallel_linear(parallel: ParallelContext, x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T over this rank's input columns, summed over the attention TP group; the bias added once."""
    if parallel.attn_tp_size == 1:
        return linear(x, weight, bias)
    out = linear(x, weight)
    if x.shape[0]:  # every rank of the group holds the same tokens, so all of them skip an empty batch
        parallel.attn_all_reduce(out)
    return out if bias is None else out.add_(bias)


def oproj_shard(parallel: ParallelContext) -> Shard | None:
    """This rank's input columns (its heads-shard) of an o_proj shared over the o_proj group; None without one."""
    if parallel.oproj_size == 1:
        return None
    return Shard(1, parallel.oproj_rank, parallel.oproj_size)


def head_sharded_output_projection(parallel: ParallelContext, attn_out: torch.Tensor, weight: torch.Tensor,
                                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """o_proj shared over the o_proj group (xDeepServe Fig. 10): attn_out [T, heads * v] of this rank's own
    tokens -> [T, hidden].

    Member i holds the input columns of heads-shard i (`weight` [hidden, heads/k * v]). The first all-to-all
    brings member i heads-shard i of every member's tokens, it projects them with its columns, and the second
    returns each token's partial sums to its owner, which adds its k of them. Every member runs both all-to-alls,
    also with no tokens of its own; a group without tokens skips them together.
    """
    k = parallel.oproj_size
    num_tokens, width = attn_out.shape[0], weight.shape[1]
    counts = parallel.oproj_token_counts(num_tokens, attn_out.device)
    if not any(counts):
        return attn_out.new_zeros(0, weight.shape[0])
    # rows for member i: heads-shard i of each of this rank's tokens
    by_member = attn_out.view(num_tokens, k, width).transpose(0, 1).reshape(k * num_tokens, width)
    received = parallel.oproj_all_to_all(attn_out.new_empty(sum(counts), width), by_member, counts,
                                         [num_tokens] * k)
    partial = linear(received, weight)  # [sum(counts), hidden]: this shard's share of every member's tokens
    returned = parallel.oproj_all_to_all(partial.new_empty(k * num_tokens, partial.shape[1]), partial,
                                         [num_tokens] * k, counts)
    out = returned.view(k, num_tokens, partial.shape[1]).sum(dim=0)
    return out if bias is None else out.add_(bias)


class VocabParallelEmbedding(torch.nn.Module):
    """Token embedding whose rows (the vocabulary) are split over the attention TP group.

    A rank looks up the ids in its slice, writes zeros for the others, and the group sums.
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 parallel: ParallelContext | None = None) -> None:
        super().__init__()
        self.parallel = parallel or ParallelContext.single()
        tp = self.parallel.attn_tp_size
        self.vocab_size = vocab_size
        self.vocab_start, self.num_local = self.parallel.shard_range(vocab_size, tp, self.parallel.attn_tp_rank,
                                                                     "vocab_size")
        # inference only: no init (loading overwrites it) and no autograd
        self.weight = torch.nn.Parameter(torch.empty(self.num_local, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.attn_tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.num_local)
        out = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        if input_ids.numel():
            self.parallel.attn_all_reduce(out)
        return out


def vocab_parallel_logits(parallel: ParallelContext, hidden_states: torch.Tensor,
                          weight: torch.Tensor) -> torch.Tensor:
    """float32 logits over the whole vocabulary from an LM head whose rows are this rank's vocabulary slice."""
    logits = linear(hidden_states, weight)
    if parallel.attn_tp_size > 1:
        if hidden_states.shape[0]:
            logits = parallel.attn_all_gather_last(logits)
        else:
            logits = logits.new_empty(0, weight.shape[0] * parallel.attn_tp_size)
    return logits.float()
