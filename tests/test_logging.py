"""Concurrent runs on one fresh MLflow sqlite store, and unique Hydra run directories (runs started together)."""
from __future__ import annotations

import multiprocessing as mp
import re
import subprocess
import sys
from pathlib import Path

import mlflow
from omegaconf import OmegaConf

from src.utils.instantiate import instantiate_loggers

ROOT = Path(__file__).resolve().parents[1]


def _log_one_run(log_dir: str, index: int, barrier, errors) -> None:
    """One "run": build the project's MLflow logger from its config group and log a parameter and metrics."""
    try:
        cfg = OmegaConf.create({"mlflow": {
            "_target_": "lightning.pytorch.loggers.mlflow.MLFlowLogger", "experiment_name": "empo2",
            "run_name": f"run-{index}", "tracking_uri": f"sqlite:///{log_dir}/mlflow.db",
            "artifact_location": f"{log_dir}/mlartifacts"}})
        barrier.wait(timeout=120)  # every process opens the store at the same moment
        logger, = instantiate_loggers(cfg)
        logger.log_hyperparams({"index": index})
        for step in range(3):
            logger.log_metrics({"rollout/score": float(index + step)}, step=step)
        logger.finalize("success")
    except BaseException as exc:  # reported to the parent: a crash of any run fails the test
        errors.put(f"run {index}: {type(exc).__name__}: {exc}")
        raise


def test_four_runs_start_together_on_a_fresh_store(tmp_path):
    ctx = mp.get_context("fork")  # the children inherit the imports: each run's own start-up is what races
    barrier, errors = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_log_one_run, args=(str(tmp_path), i, barrier, errors)) for i in range(4)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=300)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    failures = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert [p.exitcode for p in procs] == [0, 0, 0, 0], failures
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("empo2").experiment_id])
    assert sorted(r.info.run_name for r in runs) == [f"run-{i}" for i in range(4)]
    for run in runs:
        index = int(run.data.params["index"])
        history = client.get_metric_history(run.info.run_id, "rollout/score")
        assert sorted((m.step, m.value) for m in history) == [(s, float(index + s)) for s in range(3)]


def test_runs_started_together_get_distinct_directories(tmp_path):
    # Each run stops right after Hydra made its run directory (a refused option, see src/utils/startup_checks.py);
    # a refused run removes its directory and says which it was, so the two names are read from the outputs.
    cmd = [sys.executable, "src/train.py", "experiment=scienceworld", f"paths.log_dir={tmp_path}",
           "+trainer.limit_train_batches=1"]
    procs = [subprocess.Popen(cmd + [f"tags=[run{i}]"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for i in range(2)]
    outputs = [p.communicate(timeout=300)[0].decode() for p in procs]
    assert all("limit_train_batches" in out for out in outputs), outputs
    removed = [re.findall(r"Removed the run directory (\S+):", out) for out in outputs]
    assert all(len(r) == 1 for r in removed), outputs
    run_dirs = {Path(r[0]) for r in removed}
    assert len(run_dirs) == 2, run_dirs  # one directory per run, though both started in the same second
    assert all(d.parent == tmp_path / "train" / "runs" and not d.exists() for d in run_dirs), run_dirs


def test_a_resume_into_the_same_mlflow_run_keeps_the_first_parameters(tmp_path, caplog):
    """Resuming with ``+logger.mlflow.run_id`` logs the config again; MLflow refuses changed parameters, so the
    changed ones (here ckpt_path and max_epochs) become ``resumed/<key>`` tags and the rest is added."""
    from src.utils.logging import log_config

    conf = {"mlflow": {"_target_": "lightning.pytorch.loggers.mlflow.MLFlowLogger", "experiment_name": "empo2",
                       "run_name": "resumed", "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
                       "artifact_location": f"{tmp_path}/mlartifacts"}}
    logger, = instantiate_loggers(OmegaConf.create(conf))
    first = {"seed": 0, "ckpt_path": None, "trainer": {"max_epochs": 10}, "long": "x" * 300}
    log_config(OmegaConf.create(first), [logger])
    run_id = logger.run_id
    logger.finalize("success")

    conf["mlflow"]["run_id"] = run_id
    logger, = instantiate_loggers(OmegaConf.create(conf))
    resume = {**first, "ckpt_path": "ckpts/iter_0004.ckpt", "trainer": {"max_epochs": 15}, "added": 1}
    with caplog.at_level("WARNING", logger="src.utils.logging"):
        log_config(OmegaConf.create(resume), [logger])
    logger.finalize("success")

    run = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db").get_run(run_id)
    assert run.data.params == {"seed": "0", "ckpt_path": "None", "trainer/max_epochs": "10", "long": "x" * 250,
                               "added": "1"}
    assert {k: v for k, v in run.data.tags.items() if k.startswith("resumed/")} == {
        "resumed/ckpt_path": "ckpts/iter_0004.ckpt", "resumed/trainer/max_epochs": "15"}
    assert "ckpt_path, trainer/max_epochs" in caplog.text
    artifacts = sorted(a.path for a in mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").list_artifacts(run_id))
    assert artifacts == ["config.resumed-1.yaml", "config.yaml"]
