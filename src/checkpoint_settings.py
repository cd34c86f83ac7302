"""The settings a checkpoint was trained with, for ``src/eval.py`` and ``src/export.py``: the training run's
``RUN_GROUPS`` settings come from the checkpoint (docs/evaluation.md), so a run is evaluated without repeating its
experiment and overrides.

The command line's overrides and groups still apply. Settings that name this machine's directories (``paths.*``
or environment-variable interpolations) and ``THIS_MACHINE``'s keep this config's value; an interpolation
(``data.max_steps: ${env.max_steps}``) keeps following where that gives the checkpoint's value or the command line
set its source.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from src.utils.console import CONSOLE

log = logging.getLogger(__name__)

RUN_GROUPS = ("model", "data", "env", "memory", "algorithm")
THIS_MACHINE = ("model.policy.rollout_precision",)  # a run stores its machine's choice; this machine makes its own
_MACHINE = re.compile(r"\$\{(paths\.|oc\.env:|hydra:)")
_REFERENCE = re.compile(r"\$\{([\w.]+)\}")  # the key a plain interpolation reads


def saved_run_config(path: Path) -> dict[str, Any] | None:
    """The resolved training config saved in a checkpoint (``RUN_CONFIG_KEY``; None in an older one). ``path``: a
    ``.ckpt`` file (memory-mapped) or a ``trainer=fsdp`` checkpoint directory (its ``meta.pt``)."""
    from src.models.checkpoint_state import RUN_CONFIG_KEY
    from src.utils.checkpoint_loading import checkpoint_head

    return checkpoint_head(path).get(RUN_CONFIG_KEY) or None


def flat(node: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict as ``{"a.b.c": leaf}`` (an empty dict and a list are leaves)."""
    if isinstance(node, dict) and node:
        return {k: v for key, value in node.items() for k, v in flat(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: node}


def command_line_keys() -> tuple[set[str], set[str]]:
    """The keys (``env.max_steps``) and the groups (``env``) this process's command line set, from Hydra's record of
    its overrides (empty outside a Hydra run)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return set(), set()
    keys = {o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task}
    return {k for k in keys if "." in k}, {k for k in keys if k in RUN_GROUPS}


def apply_run_config(cfg: DictConfig, saved: dict[str, Any], keys: set[str], groups: set[str]) -> list[str]:
    """Set the ``RUN_GROUPS`` settings of ``cfg`` to the checkpoint's (``saved``, a resolved training config), except
    ``keys`` and ``groups`` (what the command line set) and this machine's directories (see the module doc). Keys
    ``cfg`` does not have (a setting since removed) are left out. Returns the keys whose value changed."""
    raw = flat(OmegaConf.to_container(cfg, resolve=False))
    saved_flat = flat({g: saved[g] for g in RUN_GROUPS if g in saved and g not in groups})
    taken = {k: v for k, v in saved_flat.items() if k in raw and k not in keys and k not in THIS_MACHINE
             and not any(k.startswith(c + ".") for c in keys)}
    follows = {k for k in taken if isinstance(raw[k], str) and "${" in raw[k]}
    changed = []
    # plain values first, so that an interpolation is judged by what it gives once they are set
    for key in [k for k in taken if k not in follows] + [k for k in taken if k in follows]:
        value = taken[key]
        if key in follows and (_MACHINE.search(raw[key]) or OmegaConf.select(cfg, key) == value
                               or set(_REFERENCE.findall(raw[key])) & keys):
            continue  # this machine's directory; it follows a setting to the run's value, or one the command set
        if key not in follows and raw[key] == value:
            continue
        with open_dict(cfg):
            OmegaConf.update(cfg, key, value, merge=False)
        changed.append(key)
    return changed


def use_checkpoint_settings(cfg: DictConfig) -> None:
    """``apply_run_config`` for ``cfg.ckpt_path`` with this process's command line, logged; nothing without a
    checkpoint or with one that saved no run config."""
    import hydra

    if not cfg.get("ckpt_path"):
        return
    path = Path(hydra.utils.to_absolute_path(str(cfg.ckpt_path)))
    try:
        saved = saved_run_config(path) if path.exists() else None
    except Exception as err:  # noqa: BLE001 - not a checkpoint: reading its weights says so, naming the file
        log.debug("ckpt_path=%s: no run config read (%s)", cfg.ckpt_path, err)
        return
    if saved is None:
        log.info("ckpt_path=%s holds no run config: the settings are this command's", cfg.ckpt_path)
        return
    changed = apply_run_config(cfg, saved, *command_line_keys())
    shown = ", ".join(f"{k}={OmegaConf.select(cfg, k)!r}" for k in changed[:12]) + (" ..." if len(changed) > 12 else "")
    log.info("Settings of the checkpoint's training run (%s): %d differ from this command's config%s", "/".join(
        RUN_GROUPS), len(changed), f": {shown}" if changed else "", extra=CONSOLE)
