"""OmegaConf resolvers the configs use, registered when the ``src`` package is imported.

``${pid:}``: this process's id. Run directories are ``<time>_<pid>`` (configs/hydra/default.yaml), so runs started
in the same second (``scripts/run_study.py`` side by side) never share a directory, log file or checkpoints.
Lightning's DDP launcher passes the resolved directory to its child processes, so one run keeps one directory.
"""
from __future__ import annotations

import os

from omegaconf import OmegaConf


def register_resolvers() -> None:
    """Register the resolvers (idempotent)."""
    if not OmegaConf.has_resolver("pid"):
        OmegaConf.register_new_resolver("pid", os.getpid, use_cache=True)
