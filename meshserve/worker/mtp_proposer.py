"""Drafts for speculative decoding from the model's multi-token-prediction (MTP) layer (DeepSeek-V3 MTP).

After every main-model step the MTP layer first catches up: for each position the
step made final (a prefill chunk's tokens, a verification's accepted tokens) it
runs on the main model's hidden state there and the embedding of the token that
follows, which fills the MTP layer's own KV cache (one more layer of the paged
cache, so its blocks are cached, pooled and transferred with the rest). Its
output at a sequence's last position gives draft 1; drafts 2..k apply the same
layer again, one position further each time, on its own previous output and the
previous draft (xdeepserve §4.6: one MTP layer reused for k > 1).

The MTP entries written past a sequence's last accepted position are rewritten
by the next catch-up, so rejected drafts leave nothing behind that is ever read.
Under several ranks every rank runs the same number of MTP forwards each step
(empty ones included): the layer's MoE collectives must meet.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from meshserve.layers.linear import attach_packed, linear
from meshserve.layers.metadata import AttentionMetadata


@dataclass
class CatchUp:
    """One sequence's positions made final this step, to run the MTP layer over."""

    req_id: str
    block_ids: list[int]
    start: int  # position of the first
    hidden_rows: list[int]  # the main model's output rows of those positions, in order
    next_token_ids: list[int]  # the token after each position
    one_token_rows: bool  # lay the positions out as one-token decode rows (a verification) or one prefill span
    drafts: bool  # propose drafts from the last position


class MTPProposer:
    def __init__(self, model: torch.nn.Module, num_draft_tokens: int, kv_cache: torch.Tensor, block_size: int,
                 device: torch.device, lockstep: bool, draft_vocab: list[int] | None = None) -> None:
        """`draft_vocab`: the token ids drafts are chosen from (None: all; see meshserve.models.draft_vocab)."""
        self.model = model
        self.num_draft_tokens = num_draft_tokens
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.lockstep = lockstep  # several ranks: every forward runs, empty or not
        self._microbatches = 1  # the current step's split (`propose`)
        self._draft_norm = self._draft_head = self._draft_ids = None
        if draft_vocab is not None:
            norm, weight = model.mtp_head()
            ids = torch.tensor(draft_vocab, dtype=torch.int64, device=device)
            self._draft_norm, self._draft_ids = norm, ids
            self._draft_head = weight.index_select(0, ids)  # contiguous rows: the draft reads only these
            attach_packed(self._draft_head)

    def propose(self, hidden: torch.Tensor, seqs: list[CatchUp], drafting_step: bool = True,
                microbatches: int = 1) -> dict[str, list[int]]:
        """Run the catch-up and (in a drafting step) the drafting forwards; the drafts of each sequence that
        asked for them. `microbatches`: as the step's main forward ran (2: each MTP forward in two overlapped
        halves, on every rank alike)."""
        self._microbatches = microbatches
        x = self._catch_up(hidden, seqs)
        if not drafting_step:
            return {}
        drafting = [i for i, seq in enumerate(seqs) if seq.drafts]
        if not drafting and not self.lockstep:
            return {}
        ends = []  # each drafting sequence's last row in the catch-up output
        row = 0
        for seq in seqs:
            row += len(seq.hidden_rows)
            if seq.drafts:
                ends.append(row - 1)
        state = x.index_select(0, torch.tensor(ends, dtype=torch.int64, device=self.device))
        drafts = {seqs[i].req_id: [] for i in drafting}
        tokens = self._argmax(state)
        for i, token in zip(drafting, tokens):
            drafts[seqs[i].req_id].append(token)
        alive = list(range(len(drafting)))  # indices into `drafting` still drafting
        for depth in range(1, self.num_draft_tokens):
            alive = [j for j in alive if self._has_slot(seqs[drafting[j]], depth)]
            if not alive and not self.lockstep:
                break
            state, tokens = self._draft_step([seqs[drafting[j]] for j in alive], state, alive, drafts, depth)
            for j, token in zip(alive, tokens):
                drafts[seqs[drafting[j]].req_id].append(token)
        return drafts

    def idle_forwards(self, count: int, microbatches: int = 1) -> None:
        """An idle DP group's share of an MTP step: as many (empty) MTP forwards as the busy ones run (the
        catch-up, and when drafting the draft steps after it), split as theirs are."""
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        hidden = torch.empty(0, self.model.params.hidden_size, dtype=self.model.dtype, device=self.device)
        for _ in range(count):
            self.model.forward_mtp(hidden, empty, empty, AttentionMetadata.empty(self.device), self.kv_cache,
                                   microbatches=microbatches)

    # ------------------------------------------------------------------ forwards
    def _catch_up(self, hidden: torch.Tensor, seqs: list[CatchUp]) -> torch.Tensor:
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        positions: list[int] = []
        rows: list[int] = []
        next_ids: list[int] = []
        for seq in seqs:
            count = len(seq.hidden_rows)
            if seq.one_token_rows:
                query_lens.extend([1] * count)
                context_lens.extend(range(seq.start, seq.start + count))
                tables.extend([seq.block_ids] * count)
            else:
                query_lens.append(count)
                context_lens.append(seq.start)
                tables.append(seq.block_ids)
            positions.extend(range(seq.start, seq.start + count))
            rows.extend(seq.hidden_rows)
            next_ids.extend(seq.next_token_ids)
        attn = AttentionMetadata.build(query_lens, context_lens, tables, self.block_size, device=self.device)
        previous = hidden.index_select(0, self._tensor(rows))
        return self.model.forward_mtp(previous, self._tensor(next_ids), self._tensor(positions), attn, self.kv_cache,
                                      microbatches=self._microbatches)

    def _draft_step(self, seqs: list[CatchUp], state: torch.Tensor, alive: list[int],
                    drafts: dict[str, list[int]], depth: int) -> tuple[torch.Tensor, list[int]]:
        """One more draft for each sequence in `seqs` (rows `alive` of `state`), one position further."""
        positions = [seq.start + len(seq.hidden_rows) - 1 + depth for seq in seqs]
        attn = AttentionMetadata.build([1] * len(seqs), positions, [seq.block_ids for seq in seqs], self.block_size,
                                       device=self.device)
        previous = state.index_select(0, self._tensor(alive))
        last_drafts = [drafts[seq.req_id][-1] for seq in seqs]
        out = self.model.forward_mtp(previous, self._tensor(last_drafts), self._tensor(positions), attn,
                                     self.kv_cache, microbatches=self._microbatches)
        new_state = state.clone()
        if alive:
            new_state[self._tensor(alive)] = out
        return new_state, self._argmax(out)

    def _argmax(self, mtp_hidden: torch.Tensor) -> list[int]:
        if mtp_hidden.shape[0] == 0:
            return []
        if self._draft_head is not None:
            logits = linear(self._draft_norm(mtp_hidden), self._draft_head)
            return self._draft_ids[logits.argmax(dim=-1)].tolist()
        # every rank of an attention TP group gathers the same logits, so all get the same drafts
        return self.model.compute_mtp_logits(mtp_hidden).argmax(dim=-1).tolist()

    def _has_slot(self, seq: CatchUp, depth: int) -> bool:
        position = seq.start + len(seq.hidden_rows) - 1 + depth
        return position < len(seq.block_ids) * self.block_size

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)
