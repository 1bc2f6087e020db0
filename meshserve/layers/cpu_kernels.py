"""Native CPU kernels for the decode hot spots (csrc/cpu_kernels.cpp).

At decode batch sizes each routed expert sees a few rows, where a library GEMM call
spends more on set-up and thread hand-off than on streaming its weight; absorbed MLA
decode attention through library ops must first gather the paged latent into a
contiguous copy; and norms, RoPE and routing are each a handful of tiny ops. Here a
MoE layer's routed experts (grouping, matmuls, weighted combine) are one op, MLA
decode attention reads the paged cache directly with an online softmax, and the
absorption products, RMSNorm, RoPE and DeepSeek-V3 routing are one op each. A grammar's token mask
(structured outputs) is applied to the logits by one op too, a store per refused token.

They are compiled on first use with the machine's C++ compiler through
`torch.utils.cpp_extension` (for this CPU: `-march=native`) and cached in
`TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`); later processes load
the cached library. Where the build fails, or `MESHSERVE_CPU_KERNELS=0` is set, the
torch path runs instead (same results up to float rounding).
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

import torch

from meshserve.utils import envs

logger = logging.getLogger(__name__)

_SOURCES = sorted(Path(__file__).with_name("csrc").glob("*.cpp"))  # one extension of every kernel file
_EXTENSION_NAME = "meshserve_cpu_kernels"
BLOCK_COLUMNS = 32  # columns per packed weight block (two AVX-512 vectors, four AVX2 ones)

_override = threading.local()


def _extension_name() -> str:
    """The build's name, per CPU model and feature set: a build for another CPU (a cache directory shared
    between machines) would stop on an illegal instruction, so it is never reused."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            lines = [line for line in cpuinfo if line.startswith(("model name", "flags"))]
        fingerprint = "".join(sorted(set(lines)))
    except OSError:
        fingerprint = platform.processor()
    digest = hashlib.sha1(f"{platform.machine()}|{fingerprint}".encode()).hexdigest()[:12]
    return f"{_EXTENSION_NAME}_{digest}"


@functools.cache
def _build() -> bool:
    """Compile (or load the cached build of) the extension once per process; False where that fails."""
    if not envs.cpu_kernels_enabled():
        return False
    try:
        # start-up: cpp_extension costs about 0.25 s, paid only where the kernels are built; a failed import falls back
        import ninja  # the build tool cpp_extension drives; pinned, so its binary may sit outside PATH
        from torch.utils import cpp_extension

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        logger.info("loading native CPU kernels (the first run compiles them, about 15 s)")
        name = _extension_name()
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
        with _builder_lock(build_dir):
            cpp_extension.load(
                name=name, sources=[str(source) for source in _SOURCES], is_python_module=False, verbose=False,
                extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
        return hasattr(torch.ops.meshserve_cpu, "moe_experts")
    except Exception as exc:  # no compiler, no headers: the torch path still serves
        logger.warning("native CPU kernels unavailable, using the torch path: %s", str(exc).splitlines()[0])
        return False


@contextlib.contextmanager
def _builder_lock(build_dir: Path):
    """One process at a time builds or loads the cached build. cpp_extension's own lock is a file that a killed
    build leaves behind, after which every later load waits forever; this one is an flock, which the kernel
    releases when its holder dies, so whoever holds it knows a leftover `lock` file is stale and removes it."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "builder.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("removing the lock a killed build left in %s", build_dir)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _require() -> None:
    if not _build():
        raise RuntimeError("the native CPU kernels are not available here (see the warning logged when loading)")


def enabled() -> bool:
    """Whether the native kernels serve this thread's forwards (built, and not switched off)."""
    if getattr(_override, "off", False):
        return False
    return _build()


@contextlib.contextmanager
def disabled():
    """Run the torch path in this thread (side-by-side comparisons in tests and benchmarks)."""
    previous = getattr(_override, "off", False)
    _override.off = True
    try:
        yield
    finally:
        _override.off = previous


def packable(weight: torch.Tensor) -> bool:
    """Whether a [..., out, in] weight fits the kernels' packed layout."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.shape[-2] % BLOCK_COLUMNS == 0)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[..., out, in] -> [..., out / 32, in, 32]: each block of 32 output columns streams row by row."""
    *lead, out_features, in_features = weight.shape
    blocks = weight.reshape(*lead, out_features // BLOCK_COLUMNS, BLOCK_COLUMNS, in_features)
    return blocks.transpose(-1, -2).contiguous()


@functools.cache
def _bf16_built() -> bool:
    return bool(torch.ops.meshserve_cpu.bf16_native())


def bf16_packable(weight: torch.Tensor) -> bool:
    """Whether a bfloat16 [out, in] weight runs the native bfloat16 kernel here (csrc/bf16_kernels.cpp: a CPU
    with AVX512-BF16, a multiple of 32 outputs, an even number of inputs)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[0] % BLOCK_COLUMNS == 0 and weight.shape[1] % 2 == 0 and enabled() and _bf16_built())


def pack_weight_bf16(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out / 32, in / 2, 32, 2]: each block of 32 output columns streams a pair of inputs at a time."""
    out_features, in_features = weight.shape
    pairs = weight.reshape(out_features // BLOCK_COLUMNS, BLOCK_COLUMNS, in_features // 2, 2)
    return pairs.permute(0, 2, 1, 3).contiguous()


def bf16_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] bfloat16 (rows contiguous) W^T through `pack_weight_bf16`'s layout: [M, N] bfloat16."""
    _require()
    return torch.ops.meshserve_cpu.bf16_linear(x, packed)


def moe_experts(xs: torch.Tensor, offsets: torch.Tensor, w13_packed: torch.Tensor,
                w2_packed: torch.Tensor) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T) W_2^T for rows grouped by expert (expert e: rows offsets[e]:offsets[e+1])."""
    _require()
    return torch.ops.meshserve_cpu.moe_experts(xs, offsets, w13_packed, w2_packed)


def moe_forward(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, first_slot: int,
                w13_packed: torch.Tensor, w2_packed: torch.Tensor) -> torch.Tensor:
    """One MoE layer's routed experts: sum_k w[t, k] * expert_{ids[t, k]}(hidden[t]) over the slots held here
    ([first_slot, first_slot + E)); grouping by expert, the expert matmuls and the weighted combine in one op."""
    _require()
    return torch.ops.meshserve_cpu.moe_forward(hidden, topk_ids, topk_weights, first_slot, w13_packed, w2_packed)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Structured outputs: logits[rows[i], t] = -inf wherever bit t of bitmask row i (int32 words, llguidance's
    layout) is 0; in place, any float dtype."""
    _require()
    torch.ops.meshserve_cpu.apply_token_bitmask_(logits, bitmask, rows)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim (float32, contiguous)."""
    _require()
    return torch.ops.meshserve_cpu.rms_norm(x, weight, eps)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """RoPE in place on x [T, R] or [T, H, R] (rows may be strided) with cos/sin [T, R/2]; returns x."""
    _require()
    torch.ops.meshserve_cpu.rotary_(x, cos, sin, interleaved)
    return x


def grouped_topk(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing of float32 logits [T, E] (as `deepseek_v3.grouped_topk`): (weights, int64 ids)."""
    _require()
    return torch.ops.meshserve_cpu.grouped_topk(logits, bias, top_k, n_group, topk_group, norm_topk_prob,
                                                routed_scaling_factor)


def grouped_linear(x: torch.Tensor, w_packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[m, g] = x[m, g] W_g^T for every group g (x [M, G, K], out [M, G, N]; rows may be strided)."""
    _require()
    torch.ops.meshserve_cpu.grouped_linear(x, w_packed, out)
    return out


def mla_decode_bf16(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, kv_lora_rank: int) -> torch.Tensor:
    """`mla_decode` with a float32 query over a bfloat16 cache (csrc/kv_int8.cpp): float32 math, [B, heads, c]."""
    _require()
    return torch.ops.meshserve_cpu.mla_decode_bf16(q, cache, block_table, seq_lens, scale, kv_lora_rank)


def mla_decode(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               scale: float, kv_lora_rank: int) -> torch.Tensor:
    """softmax(scale * q·entry) · latent over each sequence's paged cache entries: [B, heads, kv_lora_rank]."""
    _require()
    return torch.ops.meshserve_cpu.mla_decode(q, cache, block_table, seq_lens, scale, kv_lora_rank)


if __name__ == "__main__":  # `python -m meshserve.layers.cpu_kernels`: build (or find) them now, as `make install` does
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print("native CPU kernels: " + ("ready" if enabled() else "unavailable, the torch path serves"))
