"""The loggers besides MLflow (``logger=tensorboard``, ``logger=wandb`` offline, ``logger=csv``): each gets the
per-iteration and per-update metrics, the config and the tips, from a real smoke run (experiment=smoke)."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

from src.train import train

ROOT = Path(__file__).resolve().parents[1]
METRICS = ("rollout/score", "rollout/mode", "memory/hit_rate", "train/grad_norm", "val/score")


def _smoke(tmp_path: Path, logger: str) -> tuple[dict, Path]:
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["experiment=smoke", f"logger={logger}",
                                                      f"paths.output_dir={tmp_path}/run",
                                                      f"paths.log_dir={tmp_path}/logs"])
    objs = train(cfg)
    run_dir = tmp_path / "run"
    # every logger: the tip tables in the run directory
    tips = {p.name for p in (run_dir / "tips").iterdir()}
    assert {"iteration_0000_written.json", "iteration_0001_retrieved.json"} <= tips
    return objs, run_dir


def _key(name: str) -> str:
    return name if name.startswith(("train/", "val/")) else ("rollout/" + name if name.startswith("memory/") else name)


def test_tensorboard_gets_the_metrics_against_the_iteration_the_config_and_the_written_tips(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run_dir = _smoke(tmp_path, "tensorboard")
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    for name in METRICS:
        assert _key(name) in events.Tags()["scalars"], name
    assert [s.step for s in events.Scalars("rollout/score")] == [0, 1]  # iterations
    assert [s.step for s in events.Scalars("train/grad_norm")] == [1, 2]  # optimizer steps
    assert "tips/written/text_summary" in events.Tags()["tensors"]
    hparams = yaml.safe_load((run_dir / "tensorboard" / "hparams.yaml").read_text())
    assert hparams["algorithm/name"] == "empo2" and hparams["env/task"] == "find-non-living-thing"


@pytest.mark.slow  # ~30 s on 2 cores; TensorBoard and CSV stay in CI
def test_wandb_runs_offline_and_gets_the_metrics_the_config_and_the_tip_tables(tmp_path, monkeypatch):
    import wandb

    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline by the config, not by the environment
    objs, run_dir = _smoke(tmp_path, "wandb")
    run = objs["loggers"][0].experiment
    try:
        assert run.offline  # nothing sent
        summary = dict(run.summary)
        for name in METRICS:
            assert _key(name) in summary, name
        assert summary["train/grad_norm"] > 0
        assert {"tips/written", "tips/retrieved"} <= set(summary)  # the wandb.Table panels
        assert run.config["algorithm/name"] == "empo2"
        (offline,) = (run_dir / "wandb").glob("offline-run-*")
        assert next(offline.glob("run-*.wandb")).stat().st_size > 0
    finally:
        wandb.finish()


def test_csv_gets_the_metrics_and_the_config(tmp_path):
    _, run_dir = _smoke(tmp_path, "csv")
    (metrics,) = run_dir.rglob("metrics.csv")
    with open(metrics) as f:
        rows = list(csv.DictReader(f))
    for name in METRICS:
        assert any(row.get(_key(name)) for row in rows), name
    hparams = yaml.safe_load(next(run_dir.rglob("hparams.yaml")).read_text())
    assert hparams["algorithm/name"] == "empo2"
