"""Post-training W8A8 INT8 quantization of a checkpoint: `quantize(model_dir, out_dir, method, calibration)`.

Methods:
- `rtn`: every quantized linear rounded to nearest with its per-channel absmax scale; no calibration.
- `smoothquant`: SmoothQuant scale migration (alpha searched per group, see `smoothquant`), then rounding.
- `smoothquant-gptq`: SmoothQuant, then per-channel clip search and GPTQ on the smoothed weights (`gptq`).

Calibration is sequential, layer by layer as GPTQ does it: the inputs of layer L are the outputs of layers
< L already quantized (W8A8 math: int8 weights and per-token int8 inputs), and inside a layer each group is
calibrated on inputs computed with the groups before it already quantized:

  input_layernorm   -> q_a_proj + kv_a_proj_with_mqa (q_proj + kv_a without q-LoRA; q/k/v_proj for Qwen3)
  q_a_layernorm     -> q_b_proj
  kv_b_proj v rows  -> o_proj (DeepSeek MLA; kv_b_proj stays float, so the division is exact)
  post_attention_layernorm -> dense gate/up, or: router (columns scaled, stays float: routing unchanged),
                              shared expert gate/up and every routed expert's gate/up (each on its tokens)
  up_proj rows      -> down_proj (dense; shared expert; routed experts: one alpha, per-expert scales)
  lm_head: clip search + GPTQ without smoothing (the final norm also feeds the MTP layer, which stays float)

A routed expert that saw fewer than `min_expert_tokens` calibration tokens is rounded (RTN) instead of
GPTQ'd; the report counts them. Per-channel row scaling commutes with per-channel quantization, so the
up_proj rows of an already quantized expert are rescaled by changing only their scales.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from meshserve.models import compressed_tensors as ct
from meshserve.models.factory import make_staging_dir, rename_into_place
from meshserve.models.hf_experts import split_experts
from meshserve.models.loader import iter_safetensors
from meshserve.quant import hf
from meshserve.quant.gptq import CLIP_GRID, hessian, quantize_gptq
from meshserve.quant.int8 import fake_quantize_activation, quantize_weight
from meshserve.quant.smoothquant import ALPHA_GRID, Consumer, search_alpha, search_shared_alpha
from meshserve.utils.checkpoint_files import read_safetensors_header, safetensors_files

logger = logging.getLogger(__name__)

METHODS = ("rtn", "smoothquant", "smoothquant-gptq")
REPORT_FILE = "quantize_report.json"


@dataclass
class Options:
    method: str
    alpha_grid: tuple[float, ...] = ALPHA_GRID
    clip_grid: tuple[float, ...] = CLIP_GRID
    search_tokens: int = 2048  # calibration tokens the alpha search evaluates (evenly spaced)
    min_expert_tokens: int = 128  # fewer than this: the expert is rounded (RTN) instead of GPTQ'd
    batch_size: int = 8  # calibration sequences per forward pass
    progress: bool = True

    @property
    def smooth(self) -> bool:
        return self.method in ("smoothquant", "smoothquant-gptq")

    @property
    def use_gptq(self) -> bool:
        return self.method == "smoothquant-gptq"


class _Stop(Exception):
    """Raised by a capture hook once it has what it needs: the rest of the forward is not run."""


@dataclass
class _State:
    model: nn.Module
    config: dict
    options: Options
    quantized: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    report: dict = field(default_factory=lambda: {"layers": [], "rtn_fallback_experts": 0})

    def weight(self, name: str) -> torch.Tensor:
        return hf.linear_weight(self.model, name)

    def store(self, name: str, codes: torch.Tensor, scale: torch.Tensor) -> None:
        """Record the int8 codes of `name` and put their float value into the model."""
        self.weight(name).copy_(codes.float() * scale)
        self.quantized[name] = (codes, scale.float())

    def scale_rows(self, name: str, factor: torch.Tensor) -> None:
        """Divide output rows of `name` by `factor` (codes unchanged for a quantized linear)."""
        w = self.weight(name)
        w.div_(factor.unsqueeze(1))
        if name in self.quantized:
            codes, scale = self.quantized[name]
            self.quantized[name] = (codes, scale / factor.unsqueeze(1))


# ---------------------------------------------------------------------------------------------
# running layers on the calibration set


@dataclass
class _Batches:
    hidden: list[torch.Tensor]  # per chunk: [B, T, H] input of the current layer
    kwargs: list[dict]  # per chunk: the decoder layer's keyword arguments (rope, mask, positions)


def _first_layer_inputs(model: nn.Module, calibration: torch.Tensor, batch_size: int) -> _Batches:
    layer0 = model.model.layers[0]
    hidden, kwargs = [], []

    def grab(_module, args, kw):
        hidden.append(args[0] if args else kw.pop("hidden_states"))
        kwargs.append(dict(kw))
        raise _Stop

    handle = layer0.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for chunk in calibration.split(batch_size):
            try:
                model(input_ids=chunk, use_cache=False)
            except _Stop:
                pass
    finally:
        handle.remove()
    return _Batches(hidden, kwargs)


def _capture(layer: nn.Module, batches: _Batches, module: nn.Module, kind: str,
             extra: Callable[[list], list] | None = None) -> tuple[torch.Tensor, list]:
    """Run `layer` on every chunk until `module`; returns the module's input ("input") or output ("output")
    flattened to [tokens, dim], plus whatever `extra(store)` hooks collected."""
    grabbed: list[torch.Tensor] = []

    def pre(_m, args, kw):
        grabbed.append((args[0] if args else kw["hidden_states"]).detach())
        if extra is None:
            raise _Stop

    def post(_m, _args, output):
        grabbed.append((output[0] if isinstance(output, tuple) else output).detach())
        raise _Stop

    handle = (module.register_forward_pre_hook(pre, with_kwargs=True) if kind == "input"
              else module.register_forward_hook(post))
    collected: list = []
    extra_handles = extra(collected) if extra is not None else []
    try:
        for hidden, kwargs in zip(batches.hidden, batches.kwargs):
            try:
                layer(hidden, **kwargs)
            except _Stop:
                pass
    finally:
        handle.remove()
        for h in extra_handles:
            h.remove()
    x = torch.cat([g.reshape(-1, g.shape[-1]) for g in grabbed])
    return x.float(), collected


def _run_layer(layer: nn.Module, batches: _Batches) -> None:
    batches.hidden = [layer(hidden, **kwargs) for hidden, kwargs in zip(batches.hidden, batches.kwargs)]
    batches.hidden = [h[0] if isinstance(h, tuple) else h for h in batches.hidden]


# ---------------------------------------------------------------------------------------------
# smoothing and quantizing groups


def _sample_rows(n: int, limit: int) -> torch.Tensor:
    if n <= limit:
        return torch.arange(n)
    return torch.linspace(0, n - 1, limit).round().long().unique()


def _smooth(state: _State, x: torch.Tensor, consumers: list[Consumer], fold: Callable[[torch.Tensor], None],
            key: str, extra_columns: list[torch.Tensor] = ()) -> torch.Tensor:
    """Search alpha for the group, fold the scales in (producer / s, consumers' and `extra_columns` weights
    * s) and return the smoothed input; the identity without smoothing."""
    if not state.options.smooth:
        return x
    sample = _sample_rows(x.shape[0], state.options.search_tokens)
    position = torch.full((x.shape[0],), -1, dtype=torch.long)
    position[sample] = torch.arange(sample.numel())
    sampled = []
    for c in consumers:
        rows = None
        if c.rows is not None:
            rows = position[c.rows]
            rows = rows[rows >= 0]
        sampled.append(Consumer(c.name, c.weight, rows))
    alpha, s, info = search_alpha(x[sample], sampled, state.options.alpha_grid)
    state.report["layers"][-1]["groups"][key] = {"alpha": alpha, "error": info["errors"]["none" if alpha is None
                                                                                       else f"{alpha:.2f}"],
                                                  "error_unsmoothed": info["errors"]["none"]}
    if s is None:
        return x
    fold(s)
    for c in consumers:
        c.weight.mul_(s)
    for w in extra_columns:
        w.mul_(s)
    return x / s


def _quantize_shared_input(state: _State, names: list[str], x: torch.Tensor) -> None:
    """Quantize linears that read the same input x (rows stacked: per-row quantization and GPTQ's row-wise
    objective make that the same as one by one)."""
    weights = [state.weight(n) for n in names]
    if state.options.use_gptq:
        stacked = torch.cat([w.float() for w in weights])[None]
        codes, scale, _ = quantize_gptq(stacked, hessian(x)[None], state.options.clip_grid)
        codes, scale = codes[0], scale[0]
    else:
        codes, scale = quantize_weight(torch.cat([w.float() for w in weights]))
    start = 0
    for name, w in zip(names, weights):
        rows = w.shape[0]
        state.store(name, codes[start:start + rows], scale[start:start + rows])
        start += rows


def _quantize_experts(state: _State, names_per_expert: list[list[str]], inputs: list[torch.Tensor]) -> int:
    """Quantize each routed expert's projections (names_per_expert[e], all reading inputs[e]), batched;
    returns how many experts were rounded (too few tokens) instead of GPTQ'd."""
    gptq_ids = [e for e, x in enumerate(inputs)
                if state.options.use_gptq and x.shape[0] >= state.options.min_expert_tokens]
    fallback = 0
    for e, names in enumerate(names_per_expert):
        if e not in gptq_ids:
            if state.options.use_gptq:
                fallback += 1
            for name in names:
                state.store(name, *quantize_weight(state.weight(name).float()))
    if gptq_ids:
        w = torch.stack([torch.cat([state.weight(n).float() for n in names_per_expert[e]]) for e in gptq_ids])
        h = torch.stack([hessian(inputs[e]) for e in gptq_ids])
        codes, scale, _ = quantize_gptq(w, h, state.options.clip_grid)
        for b, e in enumerate(gptq_ids):
            start = 0
            for name in names_per_expert[e]:
                rows = state.weight(name).shape[0]
                state.store(name, codes[b, start:start + rows], scale[b, start:start + rows])
                start += rows
    return fallback


def _hook_inputs(module: nn.Module) -> None:
    module.register_forward_pre_hook(hf.quantize_inputs_hook)


def _norm_fold(norm: nn.Module) -> Callable[[torch.Tensor], None]:
    def fold(s: torch.Tensor) -> None:
        norm.weight.data.div_(s)
    return fold


# ---------------------------------------------------------------------------------------------
# one decoder layer


def _attention(state: _State, prefix: str, layer: nn.Module, batches: _Batches) -> None:
    attn = layer.self_attn
    a = f"{prefix}.self_attn"
    if hasattr(attn, "kv_a_proj_with_mqa"):  # DeepSeek MLA
        first = ["q_a_proj" if hasattr(attn, "q_a_proj") else "q_proj", "kv_a_proj_with_mqa"]
    else:
        first = ["q_proj", "k_proj", "v_proj"]
    names = [f"{a}.{n}" for n in first]
    x, _ = _capture(layer, batches, layer.input_layernorm, "output")
    x = _smooth(state, x, [Consumer(n, state.weight(n)) for n in names], _norm_fold(layer.input_layernorm), "qkv")
    _quantize_shared_input(state, names, x)
    for n in first:
        _hook_inputs(getattr(attn, n))

    if hasattr(attn, "q_a_proj"):
        x, _ = _capture(layer, batches, attn.q_a_layernorm, "output")
        name = f"{a}.q_b_proj"
        x = _smooth(state, x, [Consumer(name, state.weight(name))], _norm_fold(attn.q_a_layernorm), "q_b")
        _quantize_shared_input(state, [name], x)
        _hook_inputs(attn.q_b_proj)

    x, _ = _capture(layer, batches, attn.o_proj, "input")
    name = f"{a}.o_proj"
    if hasattr(attn, "kv_b_proj"):
        nope, v = attn.qk_nope_head_dim, attn.v_head_dim
        kv_b = attn.kv_b_proj.weight.data  # rows: per head [k_nope (nope), v (v)]

        def fold(s: torch.Tensor) -> None:
            per_head = kv_b.view(-1, nope + v, kv_b.shape[1])
            per_head[:, nope:, :].div_(s.view(-1, v, 1))
        x = _smooth(state, x, [Consumer(name, state.weight(name))], fold, "o")
    _quantize_shared_input(state, [name], x)
    _hook_inputs(attn.o_proj)


def _mlp_inner(state: _State, gate: str, up: str, xq: torch.Tensor, act) -> torch.Tensor:
    return act(xq @ state.weight(gate).T) * (xq @ state.weight(up).T)


def _dense_mlp(state: _State, prefix: str, mlp: nn.Module, x: torch.Tensor, fold, key: str,
               extra_columns: list[torch.Tensor] = ()) -> None:
    """gate/up after `fold` (a norm), then up rows -> down; x is the MLP's input."""
    gate, up, down = (f"{prefix}.{n}" for n in ("gate_proj", "up_proj", "down_proj"))
    x = _smooth(state, x, [Consumer(gate, state.weight(gate)), Consumer(up, state.weight(up))], fold, key,
                extra_columns)
    _quantize_shared_input(state, [gate, up], x)
    inner = _mlp_inner(state, gate, up, fake_quantize_activation(x), mlp.act_fn)
    inner = _smooth(state, inner, [Consumer(down, state.weight(down))],
                    lambda s: state.scale_rows(up, s), f"{key}.down")
    _quantize_shared_input(state, [down], inner)
    for n in ("gate_proj", "up_proj", "down_proj"):
        _hook_inputs(getattr(mlp, n))


def _moe(state: _State, prefix: str, layer: nn.Module, batches: _Batches) -> None:
    mlp = layer.mlp
    experts = mlp.experts

    def routing_hook(store: list):
        def grab(_m, args):
            store.append(args[1].reshape(-1, args[1].shape[-1]).detach())
            raise _Stop
        return [experts.register_forward_pre_hook(grab)]

    x, routing = _capture(layer, batches, mlp, "input", extra=routing_hook)
    top_k = torch.cat(routing)
    num = experts.num_experts
    rows = [torch.where((top_k == e).any(dim=-1))[0] for e in range(num)]
    p = f"{prefix}.mlp"
    names = [[f"{p}.experts.{e}.gate_proj", f"{p}.experts.{e}.up_proj"] for e in range(num)]
    consumers = [Consumer(n, state.weight(n), rows[e]) for e in range(num) for n in names[e]]
    shared = getattr(mlp, "shared_experts", None)
    if shared is not None:
        consumers += [Consumer(f"{p}.shared_experts.{n}", state.weight(f"{p}.shared_experts.{n}"))
                      for n in ("gate_proj", "up_proj")]
    router = [mlp.gate.weight.data]
    x = _smooth(state, x, consumers, _norm_fold(layer.post_attention_layernorm), "experts", router)

    # routed experts: gate/up, then up rows -> down with one alpha for the layer
    inputs = [x[r] for r in rows]
    fallback = _quantize_experts(state, names, inputs)
    inner = [_mlp_inner(state, g, u, fake_quantize_activation(xe), experts.act_fn) if xe.shape[0] else xe[:, :0]
             for (g, u), xe in zip(names, inputs)]
    downs = [f"{p}.experts.{e}.down_proj" for e in range(num)]
    if state.options.smooth:
        inner = _smooth_experts_down(state, names, downs, inner)
    _quantize_experts(state, [[d] for d in downs], inner)  # the same experts fall back: counted once
    state.report["layers"][-1]["rtn_fallback_experts"] = fallback
    state.report["rtn_fallback_experts"] += fallback
    if fallback:
        logger.info("%s: %d routed expert(s) with under %d calibration tokens rounded instead of GPTQ'd",
                    p, fallback, state.options.min_expert_tokens)
    experts.w8a8 = True

    if shared is not None:
        s_prefix = f"{p}.shared_experts"
        gate, up, down = (f"{s_prefix}.{n}" for n in ("gate_proj", "up_proj", "down_proj"))
        _quantize_shared_input(state, [gate, up], x)
        inner_s = _mlp_inner(state, gate, up, fake_quantize_activation(x), shared.act_fn)
        inner_s = _smooth(state, inner_s, [Consumer(down, state.weight(down))],
                          lambda s: state.scale_rows(up, s), "shared.down")
        _quantize_shared_input(state, [down], inner_s)
        for n in ("gate_proj", "up_proj", "down_proj"):
            _hook_inputs(getattr(shared, n))


def _smooth_experts_down(state: _State, gate_up: list[list[str]], downs: list[str], inner: list[torch.Tensor]
                         ) -> list[torch.Tensor]:
    """One alpha for all routed experts' up -> down, per-expert scales from each expert's own inputs."""
    live = [e for e, x in enumerate(inner) if x.shape[0] > 0]
    limit = max(1, state.options.search_tokens // max(len(live), 1))
    members = [(inner[e][_sample_rows(inner[e].shape[0], limit)], Consumer(downs[e], state.weight(downs[e])),
                inner[e].abs().amax(dim=0)) for e in live]
    alpha, scales, info = search_shared_alpha(members, state.options.alpha_grid)
    key = "none" if alpha is None else f"{alpha:.2f}"
    state.report["layers"][-1]["groups"]["experts.down"] = {"alpha": alpha, "error": info["errors"][key],
                                                            "error_unsmoothed": info["errors"]["none"]}
    if alpha is None:
        return inner
    out = list(inner)
    for e, s in zip(live, scales):
        state.scale_rows(gate_up[e][1], s)
        state.weight(downs[e]).mul_(s)
        out[e] = inner[e] / s
    return out


def _decoder_layer(state: _State, index: int, layer: nn.Module, batches: _Batches) -> None:
    prefix = f"model.layers.{index}"
    state.report["layers"].append({"layer": index, "groups": {}})
    _attention(state, prefix, layer, batches)
    if hasattr(layer.mlp, "experts"):
        _moe(state, prefix, layer, batches)
    else:
        x, _ = _capture(layer, batches, layer.mlp, "input")
        _dense_mlp(state, f"{prefix}.mlp", layer.mlp, x, _norm_fold(layer.post_attention_layernorm), "mlp")
    _run_layer(layer, batches)


def _lm_head(state: _State, batches: _Batches) -> None:
    model = state.model
    if not ct.is_quantized_module(state.config, "lm_head"):
        return
    if state.options.use_gptq:
        x = torch.cat([model.model.norm(h).reshape(-1, h.shape[-1]) for h in batches.hidden]).float()
        _quantize_shared_input(state, ["lm_head"], x)
    else:
        state.store("lm_head", *quantize_weight(state.weight("lm_head").float()))
    _hook_inputs(model.lm_head)


def _rtn_everything(state: _State, names: list[str]) -> None:
    for name in names:
        state.store(name, *quantize_weight(state.weight(name).float()))


# ---------------------------------------------------------------------------------------------
# entry


def _quantized_names(model_dir: Path, config: dict) -> list[str]:
    """The checkpoint's modules that the format stores in int8 (read from the safetensors headers)."""
    names = []
    for path in safetensors_files(model_dir):
        _, header, _ = read_safetensors_header(path)
        for name in header:
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and ct.is_quantized_module(config, module):
                names.append(module)
    return names


def _output_tensors(state: _State, model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    current = split_experts({k: v.detach() for k, v in state.model.state_dict().items()})
    for name, tensor in iter_safetensors(model_dir):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in state.quantized:
            codes, scale = state.quantized[module]
            yield name, codes
            yield module + ct.SCALE_SUFFIX, scale.float().contiguous()
        elif hf.is_main_model_tensor(name, state.config) and name in current:
            value = current[name]
            yield name, value.to(tensor.dtype) if tensor.is_floating_point() else value
        else:
            yield name, tensor  # the MTP layers, and anything HF's model does not hold


def _progress(total: int, enabled: bool, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, unit="layer")


def quantize(model_dir: str | Path, out_dir: str | Path, method: str, calibration: torch.Tensor | None = None,
             **options) -> dict:
    """Quantize the checkpoint in `model_dir` to a W8A8 INT8 compressed-tensors checkpoint in `out_dir` (which
    must not exist or be empty; written atomically). `calibration`: token ids [sequences, seq_len] (needed by
    every method but `rtn`). `options`: fields of `Options`. Returns the report (also written to
    `out_dir/quantize_report.json`)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    opts = Options(method=method, **options)
    model_dir = Path(model_dir)
    config = hf.read_config(model_dir)
    if ct.read_quantization_config(config) is not None or config.get("quantization_config"):
        raise ValueError(f"{model_dir} is already quantized ({config['quantization_config'].get('quant_method')})")
    if method != "rtn":
        if calibration is None or calibration.dim() != 2 or calibration.numel() == 0:
            raise ValueError(f"method {method} needs calibration token ids [sequences, seq_len]")
        if int(calibration.max()) >= int(config["vocab_size"]) or int(calibration.min()) < 0:
            raise ValueError("calibration token ids fall outside the model's vocabulary")
    final, staging = make_staging_dir(out_dir)  # refuses a non-empty out_dir before any work
    try:
        report = _quantize(model_dir, staging, config, opts, calibration)
        rename_into_place(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return report


def _quantize(model_dir: Path, staging: Path, config: dict, opts: Options, calibration: torch.Tensor | None
              ) -> dict:
    method = opts.method
    start = time.perf_counter()
    torch.manual_seed(0)
    model, _, _ = hf.load_model(model_dir)
    state = _State(model=model, config=config, options=opts)
    names = _quantized_names(model_dir, config)
    with torch.no_grad():
        if method == "rtn":
            _rtn_everything(state, names)
        else:
            batches = _first_layer_inputs(model, calibration.long(), opts.batch_size)
            layers = model.model.layers[: config["num_hidden_layers"]]
            with _progress(len(layers), opts.progress, f"quantize ({method})") as bar:
                for index, layer in enumerate(layers):
                    _decoder_layer(state, index, layer, batches)
                    bar.update(1)
            _lm_head(state, batches)
    missing = sorted(set(names) - set(state.quantized))
    if missing:
        raise RuntimeError(f"not quantized: {missing[:5]}")
    report = {
        "method": method,
        "model": str(model_dir),
        "calibration": None if calibration is None or method == "rtn" else
        {"sequences": int(calibration.shape[0]), "seq_len": int(calibration.shape[1]),
         "tokens": int(calibration.numel())},
        "order": "sequential (layer by layer; each layer calibrated on the outputs of the quantized layers before it)",
        "quantized_linears": len(state.quantized),
        "kept_float": ct.ignore_list(config),
        "seconds": round(time.perf_counter() - start, 2),
        **state.report,
    }
    ct.write_checkpoint(model_dir, staging, config, _output_tensors(state, model_dir))
    report["seconds_with_writing"] = round(time.perf_counter() - start, 2)
    (staging / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return report
