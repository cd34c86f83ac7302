"""What every entry point (``src/train.py``, ``src/eval.py``, ``src/sft.py``) does first.

torch and Lightning are not imported at module level: spawned environment workers re-import the entry point, and
should not each load torch (``start_run`` runs in the main process only).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import warnings
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

import src  # noqa: F401 - registers the config resolvers
from src.utils.threads import adapt_threads, configure_threads

log = logging.getLogger(__name__)
# before anything loads torch's OpenMP runtime (it reads its variables once); child processes inherit it
THREADS = configure_threads()


def start_run(cfg: DictConfig) -> None:
    """Process-wide settings of a run, then the resolved config in the log.

    - tokenizers run single-threaded unless the user says otherwise (they would fight the env workers for cores);
    - faiss's CPU-feature probing (ModuleNotFoundError lines at INFO, which read like failures) and lines about the
      libraries, not the command, are silenced; Lightning's log lines go through Hydra's handlers only;
    - SIGTERM (a job scheduler, ``kill``) unwinds like Ctrl-C, so environment workers, JVMs and file locks are
      released; both signals are recorded (``received_signal``), so the run ends KILLED in the tracker, not FAILED.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' loading/saving bars on every start
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)
    # MLflow's database set-up and a new experiment, and a deprecation inside Lightning's own code
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    logging.getLogger("lightning.pytorch.loggers.mlflow").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    import lightning  # noqa: F401 - its import gives its loggers console handlers of their own, removed below
    import torch

    log.info("Threads: %d torch threads; %s", torch.get_num_threads(), THREADS)
    adapt_threads()  # the first reading of the load: the first generation already knows what the others use

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if type(h) is logging.StreamHandler]:
            logger.removeHandler(handler)
        logger.propagate = True
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    _save_resolved_config(cfg)


def _save_resolved_config(cfg: DictConfig) -> None:
    """The resolved config to ``.hydra/resolved.yaml`` in the run directory (Hydra's own ``config.yaml`` there keeps
    the interpolations), one line in the log saying where; outside a Hydra run, to the log at DEBUG."""
    from hydra.core.hydra_config import HydraConfig

    text = OmegaConf.to_yaml(cfg, resolve=True)
    if not HydraConfig.initialized():
        log.debug("Config:\n%s", text)
        return
    path = Path(HydraConfig.get().runtime.output_dir) / (HydraConfig.get().output_subdir or ".hydra") / "resolved.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    log.info("Config: %s (resolved; %s)", path, " ".join(HydraConfig.get().overrides.task) or "no overrides")


_received: list[int] = []


def _on_signal(signum: int, frame) -> None:
    _received.append(signum)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    sys.exit(128 + signum)


def received_signal() -> int | None:
    """The first SIGINT or SIGTERM this process received since ``start_run``, or None."""
    return _received[0] if _received else None
