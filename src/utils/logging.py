"""Experiment tracking helpers: the resolved config as parameters and as an artifact, checkpoints as artifacts."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger, MLFlowLogger
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a/b": 1}`` (lists kept as their string form)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "/"))
        else:
            out[key] = v
    return out


def log_config(cfg: DictConfig, loggers: list[Logger]) -> None:
    """Log every resolved config value as a parameter and the whole YAML as ``config.yaml``.

    Parameter values have length limits in MLflow, so the artifact is the faithful copy.
    """
    container = OmegaConf.to_container(cfg, resolve=True)
    params = flatten({k: v for k, v in container.items() if k != "hydra"})
    text = OmegaConf.to_yaml(cfg, resolve=True)
    for logger in loggers:
        logger.log_hyperparams(params)
        if isinstance(logger, MLFlowLogger):
            logger.experiment.log_text(logger.run_id, text, "config.yaml")


def log_checkpoint(path: str | None, loggers: list[Logger]) -> None:
    """Upload a checkpoint file to each MLflow run's ``checkpoints/`` artifacts."""
    if not path or not Path(path).exists():
        return
    for logger in loggers:
        if isinstance(logger, MLFlowLogger):
            logger.experiment.log_artifact(logger.run_id, path, artifact_path="checkpoints")
            log.info("Logged %s to MLflow run %s", path, logger.run_id)
