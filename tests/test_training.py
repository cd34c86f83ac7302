"""Training end to end on real ScienceWorld with a tiny random policy: the real Lightning Trainer, MLflow store,
memory callback and checkpoints. Checks rollout freshness (no stale weights), resume with memory, GRPO."""
from __future__ import annotations

import os
from pathlib import Path

import mlflow
import pytest
import torch
from hydra import compose, initialize_config_dir

from src.train import train

ROOT = Path(__file__).resolve().parents[1]


def _cfg(tmp_path: Path, *overrides: str):
    base = [
        "experiment=scienceworld", "model=tiny", f"paths.output_dir={tmp_path}/run", f"paths.log_dir={tmp_path}/logs",
        "data.tasks_per_iteration=1", "data.group_size=2", "env.max_steps=3", "data.micro_batch_size=2",
        "data.val.num_tasks=1", "data.max_response_tokens=6", "algorithm.skip_zero_advantage=false",
        "~callbacks.rich_progress_bar", "trainer.enable_progress_bar=false",
    ]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="train", overrides=base + list(overrides))


def _metric_history(tracking_uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


@pytest.fixture(scope="module")
def empo2_run(tmp_path_factory):
    """Two EMPO² iterations (seed 8: on_policy then off_policy), two mini-batches per iteration."""
    tmp = tmp_path_factory.mktemp("empo2")
    cfg = _cfg(tmp, "trainer.max_epochs=2", "data.num_mini_batches=2", "trainer.check_val_every_n_epoch=2",
               "memory.tip_max_tokens=8")
    objs = train(cfg)
    return {"cfg": cfg, "objs": objs, "tmp": tmp}


def test_two_iterations_log_metrics_and_checkpoint_memory(empo2_run):
    objs, cfg = empo2_run["objs"], empo2_run["cfg"]
    trainer = objs["trainer"]
    assert trainer.current_epoch == 2 and trainer.global_step == 4  # 2 iterations x 2 mini-batches
    logger = objs["loggers"][0]
    uri = cfg.logger.mlflow.tracking_uri
    run = mlflow.MlflowClient(tracking_uri=uri).get_run(logger.run_id)
    for key in ("rollout/return", "rollout/score", "rollout/success_rate", "rollout/episode_length",
                "rollout/invalid_action_rate", "rollout/memory/size", "rollout/tips_written", "train/pg_loss",
                "train/clip_frac", "train/approx_kl", "train/entropy", "train/masked_frac",
                "rollout/rollout_tokens_per_s", "train/tokens_per_s", "rollout/mode_off_policy", "val/score"):
        assert key in run.data.metrics, key
    assert run.data.params["algorithm/name"] == "empo2"
    artifacts = {a.path for a in mlflow.MlflowClient(tracking_uri=uri).list_artifacts(logger.run_id)}
    assert {"config.yaml", "checkpoints"} <= artifacts
    # seed 8 draws on_policy then off_policy: the second iteration is a memory iteration
    assert [v for _, v in _metric_history(uri, logger.run_id, "rollout/mode_off_policy")] == [0.0, 1.0]
    ckpt = torch.load(objs["last_checkpoint"], map_location="cpu", weights_only=False)
    state = ckpt["callbacks"]["MemoryCallback"]
    assert len(objs["memory"].tips) > 0
    assert sum(len(p["entries"]) for p in state["tips"]["partitions"].values()) == len(objs["memory"].tips)


def test_rollouts_use_the_latest_weights(empo2_run):
    """Iteration k's rollout is generated after iteration k-1's last optimizer step (no prefetch lag)."""
    uri = empo2_run["cfg"].logger.mlflow.tracking_uri
    run_id = empo2_run["objs"]["loggers"][0].run_id
    at_rollout = [v for _, v in _metric_history(uri, run_id, "rollout/global_step_at_rollout")]
    # 2 optimizer steps per iteration: the rollouts of iterations 0 and 1 saw global steps 0 and 2
    assert at_rollout == [0.0, 2.0]


def test_resume_restores_memory_and_continues(empo2_run, tmp_path):
    from src.callbacks.memory import MemoryCallback

    saved = empo2_run["objs"]["last_checkpoint"]
    ckpt = torch.load(saved, map_location="cpu", weights_only=False)
    state = ckpt["callbacks"]["MemoryCallback"]
    n_saved = sum(len(p["entries"]) for p in state["tips"]["partitions"].values())
    # a fresh callback restored from the checkpoint has every entry, and retrieves one by its own key
    import hydra

    fresh: MemoryCallback = hydra.utils.instantiate(empo2_run["cfg"].memory)
    assert len(fresh.tips) == 0
    fresh.load_state_dict(state)
    assert len(fresh.tips) == n_saved
    partition, part = next(iter(state["tips"]["partitions"].items()))
    key = torch.as_tensor(part["keys"])[-1:].numpy()
    hits = fresh.tips.retrieve([partition], key)[0]
    # an entry's own key retrieves from its partition, exactly as the memory that was saved does
    assert hits and {e.content for e in hits} <= {e["content"] for e in part["entries"]}
    original = empo2_run["objs"]["memory"].tips.retrieve([partition], key)[0]
    assert [e.content for e in hits] == [e.content for e in original]
    # resuming the training run continues at iteration 2 with the memory in place
    cfg = _cfg(tmp_path, "trainer.max_epochs=3", "data.num_mini_batches=2", f"ckpt_path={saved}",
               "trainer.check_val_every_n_epoch=5", "memory.tip_max_tokens=8")
    objs = train(cfg)
    assert objs["trainer"].current_epoch == 3 and objs["trainer"].global_step == 6
    uri = cfg.logger.mlflow.tracking_uri
    iterations = [v for _, v in _metric_history(uri, objs["loggers"][0].run_id, "iteration")]
    assert iterations == [2.0]
    sizes = [v for _, v in _metric_history(uri, objs["loggers"][0].run_id, "rollout/memory/size")]
    assert sizes[0] > n_saved  # restored entries plus the tips written in iteration 2


def test_grpo_runs_without_memory(tmp_path):
    cfg = _cfg(tmp_path, "algorithm=grpo", "trainer.max_epochs=1", "logger=csv")
    assert cfg.algorithm.use_memory is False and cfg.algorithm.memory_rollout_prob == 0
    objs = train(cfg)
    assert objs["memory"] is None and objs["trainer"].global_step == 1
    ckpt = torch.load(objs["last_checkpoint"], map_location="cpu", weights_only=False)
    assert "MemoryCallback" not in ckpt["callbacks"]
    assert "rollout/return" in objs["metrics"]


def test_memory_mode_without_memory_is_refused(tmp_path):
    cfg = _cfg(tmp_path, "memory=none", "trainer.max_epochs=1", "logger=csv")
    with pytest.raises(ValueError, match="memory is off"):
        train(cfg)


def test_fast_dev_run_runs_one_real_iteration(tmp_path):
    """Lightning's fast_dev_run would stop after one micro-batch, before the iteration's optimizer step."""
    cfg = _cfg(tmp_path, "algorithm=grpo", "+trainer.fast_dev_run=true")
    objs = train(cfg)
    trainer = objs["trainer"]
    assert trainer.global_step == 1 and trainer.current_epoch == 1  # the whole iteration and its optimizer step
    assert "rollout/return" in objs["metrics"] and "val/score" in objs["metrics"]
    assert objs["loggers"] == [] and objs["last_checkpoint"] is None  # as Lightning's: no loggers, no checkpoints
    assert not (tmp_path / "logs").exists() and not (tmp_path / "run" / "checkpoints").exists()
