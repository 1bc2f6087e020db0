"""The training loop: a preset of any supported architecture on the standard-library corpus.

The main model is HF transformers' (DeepseekV3ForCausalLM, Qwen3MoeForCausalLM, Qwen3ForCausalLM),
initialised from the factory's seeded random checkpoint, trained in float32 with the next-token
loss; DeepSeek-V3 adds the MTP module's loss for token t+2 (weight `mtp_loss_weight`, DeepSeek-V3
report §2.2) with the output head shared between the two. AdamW, linear warmup then cosine decay,
gradient clipping. DeepSeek-V3 routers keep balanced with the report's auxiliary-loss-free bias
update (§2.1.2: after each step, bias += gamma * sign(mean load - load)); Qwen3-MoE uses its
load-balancing loss. The same seed on the same number of threads gives identical weights.

The result is written with the factory's layout (config, tokenizer, safetensors shards), the MTP
layer under `model.layers.{num_hidden_layers}.*`, plus `train_report.json`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from meshserve.models.draft_vocab import write_draft_vocab
from meshserve.models.factory import make_model, make_staging_dir, preset_config, rename_into_place
from meshserve.models.hf_experts import split_experts
from meshserve.train.checkpoint import write_checkpoint
from meshserve.train.corpus import Corpus, heldout_batches, load_corpus, train_batches
from meshserve.train.mtp import MTPLayer, from_pretrained_quietly, read_layer_tensors
from meshserve.utils.cpu_features import has_native_bf16

logger = logging.getLogger(__name__)

REPORT_FILE = "train_report.json"

# Per preset: steps, sequence length and batch chosen from measured throughput on 2 CPU cores
# (deepseek_v3 with its MTP layer: tiny a few minutes; small about an hour with its MTP distillation, enough for
# its drafts to pay at batch 1).
PRESET_DEFAULTS: dict[str, dict] = {
    "tiny": {"steps": 120, "seq_len": 256, "batch_size": 8, "lr": 4e-3},
    "small": {"steps": 320, "seq_len": 256, "batch_size": 4, "lr": 3e-3, "mtp_distill_steps": 150},
}


@dataclass(frozen=True)
class TrainSettings:
    arch: str = "deepseek_v3"
    preset: str = "tiny"
    steps: int = 300
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 3e-3
    seed: int = 0
    mtp_loss_weight: float = 0.3
    warmup_fraction: float = 0.05
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # gamma of DeepSeek-V3's bias update: the report's 0.001 is for ~10^5 steps, a run here has a few hundred
    router_bias_speed: float = 1e-2
    eval_sequences: int = 16
    eval_every: int = 0  # 0: four evaluations over the run
    # bfloat16 autocast for the matmuls, weights and optimizer in float32: 1.6x the tokens/s of float32 on 2 cores
    # that multiply bf16 natively; where they do not (AVX2), bf16 is emulated and float32 is the default
    bf16: bool = field(default_factory=has_native_bf16)
    # The factory draws output heads for logits of std 3 (clear greedy margins in a random model): a held-out
    # loss of ~30 nats that costs the first ~100 steps to undo. Training starts from that init with the head
    # scaled by this factor (near-uniform predictions); the report gives both starting points.
    head_init_scale: float = 0.1
    # torch threads while training. One by default: on a shared machine two OpenMP threads spin-wait for each
    # other (2-7x slower than one measured here), and a fixed count keeps the weights the same on every machine.
    threads: int = 1
    # Stage 2 (DeepSeek-V3): steps that train the MTP layer alone, the main model frozen, to predict the main
    # model's own distribution of token t+2 (self-distillation: greedy drafts are checked against the main
    # model, not against the text), at this peak learning rate.
    mtp_distill_steps: int = 0
    mtp_distill_lr: float = 1e-3
    overrides: dict | None = None  # config.json overrides (e.g. fewer layers for tests)
    init_dir: str | None = None  # start from this checkpoint instead of the factory's seeded init


def settings_for(arch: str = "deepseek_v3", preset: str = "tiny", **given) -> TrainSettings:
    """Settings with the preset's defaults for whatever `given` leaves out (or sets to None)."""
    preset_config(arch, preset, given.get("overrides"))  # fail fast on bad names and overrides
    chosen = dict(PRESET_DEFAULTS[preset]) | {k: v for k, v in given.items() if v is not None}
    settings = TrainSettings(arch=arch, preset=preset, **chosen)
    _check(settings)
    return settings


def _check(s: TrainSettings) -> None:
    for name in ("steps", "batch_size", "eval_sequences", "threads"):
        if getattr(s, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(s, name)}")
    if s.mtp_distill_steps < 0 or not s.mtp_distill_lr > 0:
        raise ValueError("mtp_distill_steps must not be negative and mtp_distill_lr must be positive")
    if s.seq_len < 4:
        raise ValueError(f"seq_len must be at least 4 (MTP predicts token t+2), got {s.seq_len}")
    if not s.lr > 0 or s.mtp_loss_weight < 0 or s.eval_every < 0 or s.head_init_scale < 0:
        raise ValueError("lr must be positive; mtp_loss_weight, eval_every and head_init_scale must not be negative")


# ---------------------------------------------------------------------------------------------
# Models


@dataclass
class Models:
    main: nn.Module
    mtp: MTPLayer | None
    config: dict  # the checkpoint's config.json

    def parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Every trained parameter once (the MTP head is the main lm_head)."""
        named = list(self.main.named_parameters())
        if self.mtp is not None:
            named += [(f"mtp.{n}", p) for n, p in self.mtp.named_parameters() if not n.startswith("shared_head.head")]
        return named

    def train(self, mode: bool = True) -> None:
        self.main.train(mode)
        if self.mtp is not None:
            self.mtp.train(mode)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        tensors = split_experts(self.main.state_dict())
        if self.mtp is not None:
            tensors |= split_experts(self.mtp.checkpoint_tensors())
        return tensors


def _load_models(init_dir: Path, arch: str) -> Models:
    config = json.loads((init_dir / "config.json").read_text())
    if config["model_type"] != arch:
        raise ValueError(f"{init_dir} holds a {config['model_type']} model, not {arch}")
    # eager experts: the fastest of HF's experts kernels for training on CPU (measured)
    main = from_pretrained_quietly(AutoModelForCausalLM, init_dir, attn_implementation="sdpa",
                                   experts_implementation="eager")
    mtp = None
    if arch == "deepseek_v3":
        if config.get("num_nextn_predict_layers", 0) < 1:
            raise ValueError("training deepseek_v3 needs num_nextn_predict_layers >= 1 (one MTP layer is trained)")
        config["num_nextn_predict_layers"] = 1
        mtp = MTPLayer(main.config, main.config.num_hidden_layers)
        # the factory's init for the MTP layer; the output head is the main one's, the embedding too
        tensors = {n: t for n, t in read_layer_tensors(init_dir, mtp.layer_idx).items()
                   if not n.endswith(".embed_tokens.weight")}
        mtp.load_checkpoint_tensors(tensors, with_head=False)
        mtp.tie_head(main.lm_head)
    models = Models(main=main, mtp=mtp, config=config)
    for _, param in models.parameters():
        param.requires_grad_(True)
    return models


def build_models(settings: TrainSettings, workdir: Path) -> Models:
    """The models to train: the factory's seeded checkpoint (written under `workdir`), or `init_dir`."""
    if settings.init_dir is not None:
        return _load_models(Path(settings.init_dir), settings.arch)
    init_dir = make_model(settings.arch, settings.preset, workdir / "init", seed=settings.seed,
                          overrides=settings.overrides)
    return _load_models(init_dir, settings.arch)


# ---------------------------------------------------------------------------------------------
# Losses and evaluation


@dataclass
class StepOutput:
    loss: torch.Tensor  # what is minimised
    main_loss: torch.Tensor
    main_logits: torch.Tensor  # [B, T-1, V]: predicts ids[:, 1:]
    mtp_loss: torch.Tensor | None = None
    mtp_logits: torch.Tensor | None = None  # [B, T-2, V]: predicts ids[:, 2:]


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def forward_losses(models: Models, ids: torch.Tensor, settings: TrainSettings) -> StepOutput:
    main, mtp = models.main, models.mtp
    moe_aux = models.config["model_type"] == "qwen3_moe"
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16):
        outputs = main.model(input_ids=ids, output_router_logits=moe_aux)
        hidden = outputs.last_hidden_state
        main_logits = main.lm_head(hidden[:, :-1])
        main_loss = _cross_entropy(main_logits, ids[:, 1:])
        out = StepOutput(loss=main_loss, main_loss=main_loss, main_logits=main_logits)
        if moe_aux:
            out.loss = out.loss + main.config.router_aux_loss_coef * _qwen3_moe_balance_loss(main, outputs)
        if mtp is not None:
            # positions 0 .. T-3: each has a token t+2 to predict
            out.mtp_logits = mtp(main, ids[:, :-1], hidden[:, :-1])
            out.mtp_loss = _cross_entropy(out.mtp_logits, ids[:, 2:])
            out.loss = out.loss + settings.mtp_loss_weight * out.mtp_loss
    return out


def _qwen3_moe_balance_loss(main: nn.Module, outputs) -> torch.Tensor:
    # start-up: only Qwen3-MoE training needs it
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    return load_balancing_loss_func(outputs.router_logits, main.config.num_experts, main.config.num_experts_per_tok)


@torch.no_grad()
def evaluate(models: Models, batches: list[torch.Tensor], settings: TrainSettings) -> dict:
    """Held-out metrics: loss, perplexity, top-1 of the next token; for the MTP layer the same for token
    t+2 and how often its top-1 equals the main model's top-1 at t+1 (what greedy MTP drafting accepts)."""
    models.train(False)
    sums = {"loss": 0.0, "top1": 0.0, "mtp_loss": 0.0, "mtp_top1": 0.0, "mtp_agrees_with_main": 0.0}
    main_count = mtp_count = 0
    for ids in batches:
        out = forward_losses(models, ids, settings)
        n = ids[:, 1:].numel()
        main_guess = out.main_logits.argmax(-1)
        sums["loss"] += float(out.main_loss) * n
        sums["top1"] += float((main_guess == ids[:, 1:]).sum())
        main_count += n
        if out.mtp_logits is not None:
            m = ids[:, 2:].numel()
            mtp_guess = out.mtp_logits.argmax(-1)
            sums["mtp_loss"] += float(out.mtp_loss) * m
            sums["mtp_top1"] += float((mtp_guess == ids[:, 2:]).sum())
            sums["mtp_agrees_with_main"] += float((mtp_guess == main_guess[:, 1:]).sum())
            mtp_count += m
    models.train(True)
    result = {"loss": sums["loss"] / main_count, "top1": sums["top1"] / main_count}
    result["perplexity"] = math.exp(min(result["loss"], 700.0))
    if mtp_count:
        for key in ("mtp_loss", "mtp_top1", "mtp_agrees_with_main"):
            result[key] = sums[key] / mtp_count
        result["mtp_perplexity"] = math.exp(min(result["mtp_loss"], 700.0))
    return {key: round(value, 6) for key, value in result.items()}


# ---------------------------------------------------------------------------------------------
# Optimisation


def make_optimizer(models: Models, settings: TrainSettings) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms, biases or the embedding)."""
    decay, no_decay = [], []
    for name, param in models.parameters():
        (decay if param.dim() >= 2 and "embed_tokens" not in name else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)


def lr_factor(step: int, settings: TrainSettings) -> float:
    """Linear warmup, then cosine decay to `min_lr_ratio` of the peak at the last step."""
    warmup = max(1, round(settings.warmup_fraction * settings.steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, settings.steps - warmup)
    return settings.min_lr_ratio + (1 - settings.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class RouterBalancer:
    """DeepSeek-V3's expert balancing (report §2.1.2): counts the experts each router picks during a training
    step, then nudges `e_score_correction_bias` towards the under-loaded experts (auxiliary-loss-free), and
    gives the complementary sequence-wise balance loss alpha * sum_i f_i * P_i of each router."""

    def __init__(self, modules: list[nn.Module], speed: float, alpha: float) -> None:
        # start-up: only DeepSeek-V3 training needs it
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        self.routers = [m for module in modules for m in module.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.speed, self.alpha = speed, alpha
        self.counting = False
        self.loads = [torch.zeros(r.num_experts) for r in self.routers]
        self.routed: list[tuple[torch.Tensor, torch.Tensor]] = []  # this step's (router logits, chosen experts)
        for router, load in zip(self.routers, self.loads):
            router.register_forward_hook(self._counter(load))

    def _counter(self, load: torch.Tensor):
        def count(_module, _inputs, outputs) -> None:
            if self.counting:
                logits, _, chosen = outputs
                load.add_(torch.bincount(chosen.flatten(), minlength=load.numel()).to(load.dtype))
                self.routed.append((logits, chosen))
        return count

    def sequence_balance_loss(self, batch_size: int) -> torch.Tensor | None:
        """The sequence-wise balance loss of the routing counted since the last call (None: no router)."""
        routed, self.routed = self.routed, []
        if not routed or self.alpha == 0:
            return None
        total = torch.zeros(())
        for logits, chosen in routed:
            experts, top_k = logits.shape[-1], chosen.shape[-1]
            scores = logits.float().sigmoid().view(batch_size, -1, experts)
            tokens = scores.shape[1]
            share = (scores / scores.sum(-1, keepdim=True)).mean(1)  # P_i per sequence
            picks = torch.zeros_like(share).scatter_add_(
                1, chosen.view(batch_size, -1), torch.ones(batch_size, tokens * top_k))
            fraction = picks * experts / (top_k * tokens)  # f_i per sequence: 1 when balanced
            total = total + (fraction * share).sum(-1).mean()
        return self.alpha * total

    @torch.no_grad()
    def update(self) -> float:
        """Apply the bias update for the step just counted; returns the worst max/mean expert load."""
        worst = 1.0
        for router, load in zip(self.routers, self.loads):
            if load.sum() > 0:
                worst = max(worst, float(load.max() / load.mean()))
                router.e_score_correction_bias += self.speed * torch.sign(load.mean() - load)
            load.zero_()
        return round(worst, 3)


# ---------------------------------------------------------------------------------------------
# The loop


def _progress_bar(settings: TrainSettings, enabled: bool) -> tqdm:
    interactive = sys.stderr.isatty()
    return tqdm(total=settings.steps, desc=f"train {settings.arch}-{settings.preset}", unit="step",
                disable=not enabled, mininterval=0.5 if interactive else 30.0, dynamic_ncols=interactive)


def _eval_steps(settings: TrainSettings) -> set[int]:
    every = settings.eval_every or max(1, settings.steps // 4)
    return {step for step in range(every, settings.steps, every)}


@contextlib.contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_training(models: Models, corpus: Corpus, settings: TrainSettings, progress: bool = True) -> dict:
    """Train `models` in place on `settings.threads` threads; returns the report (evaluations before, during
    and after)."""
    with _torch_threads(settings.threads):
        return _run_training(models, corpus, settings, progress)


def _run_training(models: Models, corpus: Corpus, settings: TrainSettings, progress: bool) -> dict:
    torch.manual_seed(settings.seed)
    eval_set = heldout_batches(corpus, settings.eval_sequences, settings.seq_len, settings.batch_size)
    factory_init = None
    if settings.init_dir is None and settings.head_init_scale != 1.0:
        factory_init = evaluate(models, eval_set, settings)
        with torch.no_grad():
            models.main.lm_head.weight.mul_(settings.head_init_scale)
    untrained = evaluate(models, eval_set, settings)
    logger.info("step 0 (untrained): held-out %s", untrained)
    optimizer = make_optimizer(models, settings)
    params = [p for _, p in models.parameters()]
    balancer = RouterBalancer([models.main] + ([models.mtp] if models.mtp else []), settings.router_bias_speed,
                              models.config.get("aux_loss_alpha", 0.0))
    batches: Iterator[torch.Tensor] = train_batches(corpus, settings.batch_size, settings.seq_len, settings.seed)
    history, eval_steps, smoothed, worst_load = [], _eval_steps(settings), None, 1.0
    models.train(True)
    start = time.perf_counter()
    with _progress_bar(settings, progress) as bar:
        for step in range(settings.steps):
            for group in optimizer.param_groups:
                group["lr"] = settings.lr * lr_factor(step, settings)
            ids = next(batches)
            balancer.counting = True
            out = forward_losses(models, ids, settings)
            balancer.counting = False
            balance = balancer.sequence_balance_loss(ids.shape[0])
            (out.loss if balance is None else out.loss + balance).backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, settings.grad_clip))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            worst_load = balancer.update()
            loss = float(out.loss.detach())
            smoothed = loss if smoothed is None else 0.9 * smoothed + 0.1 * loss
            entry = {"step": step + 1, "loss": round(loss, 4), "main_loss": round(float(out.main_loss.detach()), 4),
                     "grad_norm": round(grad_norm, 3)}
            if balance is not None:
                entry |= {"balance_loss": round(float(balance.detach()), 5), "max_over_mean_expert_load": worst_load}
            if out.mtp_loss is not None:
                entry["mtp_loss"] = round(float(out.mtp_loss.detach()), 4)
            if step + 1 in eval_steps:
                entry["heldout"] = evaluate(models, eval_set, settings)
                bar.write(f"step {step + 1}: held-out loss {entry['heldout']['loss']:.3f}"
                          + (f", MTP top-1 {entry['heldout']['mtp_top1']:.3f}" if models.mtp else ""))
            history.append(entry)
            bar.set_postfix(loss=f"{smoothed:.3f}", refresh=False)
            bar.update(1)
    train_seconds = time.perf_counter() - start
    trained = evaluate(models, eval_set, settings)
    tokens = settings.steps * settings.batch_size * settings.seq_len
    return {
        "steps": settings.steps, "tokens_seen": tokens, "train_seconds": round(train_seconds, 1),
        "tokens_per_second": round(tokens / train_seconds, 1), "threads": torch.get_num_threads(),
        "eval_tokens": sum(int(b[:, 1:].numel()) for b in eval_set),
        "factory_init": factory_init or untrained, "untrained": untrained, "trained": trained,
        "max_over_mean_expert_load_last_step": round(worst_load, 3),
        "history": history,
    }


def distill_mtp(models: Models, corpus: Corpus, settings: TrainSettings, progress: bool = True) -> dict:
    """Stage 2: the MTP layer learns the main model's distribution of token t+2 given the tokens up to t+1 (the
    KL divergence from the main model's softmax at t+1), the main model and the shared head frozen. Its own
    seed and batches, so it gives the same result straight after stage 1 or from stage 1's checkpoint."""
    with _torch_threads(settings.threads):
        return _distill_mtp(models, corpus, settings, progress)


def _distill_mtp(models: Models, corpus: Corpus, settings: TrainSettings, progress: bool) -> dict:
    torch.manual_seed(settings.seed + 1)
    stage = dataclasses.replace(settings, steps=settings.mtp_distill_steps, lr=settings.mtp_distill_lr)
    eval_set = heldout_batches(corpus, settings.eval_sequences, settings.seq_len, settings.batch_size)
    before = evaluate(models, eval_set, settings)
    params = [p for name, p in models.mtp.named_parameters() if not name.startswith("shared_head.head")]
    frozen = [p for _, p in models.main.named_parameters()]
    for param in frozen:
        param.requires_grad_(False)
    optimizer = torch.optim.AdamW(params, lr=stage.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, foreach=True)
    batches = train_batches(corpus, settings.batch_size, settings.seq_len, settings.seed + 1)
    history = []
    models.train(True)
    start = time.perf_counter()
    try:
        with tqdm(total=stage.steps, desc=f"distill MTP {settings.arch}-{settings.preset}", unit="step",
                  disable=not progress, mininterval=0.5 if sys.stderr.isatty() else 30.0) as bar:
            for step in range(stage.steps):
                for group in optimizer.param_groups:
                    group["lr"] = stage.lr * lr_factor(step, stage)
                loss = _distill_loss(models, next(batches), settings)
                loss.backward()
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, settings.grad_clip))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                kl = float(loss.detach())
                history.append({"step": step + 1, "kl": round(kl, 4), "grad_norm": round(grad_norm, 3)})
                bar.set_postfix(kl=f"{kl:.3f}", refresh=False)
                bar.update(1)
    finally:
        for param in frozen:
            param.requires_grad_(True)
    seconds = time.perf_counter() - start
    after = evaluate(models, eval_set, settings)
    logger.info("MTP distillation: agreement with the main model %.3f -> %.3f", before.get("mtp_agrees_with_main", 0),
                after.get("mtp_agrees_with_main", 0))
    return {"steps": stage.steps, "seconds": round(seconds, 1), "before": before, "after": after, "history": history}


def _distill_loss(models: Models, ids: torch.Tensor, settings: TrainSettings) -> torch.Tensor:
    main = models.main
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16):
        with torch.no_grad():
            hidden = main.model(input_ids=ids).last_hidden_state
            # the main model at t+1 predicts token t+2, as the MTP layer at t does
            target = F.log_softmax(main.lm_head(hidden[:, 1:-1]).float(), dim=-1)
        mtp_logits = models.mtp(main, ids[:, :-1], hidden[:, :-1])
    log_probs = F.log_softmax(mtp_logits.float(), dim=-1)
    return F.kl_div(log_probs.flatten(0, 1), target.flatten(0, 1), log_target=True, reduction="batchmean")


def train(settings: TrainSettings, out_dir: str | Path, progress: bool = True) -> Path:
    """Train per `settings` and write the checkpoint and `train_report.json` to `out_dir`.

    The directory appears complete or not at all (a staging sibling renamed into place); an existing
    non-empty `out_dir` is never overwritten (FileExistsError).
    """
    start = time.perf_counter()
    out_dir, staging = make_staging_dir(out_dir)
    try:
        corpus = load_corpus()
        with tempfile.TemporaryDirectory(dir=staging) as workdir:
            models = build_models(settings, Path(workdir))
            report = run_training(models, corpus, settings, progress)
            if models.mtp is not None and settings.mtp_distill_steps:
                report["mtp_distill"] = distill_mtp(models, corpus, settings, progress)
        write_checkpoint(staging, models.config, models.checkpoint_tensors())
        # the tokens speculative decoding's drafts score first (FR-Spec): ranked by the training text's counts
        counts = torch.bincount(corpus.train, minlength=int(models.config["vocab_size"]))
        write_draft_vocab(staging, counts.tolist(), source=corpus.summary()["source"] + ", training split")
        report = {"arch": settings.arch, "preset": settings.preset, "settings": dataclasses.asdict(settings),
                  "corpus": corpus.summary(), "wall_seconds": round(time.perf_counter() - start, 1)} | report
        (staging / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        rename_into_place(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def summary(report: dict) -> dict:
    """The report without the per-step history (what the CLI prints)."""
    return {key: value for key, value in report.items() if key != "history"}
