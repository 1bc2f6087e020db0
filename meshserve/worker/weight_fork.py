"""Fork a rank's weights from a running TE of the same model and layout (deepserve §6, "NPU-fork").

Source (`WeightServer`, a rank started with `serve_weights`): right after its load, the rank writes its
final weight state into one shared-memory region of a transfer engine (`meshserve.transfer`), next to a
small manifest region, and serves both through the engine's TCP block server (cluster-secret handshake,
like every transfer). On the CPU the rank then re-points its own tensors at a private copy-on-write
mapping of that region, so the snapshot costs no second copy of the weights, and whatever the rank
writes later (expert reconfiguration) stays private: the region keeps the state a checkpoint load gives.
Serving a fork costs the source nothing on its host (the kernel maps pages) and, over TCP, reads in the
block server's own threads, so the rank keeps running steps.

Target (`fork_model`, rank r of a new TE with `fork_from`): it builds the model (no weights yet), reads
the source's manifest and refuses a source that differs (model version, dtype, quantization, layout and
rank, expert placement, every tensor's name, shape and dtype) with an error naming the difference. On the
source's host it maps the region privately (copy-on-write: no copy at all, any number of targets at once);
elsewhere it pulls the region over TCP in parallel batches. Then it runs the loader's last step
(`finish_model`: prepacking for the CPU kernels), so it ends exactly like a checkpoint load.

Which state moves: everything a load leaves in the model's tensors after its post-processing (INT8
conversion, FP8 dequantization, MLA's absorbed weights): parameters, buffers, public tensor attributes of
modules (`w13_scale`) and of parameters (`int8_scale`). Private attributes (`_native_packed`,
`_onednn_packed`, `_int8_native`, ...) are caches that `finish_model` rebuilds from those (oneDNN's packed
tensors could not travel anyway). Two walked tensors sharing memory would lose their aliasing in a
copy: the source refuses to serve such a model rather than fork it wrongly.
"""
from __future__ import annotations

import logging
import math
import mmap
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import msgpack
import torch

from meshserve.models.base import CausalLM
from meshserve.models.loader import finish_model, load_hf_config, new_model, shard_weights
from meshserve.parallel.context import ParallelContext
from meshserve.transfer import BlockRef, TransferEngine, TransferStatus
from meshserve.transfer import tcp as tcp_mod
from meshserve.transfer.engine import host_id
from meshserve.transfer.shm import dtype_from_str, dtype_to_str
from meshserve.utils.checkpoint_files import content_version, read_safetensors_header, safetensors_files

logger = logging.getLogger(__name__)

FORMAT = 1
DATA_REGION = "weights"
MANIFEST_REGION = "weights.manifest"
BLOCK_BYTES = 1 << 20  # the data region is [blocks, BLOCK_BYTES, 1] bytes
PULL_BLOCKS = 64  # blocks per TCP pull: several pulls run at once
ALIGN = 64  # every tensor starts at a multiple of this in the region
DEFAULT_TIMEOUT_S = 30.0  # per network step of a fork (connect, one pull); a dead source fails within it


class WeightForkError(RuntimeError):
    """A fork that cannot happen: the source is unreachable or serves other weights."""


# ---------------------------------------------------------------- the weight state of a model
@dataclass(frozen=True)
class _Slot:
    """Where one tensor of the weight state lives: `kind` param | buffer | attr (module) | param_attr."""

    name: str
    kind: str
    owner: object  # the module, or for param_attr the parameter
    attr: str

    def get(self) -> torch.Tensor:
        if self.kind == "param":
            return self.owner._parameters[self.attr]
        if self.kind == "buffer":
            return self.owner._buffers[self.attr]
        return self.owner.__dict__[self.attr]

    def set(self, tensor: torch.Tensor) -> None:
        if self.kind == "param":
            self.owner._parameters[self.attr].data = tensor
        elif self.kind == "buffer":
            self.owner._buffers[self.attr] = tensor
        else:
            setattr(self.owner, self.attr, tensor)


def weight_slots(model: torch.nn.Module) -> list[_Slot]:
    """Every tensor of the model's weight state, each once (a tied tensor under its first name)."""
    slots: list[_Slot] = []
    seen: set[int] = set()

    def add(slot: _Slot, tensor: torch.Tensor) -> None:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            slots.append(slot)

    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for key, param in module._parameters.items():
            if param is None:
                continue
            add(_Slot(prefix + key, "param", module, key), param)
            for attr, value in vars(param).items():
                if isinstance(value, torch.Tensor) and not attr.startswith("_"):
                    add(_Slot(f"{prefix}{key}#{attr}", "param_attr", param, attr), value)
        for key, buffer in module._buffers.items():
            if buffer is not None:
                add(_Slot(prefix + key, "buffer", module, key), buffer)
        for attr, value in vars(module).items():
            if (isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)
                    and not attr.startswith("_")):
                add(_Slot(prefix + attr, "attr", module, attr), value)
    return slots


def _check_no_aliases(slots: list[_Slot]) -> None:
    spans = []
    for slot in slots:
        t = slot.get()
        if t.numel() and t.device.type == "cpu":
            spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), slot.name))
    spans.sort()
    for (_, end, name), (start, _, other) in zip(spans, spans[1:]):
        if start < end:
            raise WeightForkError(f"{name} and {other} share memory; a fork would copy them apart")


def _placement(model: torch.nn.Module) -> dict[str, list[int]]:
    """Which expert each local slot of every MoE layer holds (a fork keeps the slots as they are)."""
    return {name: list(module.slot_experts) for name, module in model.named_modules()
            if isinstance(getattr(module, "slot_experts", None), list)}


def fork_identity(model_dir: str | Path, dtype: torch.dtype, quantization: str | None,
                  parallel: ParallelContext) -> dict:
    """What a source and a target must agree on besides the tensors themselves."""
    return {"model_type": load_hf_config(model_dir)["model_type"], "version": content_version(model_dir),
            "dtype": dtype_to_str(dtype), "quantization": quantization or "none",
            "layout": str(parallel.strategy), "rank": parallel.rank, "world_size": parallel.world_size}


# ---------------------------------------------------------------- source
class WeightServer:
    """Publishes one rank's loaded weights for forks; `address` is what a target's `fork_from` names.

    The snapshot into shared memory runs on a background thread (`background=True`), off the TE's start-up:
    the rank serves meanwhile (it only reads the weights). Once it is written, `take_ready()`, called on the
    rank's own thread between steps, turns the rank's tensors into copy-on-write views of the snapshot (no
    second copy) and says the server may be announced."""

    def __init__(self, model: CausalLM, identity: dict, host: str = "127.0.0.1", name: str = "weights",
                 io_timeout: float = DEFAULT_TIMEOUT_S, background: bool = False) -> None:
        self._t0 = time.perf_counter()
        self._slots = weight_slots(model)
        _check_no_aliases(self._slots)
        self._tensors = [slot.get().detach() for slot in self._slots]
        self._entries, offset = [], 0
        for slot, t in zip(self._slots, self._tensors):
            nbytes = t.numel() * t.element_size()
            self._entries.append([slot.name, slot.kind, dtype_to_str(t.dtype), list(t.shape), offset, nbytes])
            offset += -(-nbytes // ALIGN) * ALIGN
        self.nbytes = offset
        self._manifest = msgpack.packb({"format": FORMAT, "identity": identity, "placement": _placement(model),
                                        "nbytes": offset, "tensors": self._entries}, use_bin_type=True)
        self._blocks = max(1, math.ceil(offset / BLOCK_BYTES))
        self.engine = TransferEngine(name, host=host, io_timeout=io_timeout)
        self._written = threading.Event()
        self._error: BaseException | None = None
        self.ready = False
        try:
            self._flat = self.engine.allocate_region(DATA_REGION, 1, self._blocks, BLOCK_BYTES, (1,),
                                                     torch.uint8)[0].view(-1)
            self._meta = self.engine.allocate_region(MANIFEST_REGION, 1, 1, len(self._manifest), (1,),
                                                     torch.uint8)[0]
        except BaseException:
            self.engine.close()
            raise
        host_addr, port = self.engine.tcp_address
        self.address = f"tcp://{host_addr}:{port}"
        if background:
            threading.Thread(target=self._write, name="meshserve-weight-snapshot", daemon=True).start()
        else:
            self._write()
            self.take_ready()

    def _write(self) -> None:
        """Copy every tensor into the region, then the manifest (a fork reads the manifest first: its presence
        means the data is whole)."""
        try:
            for (_, _, _, _, start, nbytes), t in zip(self._entries, self._tensors):
                if nbytes:
                    self._flat[start:start + nbytes].view(t.dtype).view(t.shape).copy_(t)
            self._meta.view(-1).copy_(torch.frombuffer(bytearray(self._manifest), dtype=torch.uint8))
        except BaseException as exc:  # noqa: BLE001 - reported by take_ready on the rank's thread
            self._error = exc
        self._written.set()

    @property
    def pending(self) -> bool:
        return not self.ready and self._error is None

    def take_ready(self) -> bool:
        """On the rank's thread: True once, when the snapshot is whole and the rank runs on its copy-on-write
        views; raises what the snapshot failed with."""
        if self.ready or not self._written.is_set():
            return False
        if self._error is not None:
            error, self._error = self._error, None
            raise WeightForkError(f"the weight snapshot failed: {error}") from error
        if all(t.device.type == "cpu" for t in self._tensors):
            # the rank's own tensors become copy-on-write views of the snapshot: no second copy
            private = _map_private(self.engine.descriptor(DATA_REGION).shm[0].shm_name, self._blocks * BLOCK_BYTES)
            for slot, (_, _, _, _, start, nbytes) in zip(self._slots, self._entries):
                slot.set(_view(private, start, nbytes, slot.get().dtype, slot.get().shape))
        self._tensors = []  # the originals are free once nothing else holds them
        self.ready = True
        logger.info("weight server at %s: %d tensors, %.1f MiB (snapshot ready %.2fs after the load)", self.address,
                    len(self._entries), self.nbytes / 2**20, time.perf_counter() - self._t0)
        return True

    def close(self) -> None:
        self.engine.close()  # stops the server and unlinks the region; forks that mapped it keep their pages


def _map_private(shm_name: str, nbytes: int) -> torch.Tensor:
    """A copy-on-write mapping of a shared-memory segment as bytes: reads share its pages, writes stay here."""
    import _posixshmem

    fd = _posixshmem.shm_open("/" + shm_name.lstrip("/"), os.O_RDONLY, 0o600)
    try:
        mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return torch.frombuffer(mapped, dtype=torch.uint8)


def _view(flat: torch.Tensor, start: int, nbytes: int, dtype: torch.dtype, shape) -> torch.Tensor:
    if not nbytes:
        return torch.empty(shape, dtype=dtype)
    return flat[start:start + nbytes].view(dtype).view(shape)


# ---------------------------------------------------------------- target
def _parse(address: str) -> tuple[str, int]:
    host, sep, port = address.strip().removeprefix("tcp://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise WeightForkError(f"fork source {address!r} is not an address like tcp://HOST:PORT")
    return host, int(port)


def fork_model(address: str, model_dir: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu",
               parallel: ParallelContext | None = None, quantization: str | None = None,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[CausalLM, int]:
    """This rank's model with its weights from the weight server at `address`: (model, bytes it got)."""
    parallel = parallel or ParallelContext.single()
    try:
        descriptors = {d.region: d for d in tcp_mod.describe_remote(_parse(address), timeout_s)}
    except tcp_mod.TransferError as exc:
        raise WeightForkError(f"cannot fork weights from {address}: {exc}") from None
    if DATA_REGION not in descriptors or MANIFEST_REGION not in descriptors:
        raise WeightForkError(f"{address} serves no weights (regions: {', '.join(sorted(descriptors)) or 'none'})")
    model = new_model(model_dir, dtype, device, parallel)
    engine = TransferEngine(f"fork-{os.getpid()}-{parallel.rank}", serve_tcp=False, io_timeout=timeout_s,
                            max_workers=4)
    try:
        peer = descriptors[DATA_REGION].engine
        for desc in descriptors.values():
            backend = engine.link(peer, desc)
        manifest = msgpack.unpackb(bytes(_pull(engine, peer, descriptors[MANIFEST_REGION], timeout_s, address)),
                                   raw=False)
        _materialize(model, model_dir, manifest)
        entries = _check_manifest(manifest, model, fork_identity(model_dir, dtype, quantization, parallel), address)
        data = descriptors[DATA_REGION]
        if backend == "shm" and data.host_id == host_id():
            flat = _map_private(data.shm[0].shm_name, math.prod(data.layers[0].shape))
        else:
            flat = _pull(engine, peer, data, timeout_s, address)
    finally:
        engine.close()
    target = torch.device(device)
    for slot, (_, _, dtype_name, shape, start, nbytes) in entries:
        tensor = _view(flat, start, nbytes, dtype_from_str(dtype_name), shape)
        slot.set(tensor if target.type == "cpu" else tensor.to(target))
    return finish_model(model, model_dir), int(manifest["nbytes"])


def _materialize(model: CausalLM, model_dir: str | Path, manifest: dict) -> None:
    """Create the modules a model makes only while loading (DeepSeek's MTP copy of the embedding): the
    checkpoint tensors whose names end like the missing ones go through `load_weights` as constant
    stride-0 views (no memory read); the fork's data replaces their values."""
    have = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    tails = {".".join(name.split(".")[-2:]) for name, kind, *_ in manifest["tensors"]
             if kind in ("param", "buffer") and name not in have}
    if not tails:
        return
    stand_ins = []
    for path in safetensors_files(model_dir):
        _, header, _ = read_safetensors_header(path)
        for name, info in header.items():
            if name != "__metadata__" and name.endswith(tuple(tails)) and model.wants_weight(name):
                stand_ins.append((name, torch.zeros((), dtype=model_dtype(model)).expand(info["shape"])))
    model.load_weights(shard_weights(model, stand_ins))


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def _pull(engine: TransferEngine, peer: str, desc, timeout_s: float, address: str) -> torch.Tensor:
    """A whole one-layer region of the peer as bytes, pulled in parallel batches of blocks."""
    shape = desc.layers[0].shape
    local = torch.empty(shape, dtype=torch.uint8)
    engine.register(desc.region, [local])
    handles = []
    for first in range(0, shape[0], PULL_BLOCKS):
        ids = tuple(range(first, min(first + PULL_BLOCKS, shape[0])))
        handles.append(engine.transfer(BlockRef(desc.region, ids, peer), BlockRef(desc.region, ids)))
    for handle in handles:
        try:
            done = engine.wait(handle, timeout_s)
        except TimeoutError:
            raise WeightForkError(f"fork from {address}: no data for {timeout_s:.0f}s") from None
        if done.status != TransferStatus.DONE:
            raise WeightForkError(f"fork from {address} failed: {done.error}")
    return local.view(-1)


def _check_manifest(manifest: dict, model: torch.nn.Module, identity: dict,
                    address: str) -> list[tuple[_Slot, list]]:
    """Each manifest tensor with the slot it fills; WeightForkError naming the first difference."""
    def refuse(what: str) -> WeightForkError:
        return WeightForkError(f"cannot fork from {address}: {what}")

    if manifest.get("format") != FORMAT:
        raise refuse(f"it serves weight format {manifest.get('format')!r}, this version reads {FORMAT}")
    theirs = manifest["identity"]
    for key in ("model_type", "version", "dtype", "quantization", "layout", "world_size", "rank"):
        if theirs.get(key) != identity[key]:
            raise refuse(f"its {key} is {theirs.get(key)!r}, this rank's is {identity[key]!r}")
    if manifest["placement"] != _placement(model):
        raise refuse("its expert placement differs from the one this rank starts with")
    mine = {slot.name: slot for slot in weight_slots(model)}
    served = {entry[0]: entry for entry in manifest["tensors"]}
    missing = [name for name, slot in mine.items() if slot.kind in ("param", "buffer") and name not in served]
    if missing:
        raise refuse(f"it serves no {missing[0]} ({len(missing)} tensor(s) of this model missing)")
    out = []
    for name, kind, dtype_name, shape, start, nbytes in manifest["tensors"]:
        slot = mine.get(name) if kind in ("param", "buffer") else _owner_slot(model, name, kind)
        if slot is None or slot.kind != kind:
            raise refuse(f"it serves {kind} {name}, which this model does not have")
        if slot.kind in ("param", "buffer"):
            t = slot.get()
            if list(t.shape) != list(shape):
                raise refuse(f"{name} has shape {tuple(shape)} there, {tuple(t.shape)} here")
            if dtype_name not in (dtype_to_str(t.dtype), "int8"):  # INT8 W8A8 converts weights after loading
                raise refuse(f"{name} is {dtype_name} there, {dtype_to_str(t.dtype)} here")
        out.append((slot, [name, kind, dtype_name, shape, start, nbytes]))
    return out


def _owner_slot(model: torch.nn.Module, name: str, kind: str) -> _Slot | None:
    """The slot of a tensor attribute that post-processing adds (INT8 scales): its owner must exist."""
    try:
        if kind == "param_attr":
            param_name, _, attr = name.partition("#")
            return _Slot(name, kind, model.get_parameter(param_name), attr)
        module_name, _, attr = name.rpartition(".")
        return _Slot(name, kind, model.get_submodule(module_name), attr)
    except AttributeError:
        return None
