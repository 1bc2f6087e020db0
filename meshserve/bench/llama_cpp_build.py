"""llama.cpp for `meshserve bench llama-cpp`: built from the llama-cpp-python sdist's vendored sources, the model
converted with llama.cpp's own converter and quantized with its own tool.

Everything lands under `<cache>/llama.cpp/` and is reused: the sdist (fetched with pip from the package registry
unless `--llama-cpp-source` names a tarball or a source tree), its build (CMake, native CPU flags, only the two
tools the benchmark runs) and the GGUF files, keyed by the model directory's contents. Whatever cannot be done
here (no cmake, no network, a compile error) raises `LlamaCppUnavailable` with one line saying why; the
benchmark then runs meshserve alone and prints that line.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

from meshserve.utils import envs

# the llama-cpp-python release whose vendored llama.cpp the benchmark builds (its converter knows DeepSeek-V3)
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
TOOLS = ("llama-batched-bench", "llama-quantize")
FORMATS = {"f32": None, "q8_0": "Q8_0"}  # GGUF type -> llama-quantize's name (None: written by the converter)
BUILD_TIMEOUT_S = 1800
CONVERT_TIMEOUT_S = 900


class LlamaCppUnavailable(RuntimeError):
    """llama.cpp cannot be fetched, built or run here (one line: why)."""


@dataclasses.dataclass(frozen=True)
class LlamaCpp:
    source_dir: Path  # llama.cpp's source tree (convert_hf_to_gguf.py, gguf-py/)
    bin_dir: Path

    def tool(self, name: str) -> Path:
        return self.bin_dir / name


def cache_root() -> Path:
    return envs.cache_dir() / "llama.cpp"


def prepare(source: str | None, log: Callable[[str], None]) -> LlamaCpp:
    """llama.cpp built from `source` (an sdist tarball, an extracted sdist, or a llama.cpp tree; None: the pinned
    sdist from the package registry), reusing an earlier build of the same source."""
    if shutil.which("cmake") is None:
        raise LlamaCppUnavailable("cmake is not installed (llama.cpp builds with CMake)")
    root = cache_root()
    tree = _source_tree(Path(source) if source else _download_sdist(root, log), root, log)
    build = root / "build" / hashlib.sha256(str(tree.resolve()).encode()).hexdigest()[:12]
    built = LlamaCpp(source_dir=tree, bin_dir=build / "bin")
    if all(built.tool(name).is_file() for name in TOOLS):
        return built
    log(f"building llama.cpp from {tree} (native CPU flags; a few minutes on 2 cores)")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run(["cmake", "-S", str(tree), "-B", str(build), *generator, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
          "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
          "-DLLAMA_BUILD_TOOLS=ON", "-DBUILD_SHARED_LIBS=OFF"], "configuring llama.cpp", BUILD_TIMEOUT_S)
    _run(["cmake", "--build", str(build), "--parallel", str(os.cpu_count() or 1), "--target", *TOOLS],
         "building llama.cpp", BUILD_TIMEOUT_S)
    missing = [name for name in TOOLS if not built.tool(name).is_file()]
    if missing:
        raise LlamaCppUnavailable(f"the llama.cpp build made no {', '.join(missing)} in {built.bin_dir}")
    return built


def _download_sdist(root: Path, log: Callable[[str], None]) -> Path:
    target = root / "sdist"
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if (target / name).is_file():
        return target / name
    log(f"fetching the llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist (its vendored llama.cpp)")
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
          f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(target)], "fetching llama-cpp-python", 600)
    if not (target / name).is_file():
        raise LlamaCppUnavailable(f"pip fetched no {name} into {target}")
    return target / name


def _source_tree(source: Path, root: Path, log: Callable[[str], None]) -> Path:
    """The llama.cpp tree inside `source`: a tarball is extracted once under the cache."""
    if source.is_file():
        extracted = root / "src" / source.name.removesuffix(".tar.gz")
        if not extracted.is_dir():
            log(f"extracting {source.name}")
            try:
                with tarfile.open(source) as archive:
                    archive.extractall(extracted.parent, filter="data")
            except (tarfile.TarError, OSError) as exc:
                raise LlamaCppUnavailable(f"cannot extract {source}: {exc}") from exc
        source = extracted
    for tree in (source / "vendor" / "llama.cpp", source):
        if (tree / "CMakeLists.txt").is_file() and (tree / "convert_hf_to_gguf.py").is_file():
            return tree
    raise LlamaCppUnavailable(f"{source} holds no llama.cpp source tree (CMakeLists.txt and convert_hf_to_gguf.py, "
                              "directly or under vendor/llama.cpp)")


def convert(llama: LlamaCpp, model_dir: str, log: Callable[[str], None]) -> dict[str, Path]:
    """The model as GGUF per format in FORMATS, made once per model contents: f32 by llama.cpp's converter, the
    others from it by llama-quantize."""
    out_dir = cache_root() / "gguf" / f"{Path(model_dir).name}-{_model_digest(model_dir)}"
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {fmt: out_dir / f"model-{fmt}.gguf" for fmt in FORMATS}
    if not files["f32"].is_file():
        log(f"converting {model_dir} to GGUF (llama.cpp's convert_hf_to_gguf.py)")
        partial = files["f32"].with_suffix(".partial")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(llama.source_dir / "gguf-py"),
                                                             os.environ.get("PYTHONPATH", "")])}
        _run([sys.executable, "-m", "meshserve.bench.gguf_convert", str(llama.source_dir), model_dir,
              "--outfile", str(partial), "--outtype", "f32"], "converting the model to GGUF", CONVERT_TIMEOUT_S,
             env=env)
        partial.rename(files["f32"])
    for fmt, quant_type in FORMATS.items():
        if quant_type is not None and not files[fmt].is_file():
            log(f"quantizing the GGUF to {quant_type} (llama-quantize)")
            partial = files[fmt].with_suffix(".partial")
            _run([str(llama.tool("llama-quantize")), str(files["f32"]), str(partial), quant_type],
                 f"quantizing to {quant_type}", CONVERT_TIMEOUT_S)
            partial.rename(files[fmt])
    return files


def _model_digest(model_dir: str) -> str:
    """Names, sizes and modification times of the model's files: a changed checkpoint is converted again."""
    entries = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(model_dir).iterdir()
                     if p.is_file())
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()[:12]


def _run(cmd: list[str], what: str, timeout_s: float, env: dict | None = None) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LlamaCppUnavailable(f"{what} failed: {exc}") from exc
    if done.returncode != 0:
        tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["no output"]
        raise LlamaCppUnavailable(f"{what} failed (exit {done.returncode}): {tail[0][:300]}")
    return done.stdout
