"""The cached trained models: `<cache>/models/<arch>-<preset>-trained`, trained once with the preset's
defaults (seed 0) on first use and reused by later calls and processes; a model trained with other
settings (the defaults changed since) is trained again."""
from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

from meshserve.models.factory import _STAGING_PREFIX, _file_lock, default_cache_dir, preset_config
from meshserve.train.trainer import REPORT_FILE, settings_for, train

logger = logging.getLogger(__name__)


def trained_model_dir(arch: str = "deepseek_v3", preset: str = "small") -> Path:
    return default_cache_dir() / "models" / f"{arch}-{preset}-trained"


def _is_current(target: Path, arch: str, preset: str) -> bool:
    """Complete, and trained with the preset's current default settings."""
    if not (target / "config.json").is_file() or not (target / REPORT_FILE).is_file():
        return False
    try:
        trained_with = json.loads((target / REPORT_FILE).read_text()).get("settings")
    except (OSError, ValueError):
        return False
    defaults = json.loads(json.dumps(dataclasses.asdict(settings_for(arch, preset))))
    return trained_with == defaults


def ensure_trained_model(arch: str = "deepseek_v3", preset: str = "small", progress: bool = True) -> Path:
    """The trained `arch`/`preset` model's directory, training it first if the cache has none
    (deepseek_v3 small: about an hour on 2 CPU cores; another process asking meanwhile waits)."""
    preset_config(arch, preset)  # fail fast on bad names
    target = trained_model_dir(arch, preset)
    if _is_current(target, arch, preset):
        logger.info("reusing trained model %s", target)
        return target
    models_dir = target.parent
    models_dir.mkdir(parents=True, exist_ok=True)
    # The lock makes a second process wait for the first one's training instead of repeating it.
    with _file_lock(models_dir / f".{target.name}.lock"):
        if _is_current(target, arch, preset):
            logger.info("reusing trained model %s (trained by another process)", target)
            return target
        if target.exists():
            logger.info("%s was trained with other settings than the current defaults: training it again", target)
            shutil.rmtree(target)
        # Under the lock, staging directories for this name can only be left by crashed trainers.
        for stale in models_dir.glob(f"{_STAGING_PREFIX.format(name=target.name)}*"):
            shutil.rmtree(stale, ignore_errors=True)
        logger.info("training %s/%s into %s (first use)", arch, preset, target)
        return train(settings_for(arch, preset), target, progress=progress)
