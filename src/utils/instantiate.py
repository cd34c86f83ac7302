"""Build callbacks and loggers from their Hydra config groups (lightning-hydra-template convention)."""
from __future__ import annotations

import hydra
from lightning import Callback
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig


def instantiate_group(cfg: DictConfig | None, kind: type, build=hydra.utils.instantiate) -> list:
    """Instantiate (with ``build``) every non-empty entry of a config group (a dict of named configs).

    Raises:
        TypeError: an entry is not a config dict or builds something that is not a ``kind``.
    """
    out = []
    for name, conf in (cfg or {}).items():
        if conf is None:
            continue
        if not isinstance(conf, DictConfig) or "_target_" not in conf:
            raise TypeError(f"{kind.__name__} config {name!r} must be a dict with a _target_, got {conf!r}")
        obj = build(conf)
        if not isinstance(obj, kind):
            raise TypeError(f"{name!r} built a {type(obj).__name__}, expected a {kind.__name__}")
        out.append(obj)
    return out


def instantiate_callbacks(cfg: DictConfig | None) -> list[Callback]:
    return instantiate_group(cfg, Callback)


def instantiate_loggers(cfg: DictConfig | None) -> list[Logger]:
    """The loggers of the ``logger`` group (``build_logger``)."""
    from src.utils.logging import build_logger

    return instantiate_group(cfg, Logger, build=build_logger)
