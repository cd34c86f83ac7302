"""Hydra callbacks of every entry point (``configs/hydra/default.yaml``)."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf


class CheckLogDir(Callback):
    """Refuse a ``paths.log_dir`` that cannot be written before Hydra makes the run directory inside it (Hydra's own
    failure is three chained tracebacks), and a run directory another run already uses."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config)
        self._check_run_dir(config)

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

    @staticmethod
    def _check_run_dir(config: DictConfig) -> None:
        """Refuse a ``hydra.run.dir`` that already holds a run (its ``.hydra/``, log or checkpoints): two runs in one
        directory mix their checkpoints (``last-v1.ckpt``), tips and log. A timestamped default never exists."""
        if os.environ.get("LOCAL_RANK", "0") != "0" or os.environ.get("NODE_RANK", "0") != "0":
            return  # a DDP rank Lightning started: it joins its rank 0's run directory (hydra.run.dir set for it)
        try:
            run_dir = Path(str(OmegaConf.select(config, "hydra.run.dir")))
        except Exception:  # noqa: BLE001 - an interpolation only Hydra's runtime resolves: nothing to check here
            return
        held = sorted(p.name for p in (run_dir.iterdir() if run_dir.is_dir() else [])
                      if p.name in (".hydra", "checkpoints", "tips") or p.suffix == ".log")
        if held:
            sys.stderr.write(f"hydra.run.dir={str(run_dir)!r} already holds a run ({', '.join(held)}): two runs in one "
                             "directory mix their checkpoints, tips and logs. Choose a new directory (or leave "
                             "hydra.run.dir unset); to continue that run, resume from its checkpoint: "
                             f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}\n")
            raise SystemExit(1)
