"""Hydra callbacks of every entry point (``configs/hydra/default.yaml``)."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from src.utils.config_error import ConfigError


def check_writable_dir(path: str, key: str) -> None:
    """Create ``path`` (with its parents) and write a temporary file in it.

    Raises:
        ConfigError: naming ``key``, the directory and the system's reason.
    """
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise ConfigError(f"{key}={path!r}: the run cannot write there ({type(err).__name__}: "
                          f"{err.strerror or err}); point {key} at a writable directory") from err


class CheckLogDir(Callback):
    """Refuse a ``paths.log_dir`` that cannot be written before Hydra makes the run directory inside it (Hydra's own
    failure is three chained tracebacks)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config)

    @staticmethod
    def _check(config: DictConfig) -> None:
        log_dir = OmegaConf.select(config, "paths.log_dir")
        if log_dir is None:
            return
        try:
            check_writable_dir(str(log_dir), "paths.log_dir")
        except ConfigError as err:
            # Hydra turns a callback's exception into a warning and goes on; SystemExit passes through
            sys.stderr.write(f"{err}\n")
            raise SystemExit(1) from err
