"""Hydra callbacks of every entry point (``configs/hydra/default.yaml``)."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf


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
        path = str(log_dir)
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as err:
            # Hydra turns a callback's exception into a warning and goes on; SystemExit passes through
            sys.stderr.write(f"paths.log_dir={path!r}: the run cannot write there ({type(err).__name__}: "
                             f"{err.strerror or err}); point paths.log_dir at a writable directory\n")
            raise SystemExit(1) from err
