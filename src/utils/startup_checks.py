"""Checks and fixes applied to a training config before anything is built (``src/train.py``).

- Lightning options that cannot work with one epoch = one training iteration are refused with the reason, and
  ``fast_dev_run`` becomes one real iteration (``check_trainer_options``);
- temporary files of checkpoint saves that a killed run left behind are removed (``clean_checkpoint_dirs``).

Checks that need to know an environment live with it (e.g. ScienceWorld's action caps against its gold paths,
``src/envs/scienceworld_gold_lengths.py``) and are called by the entry point.
"""
from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig, open_dict

log = logging.getLogger(__name__)

_EPOCH_IS_ITERATION = ("one Lightning epoch is one training iteration (its rollout runs when the epoch starts, and "
                       "how many micro-batches it yields depends on the episodes)")


def _is_all(value) -> bool:
    """Lightning's "no limit" for limit_train_batches / val_check_interval: None or the float 1.0 (the int 1
    means one batch)."""
    return value is None or (isinstance(value, float) and value == 1.0)


def check_trainer_options(cfg: DictConfig) -> None:
    """Refuse batch-level Lightning options with the reason, and turn ``fast_dev_run`` into real iterations.

    ``trainer.fast_dev_run=N`` (True = 1) runs N whole iterations with validation, without loggers or checkpoints
    (Lightning's own would stop after N micro-batches, before any optimizer step). ``cfg`` is changed in place.

    Raises:
        ValueError: naming each refused option, why, and what to use instead.
    """
    trainer, data = cfg.trainer, cfg.get("data") or {}
    steps_per_iteration = int(data.get("ppo_epochs", 1)) * int(data.get("num_mini_batches", 1))
    problems = []
    for key in ("limit_train_batches", "overfit_batches"):
        value = trainer.get(key)
        if not (_is_all(value) if key == "limit_train_batches" else not value):
            problems.append(f"trainer.{key}={value!r}: {_EPOCH_IS_ITERATION}, so a batch limit ends the iteration "
                            "before its optimizer steps (a run of 0 updates). Make iterations smaller with "
                            "data.tasks_per_iteration, data.group_size or env.max_steps instead.")
    if not _is_all(trainer.get("val_check_interval")):
        problems.append(f"trainer.val_check_interval={trainer.val_check_interval!r}: validation runs between "
                        "iterations; use trainer.check_val_every_n_epoch=N (every N iterations).")
    max_steps = trainer.get("max_steps")
    if max_steps not in (None, -1):
        hint = f" (= trainer.max_epochs={max_steps // steps_per_iteration})" if max_steps % steps_per_iteration == 0 \
            else ""
        problems.append(f"trainer.max_steps={max_steps}: {_EPOCH_IS_ITERATION}; an iteration takes data.ppo_epochs x "
                        f"data.num_mini_batches = {steps_per_iteration} optimizer steps. Set the number of iterations "
                        f"with trainer.max_epochs{hint}.")
    if problems:
        raise ValueError("Trainer options that do not fit this training loop:\n- " + "\n- ".join(problems))
    fast = trainer.get("fast_dev_run")
    if fast:
        iterations = 1 if fast is True else int(fast)
        with open_dict(cfg):
            trainer.fast_dev_run = False
            trainer.max_epochs, trainer.check_val_every_n_epoch, trainer.num_sanity_val_steps = iterations, 1, 0
            trainer.enable_checkpointing = False
            cfg.logger = None
            for name, callback in list((cfg.get("callbacks") or {}).items()):
                if callback and str(callback.get("_target_", "")).endswith("ModelCheckpoint"):
                    cfg.callbacks[name] = None
        log.info("fast_dev_run=%s: %d full training iteration(s) with validation, no loggers, no checkpoints",
                 fast, iterations)


def clean_checkpoint_dirs(cfg: DictConfig) -> list[Path]:
    """Remove stale checkpoint temp files in the resumed checkpoint's directory and every ModelCheckpoint dirpath."""
    from src.utils.io import remove_stale_temp_files

    dirs = [Path(cfg.ckpt_path).parent] if cfg.get("ckpt_path") else []
    dirs += [Path(c.dirpath) for c in (cfg.get("callbacks") or {}).values() if c and c.get("dirpath")]
    return [path for d in dict.fromkeys(dirs) for path in remove_stale_temp_files(d)]


def prepare_run(cfg: DictConfig) -> None:
    """All start-up checks, in order (``cfg`` may be changed: see ``check_trainer_options``)."""
    check_trainer_options(cfg)
    clean_checkpoint_dirs(cfg)
