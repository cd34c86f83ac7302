"""Checks and fixes applied to a training config before anything is built (``prepare_run`` in
``src/config_checks.py`` runs them). torch is imported only by the checks that need it.
"""
from __future__ import annotations

import difflib
import logging
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict

log = logging.getLogger(__name__)

_EPOCH_IS_ITERATION = ("one Lightning epoch is one training iteration (its rollout runs when the epoch starts, and "
                       "how many micro-batches it yields depends on the episodes)")


def _is_all(value) -> bool:
    """Lightning's "no limit" for limit_train_batches / val_check_interval: None or the float 1.0 (the int 1
    means one batch)."""
    return value is None or (isinstance(value, float) and value == 1.0)


def check_trainer_options(cfg: DictConfig) -> None:
    """Refuse batch-level Lightning options, and turn ``trainer.fast_dev_run=N`` (True = 1) into N whole iterations
    with validation, without loggers or checkpoints (Lightning's would stop before any optimizer step), in place.

    Raises:
        ValueError: naming each refused option, why, and what to use instead.
    """
    trainer, data = cfg.trainer, cfg.get("data") or {}
    rows_rule = data.get("mini_batch_rows") is not None  # the steps per iteration follow the rollout
    steps_per_iteration = int(data.ppo_epochs) * int(data.get("num_mini_batches") or 1)
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
        if rows_rule:
            problems.append(f"trainer.max_steps={max_steps}: {_EPOCH_IS_ITERATION}; with data.mini_batch_rows an "
                            "iteration takes one optimizer step per data.mini_batch_rows rows, a number that follows "
                            "the rollout. Set the number of iterations with trainer.max_epochs.")
        else:
            hint = f" (= trainer.max_epochs={max_steps // steps_per_iteration})" \
                if max_steps % steps_per_iteration == 0 else ""
            problems.append(f"trainer.max_steps={max_steps}: {_EPOCH_IS_ITERATION}; an iteration takes "
                            f"data.ppo_epochs x data.num_mini_batches = {steps_per_iteration} optimizer steps. Set "
                            f"the number of iterations with trainer.max_epochs{hint}.")
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
                if callback and str(callback.get("_target_", "")).endswith("Checkpoint"):
                    cfg.callbacks[name] = None
        log.info("fast_dev_run=%s: %d full training iteration(s) with validation, no loggers, no checkpoints",
                 fast, iterations)


ACCELERATORS = ("auto", "cpu", "gpu", "cuda")  # what this project runs on (the precision and memory checks know them)


def hardware_problems(trainer: dict) -> list[str]:
    """``trainer.accelerator``, ``trainer.strategy`` and ``trainer.devices`` values Lightning would refuse only once
    the model is built, or that this project does not run on."""
    from lightning.pytorch.strategies import StrategyRegistry

    problems = []
    accelerator, strategy, devices = trainer.get("accelerator"), trainer.get("strategy"), trainer.get("devices")
    if accelerator is not None and accelerator not in ACCELERATORS:
        problems.append(f"trainer.accelerator={accelerator!r}: expected one of {list(ACCELERATORS)}")
    strategies = ["auto", *StrategyRegistry.available_strategies()]
    if isinstance(strategy, str) and strategy not in strategies:
        close = difflib.get_close_matches(strategy, strategies, n=1)
        problems.append(f"trainer.strategy={strategy!r}: not a Lightning strategy"
                        + (f"; did you mean {close[0]!r}?" if close else "") + " (or a strategy config with _target_)")
    ok = (devices in (None, "auto", -1) or (isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1)
          or (isinstance(devices, list) and all(isinstance(d, int) and d >= 0 for d in devices) and devices)
          or (isinstance(devices, str) and re.fullmatch(r"\s*-?\d+\s*(,\s*\d+\s*)*,?", devices) is not None
              and devices.strip() not in ("0", "-0")))
    if not ok:
        problems.append(f"trainer.devices={devices!r}: expected an int >= 1 (-1: all), 'auto' or a list of device "
                        "indices")
    return problems


def generation_problems(trainer: dict[str, Any], model: dict[str, Any]) -> list[str]:
    """``model.policy.cuda_graphs`` true only where a decoding step can be captured (a CUDA accelerator, not FSDP; its
    type is ``PolicyConfig``'s rule); ``model.policy.rollout_precision``: ``rollout_precision_under_fsdp``."""
    policy = model.get("policy") or {}
    fsdp = sharded(trainer)
    problems = []
    try:
        if fsdp:
            rollout_precision_under_fsdp(str(policy["rollout_precision"]), fsdp, chosen=False)
    except ValueError as err:
        problems.append(str(err))
    if policy["cuda_graphs"] is not True:
        return problems
    accelerator = str(trainer.get("accelerator", "auto")).lower()
    if not on_cuda(accelerator):
        problems.append(f"model.policy.cuda_graphs=true with trainer.accelerator={accelerator}: CUDA graphs need a "
                        "CUDA device; expected false here (or trainer.accelerator=gpu on a GPU machine)")
    if fsdp:
        problems.append(f"model.policy.cuda_graphs=true with trainer.strategy={fsdp}: FSDP gathers "
                        "sharded weights inside each forward, which a captured step cannot; expected false")
    return problems


# the rollout precisions whose decoding steps run a bf16 copy of the weights (src/models/rollout_engine.py)
BF16_DECODE = ("bf16", "bf16-decode")


def rollout_precision_under_fsdp(value: str, strategy: str, chosen: bool) -> str:
    """The one rule for bf16 decoding steps under FSDP (they run a copy of the weights, and sharded weights cannot be
    copied): the rollout precision ``value`` that runs there. ``auto``'s choice (``chosen``) falls back to
    bf16-prefill or fp32; an explicit value is refused. Read by the start-up check and the engine.

    Raises:
        ValueError: an explicit ``value`` with bf16 decoding steps, naming ``strategy``.
    """
    if value not in BF16_DECODE:
        return value
    if chosen:
        return {"bf16": "bf16-prefill", "bf16-decode": "fp32"}[value]
    raise ValueError(f"model.policy.rollout_precision={value} with trainer.strategy={strategy}: bf16 decoding steps "
                     "run a bf16 copy of the weights, which FSDP's sharded weights cannot give; expected fp32, "
                     "bf16-prefill, trainer or auto")


def strategy_name(strategy: Any) -> str:
    """``trainer.strategy`` as a name: the string itself, or a ``_target_`` mapping's class name (trainer=fsdp's
    ``ModelParallelStrategy``)."""
    return str(strategy.get("_target_", "") if hasattr(strategy, "get") else strategy).rsplit(".", 1)[-1]


def sharded(trainer: dict[str, Any]) -> str | None:
    """The name of ``trainer.strategy`` where it shards the weights (a name with ``fsdp``, or trainer=fsdp's
    ``ModelParallelStrategy``: FSDP2), else None."""
    name = strategy_name(trainer.get("strategy", ""))
    return name if "fsdp" in name.lower() or "modelparallel" in name.lower() else None


def on_cuda(accelerator: str) -> bool:
    """Whether ``trainer.accelerator`` (lower-case) runs on a CUDA GPU: ``gpu``, ``cuda``, or ``auto`` where torch
    sees one."""
    if accelerator in ("gpu", "cuda"):
        return True
    if accelerator != "auto":
        return False
    import torch

    return torch.cuda.is_available()


def check_accelerator(cfg: DictConfig) -> None:
    """Refuse ``trainer.accelerator=gpu`` (or ``cuda``) when torch sees no GPU (Lightning would fail only once the
    model is built).

    Raises:
        ValueError: naming the accelerator, what torch sees and the overrides to run on the CPU.
    """
    accelerator = str(cfg.trainer.get("accelerator", "auto")).lower()
    if accelerator not in ("gpu", "cuda"):
        return
    import torch

    if torch.cuda.is_available() or (accelerator == "gpu" and torch.backends.mps.is_available()):
        return
    build = "a CPU-only build of torch" if torch.version.cuda is None else f"torch built for CUDA {torch.version.cuda}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    raise ValueError(
        f"trainer.accelerator={accelerator} but this machine has no GPU that torch can use "
        f"(torch.cuda.is_available() is False; {build}; CUDA_VISIBLE_DEVICES={visible!r}). "
        "To run on the CPU add: trainer.accelerator=cpu trainer.devices=1 trainer.precision=32-true (with "
        "trainer=ddp or trainer=fsdp that is one CPU process; trainer.devices=N starts N). Otherwise run on a "
        f"machine with GPUs (this config asks for trainer.devices={cfg.trainer.get('devices')}).")


_CHECKPOINT_EXPECTED = ("Expected a checkpoint written by src/train.py: a .ckpt file (e.g. "
                        "logs/train/runs/<run>/checkpoints/last.ckpt) or, from trainer=fsdp, a checkpoint directory "
                        "holding .metadata and meta.pt")


def check_checkpoint_path(cfg: DictConfig) -> Path | None:
    """Refuse a ``ckpt_path`` that cannot be resumed from, before anything is built; return its absolute path
    (None without ``ckpt_path``). A relative path is taken from where the command runs, as ``src/train.py`` does.

    A file must be a complete zip archive, load as Lightning loads it (``weights_only=True``; memory-mapped) and hold
    a global step and ``policy.*`` weights; a directory, a distributed checkpoint's ``.metadata`` and ``meta.pt``.

    Raises:
        FileNotFoundError: nothing at the path.
        PermissionError: the file is not readable.
        ValueError: not a checkpoint of this project; the message names the file and what was expected.
    """
    if not cfg.get("ckpt_path"):
        return None
    import hydra.utils

    given = str(cfg.ckpt_path)
    path = Path(hydra.utils.to_absolute_path(given))
    name = f"ckpt_path={given!r}" + (f" ({path})" if str(path) != given else "")
    if not path.exists():
        raise FileNotFoundError(f"{name} does not exist. {_CHECKPOINT_EXPECTED}.")
    if path.is_dir():
        if (path / "export_info.json").is_file():
            raise ValueError(f"{name} is an exported agent, not a training checkpoint: evaluate it with ckpt_path=null "
                             f"model.policy.name_or_path={given} (and eval.memory_file={given}/memory).")
        if not (path / ".metadata").is_file():
            raise ValueError(f"{name} is a directory without a .metadata file, so not a distributed checkpoint. "
                             f"{_CHECKPOINT_EXPECTED}.")
        if not (path / "meta.pt").is_file():
            raise ValueError(f"{name} is a distributed checkpoint without Lightning's meta.pt (global step, loops, "
                             f"memory), so not a checkpoint of src/train.py. {_CHECKPOINT_EXPECTED}.")
        return path
    if not os.access(path, os.R_OK):
        raise PermissionError(f"{name} is not readable by this user. {_CHECKPOINT_EXPECTED}.")
    size = path.stat().st_size
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{name} is not a complete checkpoint: not a zip archive as torch.save writes ({size} "
                         "bytes; a copy or a save cut short leaves such a file). Resume from an earlier checkpoint of "
                         f"the run (iter_*.ckpt in the same directory). {_CHECKPOINT_EXPECTED}.")
    import torch

    try:
        ckpt = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(f"{name} holds pickled Python objects besides tensors and plain values, which are not loaded "
                         f"(they could run code): not a checkpoint of this project. {_CHECKPOINT_EXPECTED}.") from err
    except Exception as err:  # whatever torch says, the user needs the file's name
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ValueError(f"{name} could not be loaded as a checkpoint ({type(err).__name__}: {reason}). "
                         f"{_CHECKPOINT_EXPECTED}.") from err
    weights = ckpt.get("state_dict") if isinstance(ckpt, dict) else None
    if not isinstance(weights, dict) or "global_step" not in ckpt or not any(k.startswith("policy.") for k in weights):
        keys = sorted(ckpt)[:8] if isinstance(ckpt, dict) else type(ckpt).__name__
        raise ValueError(f"{name} is a torch file but not a checkpoint of this project (it needs a global_step and "
                         f"policy.* weights in its state_dict; it holds {keys}). {_CHECKPOINT_EXPECTED}.")
    from src.utils.checkpoint_loading import verify_checkpoint_file

    verify_checkpoint_file(path, weights, name)
    return path


def check_resume_trains(cfg: DictConfig, path: Path) -> None:
    """Refuse a resume whose ``trainer.max_epochs`` (iterations in all, counted from 0) the checkpoint has already
    trained: Lightning would play a rollout, train nothing and end the run as finished.

    Raises:
        ValueError: naming both numbers and the setting to raise.
    """
    from src.utils.checkpoint_loading import checkpoint_head

    max_epochs = cfg.get("trainer", {}).get("max_epochs")
    if max_epochs is None or int(max_epochs) < 0:
        return
    iteration = checkpoint_head(path).get("iteration")
    if iteration is not None and int(max_epochs) <= int(iteration) + 1:
        raise ValueError(f"trainer.max_epochs={max_epochs}, but ckpt_path={str(cfg.ckpt_path)!r} has trained "
                         f"{int(iteration) + 1} iterations already: the resume would train nothing. Set "
                         f"trainer.max_epochs above {int(iteration) + 1} (the iterations in all, not the ones to add)")


def clean_checkpoint_dirs(cfg: DictConfig) -> list[Path]:
    """Remove stale checkpoint temp files in the resumed checkpoint's directory and every ModelCheckpoint dirpath."""
    from src.utils.io import remove_stale_temp_files

    dirs = [Path(cfg.ckpt_path).parent] if cfg.get("ckpt_path") else []
    dirs += [Path(c.dirpath) for c in (cfg.get("callbacks") or {}).values() if c and c.get("dirpath")]
    return [path for d in dict.fromkeys(dirs) for path in remove_stale_temp_files(d)]
