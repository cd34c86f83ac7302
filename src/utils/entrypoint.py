"""What every entry point (``src/train.py``, ``src/eval.py``, ``src/sft.py``) does first, in one place.

Importing this module imports the ``src`` package, which registers the config resolvers (``${pid:}`` in the run
directory). Heavy libraries (torch, Lightning) are not imported here: environment workers are spawned processes
that re-import the entry point, and they should not each load torch.
"""
from __future__ import annotations

import logging
import os
import signal
import sys

from omegaconf import DictConfig, OmegaConf

import src  # noqa: F401 - registers the config resolvers

log = logging.getLogger(__name__)


def start_run(cfg: DictConfig) -> None:
    """Process-wide settings of a run, then the resolved config in the log.

    - tokenizers run single-threaded unless the user says otherwise (they would fight the env workers for cores);
    - faiss's CPU-feature probing (ModuleNotFoundError lines at INFO, which read like failures) is silenced;
    - SIGTERM (a job scheduler, ``kill``) unwinds like Ctrl-C, so environment workers, JVMs and file locks are
      released and no half-built cache entry is kept.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    log.info("Config:\n%s", OmegaConf.to_yaml(cfg, resolve=True))
