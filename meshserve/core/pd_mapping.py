"""Which prefill rank each decode rank pulls a request's KV from (cloudmatrix-infer §4.3.3).

With MLA every attention-TP rank of a prefill DP group holds the same complete latent cache, so a
decode rank may read from any of them; spreading the decode ranks over the prefill ranks keeps one
link from carrying every transfer. With GQA each TP rank holds a slice of the KV heads, so the
source must hold the same slice: equal TP sizes map TP rank to TP rank (the same formula gives that).
"""
from __future__ import annotations


def source_prefill_tp_rank(prefill_tp: int, decode_tp: int, decode_dp: int, decode_dp_rank: int,
                           decode_tp_rank: int) -> int:
    """The prefill TP rank (inside the DP group holding the request) that this decode rank pulls from.

    The paper's mapping: ratio = prefill_tp / decode_tp, group_size = decode_dp / ratio,
    group_id = decode_dp_rank // group_size, source = group_id * decode_tp + decode_tp_rank. It is
    defined for prefill_tp >= decode_tp with divisible sizes; elsewhere the same idea is applied with
    a group size of at least one and the result wrapped into the prefill TP group.
    """
    for name, value in (("prefill_tp", prefill_tp), ("decode_tp", decode_tp), ("decode_dp", decode_dp)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if not 0 <= decode_dp_rank < decode_dp or not 0 <= decode_tp_rank < decode_tp:
        raise ValueError(f"decode rank (dp {decode_dp_rank}, tp {decode_tp_rank}) "
                         f"outside DP {decode_dp} x TP {decode_tp}")
    ratio = max(1, prefill_tp // decode_tp)
    group_size = max(1, decode_dp // ratio)
    group_id = decode_dp_rank // group_size
    return (group_id * decode_tp + decode_tp_rank) % prefill_tp
