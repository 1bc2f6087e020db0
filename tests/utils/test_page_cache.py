"""Page-cache residency, eviction and preloading of checkpoint files (`meshserve.utils.page_cache`), and the
load source a rank reports from it."""
from __future__ import annotations

import pytest

from meshserve.utils import page_cache


@pytest.fixture()
def data_file(tmp_path):
    """A file just written, its pages still dirty (as a checkpoint is right after `make-model`)."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x01" * (4 << 20))
    return path


def test_evict_then_preload(data_file):
    assert page_cache.resident_fraction([data_file]) == 1.0
    page_cache.evict([data_file])  # flushes the dirty pages first, or they would stay
    assert page_cache.resident_fraction([data_file]) < 0.5
    nbytes, seconds = page_cache.preload([data_file])
    assert nbytes == 4 << 20 and seconds >= 0
    assert page_cache.resident_fraction([data_file]) == 1.0
    page_cache.evict([data_file])
    assert page_cache.resident_fraction([data_file]) < 0.5
    assert page_cache.resident_fraction([]) == 1.0


def test_checkpoint_files(tiny_model):
    model_dir = tiny_model()
    files = page_cache.checkpoint_files(model_dir)
    assert files and all(f.suffix == ".safetensors" for f in files)


def test_rank_reports_disk_or_page_cache(tiny_model):
    from meshserve.config import EngineConfig
    from meshserve.worker.model_runner import ModelRunner

    model_dir = tiny_model("deepseek_v3", overrides={"num_hidden_layers": 2})
    files = page_cache.checkpoint_files(model_dir)
    config = EngineConfig.from_kwargs(str(model_dir), num_kv_blocks=16, block_size=8)
    page_cache.evict(files)
    if page_cache.resident_fraction(files) > 0.5:
        pytest.skip("this filesystem keeps evicted pages (tmpfs?)")
    cold = ModelRunner(config).load_info
    page_cache.preload(files)
    warm = ModelRunner(config).load_info
    assert (cold.source, warm.source) == ("disk", "page-cache")
    assert cold.nbytes == warm.nbytes > 0 and cold.end >= cold.start > 0
