"""Start-up checks of the MLflow tracker (docs/robustness.md): its server answers, and a run to continue
(``+logger.mlflow.run_id``) exists, belongs to this algorithm and environment, is not live, and has logged no
iteration past the checkpoint's next one. Each is refused in one line before anything is built."""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from omegaconf import DictConfig

# the run's parameters (``log_config``) a continued run must share with this config
SAME_IN_RUN = (("algorithm/name", "algorithm.name"), ("env/_target_", "env._target_"), ("env/task", "env.task"))


def check_tracker(cfg: DictConfig) -> None:
    """Refuse an unreachable ``logger.mlflow.tracking_uri`` (http/https) and a ``logger.mlflow.run_id`` that cannot
    be continued by this run (``check_run_to_continue``).

    Raises:
        ValueError: naming the setting, its value and what to do.
    """
    mlflow_cfg = (cfg.get("logger") or {}).get("mlflow")
    if not mlflow_cfg:
        return
    uri = str(mlflow_cfg.get("tracking_uri") or "")
    parsed = urlparse(uri)
    if parsed.scheme in ("http", "https"):
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        try:
            socket.create_connection((parsed.hostname, port), timeout=5).close()
        except OSError as err:
            reason = err.strerror or err
            raise ValueError(f"logger.mlflow.tracking_uri={uri!r}: no MLflow server answers there ({reason}); start "
                             "it (mlflow server ...) or leave the default local sqlite store") from None
    if mlflow_cfg.get("run_id"):
        check_run_to_continue(cfg, uri or None, str(mlflow_cfg.run_id))


def check_run_to_continue(cfg: DictConfig, uri: str | None, run_id: str) -> None:
    """The run ``run_id`` continued by this resume: it exists in ``uri``, logged the same algorithm and environment
    (``SAME_IN_RUN``), no live process on this host logs into it (tags ``host``/``pid``), and its last logged step
    (an iteration) is at most one past the checkpoint's last iteration (the one a stopped run had begun).

    Raises:
        ValueError: the first of these that fails.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient
    from omegaconf import OmegaConf

    from src.utils.io import pid_alive, tagged_process

    name = f"+logger.mlflow.run_id={run_id}"
    missing = ValueError(f"{name}: no such run in {uri}; copy the id from the run's 'Resume with:' line, or leave "
                         "+logger.mlflow.run_id unset to log the resume as a new run")
    store = uri[len("sqlite:///"):] if uri and uri.startswith("sqlite:///") else None
    if store is not None and not Path(store).is_file():
        raise missing  # not MlflowClient: it would create the store
    client = MlflowClient(uri)
    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise missing from None
    for param, key in SAME_IN_RUN:
        logged, now = run.data.params.get(param), OmegaConf.select(cfg, key)
        if logged is not None and now is not None and logged != str(now):
            raise ValueError(f"{name} logged {key}={logged!r}, this run has {key}={now!r}: its curves would mix two "
                             "runs. Continue the run of this checkpoint, or leave +logger.mlflow.run_id unset")
    pid = tagged_process(run.data.tags)
    if run.info.status == "RUNNING" and pid is not None and pid != os.getpid() and pid_alive(pid):
        raise ValueError(f"{name} is live: process {pid} on this host is logging into it now. Stop it first, or "
                         "leave +logger.mlflow.run_id unset to log this run as a new one")
    iteration = _checkpoint_iteration(cfg)
    last = _last_step(client, run)
    if iteration is not None and last is not None and last > iteration + 1:
        raise ValueError(f"{name} has logged iterations up to {last}, but ckpt_path={cfg.get('ckpt_path')!r} ends at "
                         f"iteration {iteration}: iterations {iteration + 1}-{last} would be logged twice. Resume "
                         "from the run's last checkpoint, or leave +logger.mlflow.run_id unset to log a new run")


def _checkpoint_iteration(cfg: DictConfig) -> int | None:
    """The last iteration the resumed checkpoint trained (None without one or in an older checkpoint)."""
    import hydra.utils

    from src.utils.checkpoint_loading import checkpoint_head

    if not cfg.get("ckpt_path"):
        return None
    iteration = checkpoint_head(Path(hydra.utils.to_absolute_path(str(cfg.ckpt_path)))).get("iteration")
    return None if iteration is None else int(iteration)


def _last_step(client: Any, run: Any) -> int | None:
    """The largest step of the run's metrics (an iteration: ``EMPO2Module`` logs at ``step=iteration``)."""
    steps = [m.step for key in run.data.metrics for m in client.get_metric_history(run.info.run_id, key)]
    return max(steps) if steps else None
