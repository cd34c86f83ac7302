"""Training end to end on real ScienceWorld with a tiny random policy: the real Lightning Trainer, MLflow store,
memory callback and checkpoints. Checks rollout freshness (no stale weights), resume with memory, GRPO."""
from __future__ import annotations

import json
import os
from pathlib import Path

import mlflow
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import get_original_cwd
from omegaconf import OmegaConf

from src.train import train

ROOT = Path(__file__).resolve().parents[1]


def _cfg(tmp_path: Path, *overrides: str):
    base = [
        "experiment=scienceworld", "model=tiny", "model.warm_start=null", f"paths.output_dir={tmp_path}/run", f"paths.log_dir={tmp_path}/logs",
        "data.tasks_per_iteration=1", "data.group_size=2", "env.max_steps=3", "data.micro_batch_size=2",
        "data.num_mini_batches=1",  # one optimizer step per iteration (the experiment takes two)
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
    """Four EMPO² iterations (seed 3 draws off_policy, on_policy, on_policy_with_tips, off_policy), two mini-batches
    per iteration, validation after iterations 1 and 3, a checkpoint after every iteration."""
    tmp = tmp_path_factory.mktemp("empo2")
    cfg = _cfg(tmp, *EXACT_RUN)
    objs = train(cfg)
    return {"cfg": cfg, "objs": objs, "tmp": tmp}


# the shipped checkpoint settings (last.ckpt after every iteration); an entropy bonus gives the tiny random policy a
# gradient on ScienceWorld, where all its episodes score the same (zero advantages): without it nothing would train
# and a resume that lost the weights or the optimizer state would go unnoticed
# one memory partition for the task: the memory iterations 2 and 3 retrieve what iterations 0 and 1 wrote (each
# iteration draws another variation)
EXACT_RUN = ("seed=3", "trainer.max_epochs=4", "data.num_mini_batches=2", "trainer.check_val_every_n_epoch=2",
             "memory.tip_max_tokens=8", "algorithm.entropy_coef=0.01", "memory.partition=task")


def test_four_iterations_log_metrics_and_checkpoint_memory(empo2_run):
    objs, cfg = empo2_run["objs"], empo2_run["cfg"]
    trainer = objs["trainer"]
    assert trainer.current_epoch == 4 and trainer.global_step == 8  # 4 iterations x 2 mini-batches
    logger = objs["loggers"][0]
    uri = cfg.logger.mlflow.tracking_uri
    run = mlflow.MlflowClient(tracking_uri=uri).get_run(logger.run_id)
    for key in ("rollout/return", "rollout/intrinsic_return", "rollout/extrinsic_return", "rollout/score",
                "rollout/success_rate", "rollout/episode_length", "rollout/invalid_action_rate", "rollout/memory/size",
                "rollout/memory/novelty_visits", "rollout/tips_written", "train/pg_loss", "train/clip_frac",
                "train/approx_kl", "train/entropy", "train/masked_frac", "rollout/rollout_tokens_per_s",
                "train/tokens_per_s", "rollout/mode_off_policy", "val/score"):
        assert key in run.data.metrics, key
    assert 0.1 < run.data.metrics["system/peak_rss_gib"] < 64  # GiB, not KiB or bytes
    assert run.data.params["algorithm/name"] == "empo2"
    artifacts = {a.path for a in mlflow.MlflowClient(tracking_uri=uri).list_artifacts(logger.run_id)}
    assert {"config.yaml", "checkpoints"} <= artifacts
    assert [v for _, v in _metric_history(uri, logger.run_id, "rollout/mode_off_policy")] == [1.0, 0.0, 0.0, 1.0]
    # per-iteration metrics against the iteration; the mode as one value (0 on_policy, 1 with tips, 2 off_policy)
    assert _metric_history(uri, logger.run_id, "rollout/mode") == [(0, 2.0), (1, 0.0), (2, 1.0), (3, 2.0)]
    assert [step for step, _ in _metric_history(uri, logger.run_id, "rollout/score")] == [0, 1, 2, 3]
    assert [step for step, _ in _metric_history(uri, logger.run_id, "val/score")] == [2, 4]  # iterations trained
    # per-update metrics keep the optimizer step and name their iteration
    assert _metric_history(uri, logger.run_id, "train/iteration") == [(s, float((s - 1) // 2)) for s in range(1, 9)]
    # the novelty bonus is in the return: return = extrinsic + intrinsic (γ = 1), and the bonus is positive
    ret, ext, intr = (dict(_metric_history(uri, logger.run_id, f"rollout/{k}"))
                      for k in ("return", "extrinsic_return", "intrinsic_return"))
    assert all(intr[s] > 0 and ret[s] == pytest.approx(ext[s] + intr[s]) for s in ret)
    ckpt = torch.load(objs["last_checkpoint"], map_location="cpu", weights_only=False)
    state = ckpt["callbacks"]["MemoryCallback"]
    assert len(objs["memory"].tips) > 0
    assert sum(len(p["entries"]) for p in state["tips"]["partitions"].values()) == len(objs["memory"].tips)


def test_every_iteration_logs_the_tips_it_wrote_and_retrieved(empo2_run, tmp_path):
    """Each iteration's MLflow artifacts hold a table of the entries written (the entries of the checkpoint's memory,
    each in the table of the iteration that wrote it, and nothing else) and, in memory iterations, of the tips
    retrieved (each names
    an entry written in an earlier iteration, with its cosine above the threshold); the run directory holds the same
    files, and the memory exported from the checkpoint carries every entry's iteration."""
    from src.callbacks.tip_tables import read_table
    from src.memory.memory_file import TIPS, write_memory_files

    objs, cfg = empo2_run["objs"], empo2_run["cfg"]
    client = mlflow.MlflowClient(tracking_uri=cfg.logger.mlflow.tracking_uri)
    run_id = objs["loggers"][0].run_id
    names = sorted(a.path for a in client.list_artifacts(run_id, "tips"))
    # seed 3: iteration 0 is a memory iteration with an empty memory; 2 and 3 retrieve what 0 and 1 wrote
    assert names == [f"tips/iteration_{i:04d}_written.json" for i in range(4)][:2] + [
        "tips/iteration_0002_retrieved.json", "tips/iteration_0002_written.json",
        "tips/iteration_0003_retrieved.json", "tips/iteration_0003_written.json"]
    local = Path(cfg.paths.output_dir) / "tips"
    assert sorted(f"tips/{p.name}" for p in local.iterdir()) == names
    tables = {name: read_table(client.download_artifacts(run_id, name, str(tmp_path))) for name in names}
    assert all(read_table(local / Path(name).name) == rows for name, rows in tables.items())
    written = [(r["iteration"], r["partition"], r["content"]) for name, rows in tables.items() if "written" in name
               for r in rows]
    assert all(r["mode"] == mode for i, mode in enumerate(["off_policy", "on_policy", "on_policy_with_tips",
                                                           "off_policy"])
               for r in tables[f"tips/iteration_{i:04d}_written.json"])
    state = torch.load(objs["last_checkpoint"], map_location="cpu", weights_only=False)["callbacks"]["MemoryCallback"]
    entries = [(e["iteration"], name, e["content"]) for name, p in state["tips"]["partitions"].items()
               for e in p["entries"]]
    assert entries and sorted(entries) == sorted(written)  # one row per entry stored (a repeated line is stored once)
    assert {i for i, _, _ in entries} == {0, 1, 2, 3}
    for i in (2, 3):
        rows = tables[f"tips/iteration_{i:04d}_retrieved.json"]
        assert rows and all(r["iteration"] == i and r["tip_iteration"] < i and r["similarity"] > 0.5 for r in rows)
        assert {(r["tip_iteration"], r["partition"], r["content"]) for r in rows} <= set(entries)
        assert all(0 <= r["rank"] < cfg.memory.tip_memory.top_k for r in rows)
    out = write_memory_files(state["tips"], tmp_path / "memory", "variation")
    lines = [json.loads(line) for line in (out / TIPS).read_text().splitlines()]
    assert len(lines) == len(entries) and all(isinstance(line["iteration"], int) for line in lines)


def test_rollouts_use_the_latest_weights(empo2_run):
    """Iteration k's rollout is generated after iteration k-1's last optimizer step (no prefetch lag)."""
    uri = empo2_run["cfg"].logger.mlflow.tracking_uri
    run_id = empo2_run["objs"]["loggers"][0].run_id
    at_rollout = [v for _, v in _metric_history(uri, run_id, "rollout/global_step_at_rollout")]
    # 2 optimizer steps per iteration: the rollouts of iterations 0..3 saw global steps 0, 2, 4, 6
    assert at_rollout == [0.0, 2.0, 4.0, 6.0]


def _is_timing(key: str) -> bool:
    """Timings and the process's memory: they differ between two runs of the same iterations."""
    return key.endswith("_s") or key in ("epoch",) or key.startswith("system/")


def _metrics_of_iterations_2_and_3(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """Every logged metric point of iterations 2 and 3 (timings aside). Rollout metrics are logged with the
    iteration as their step (2, 3), update metrics after each optimizer step (5..8), validation (after iterations 1
    and 3) with the iterations trained (2, 4): its last point is iteration 3's."""
    client = mlflow.MlflowClient(tracking_uri=uri)
    out = {}
    for key in client.get_run(run_id).data.metrics:
        if _is_timing(key):
            continue
        points = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        if key.startswith("val/"):
            points = points[-1:]
        else:
            rollout = key.startswith("rollout/") or key == "iteration"
            points = [(step, v) for step, v in points if (step >= 2 if rollout else step > 4)]
        if points:
            out[key] = points
    return out


def _memory_state(memory) -> dict:
    """Tip entries (without their wall-clock creation time), their keys, and the novelty states and counts."""
    tips = memory.tips.state_dict()["partitions"]
    return {"tips": {name: ([{k: v for k, v in e.items() if k != "created_at"} for e in p["entries"]],
                            torch.as_tensor(p["keys"]).tolist()) for name, p in tips.items()},
            "novelty": memory.novelty.visits(),
            "novelty_states": {k: v.tolist() for k, v in memory.novelty.state_dict()["states"].items()}}


@pytest.fixture
def launch_dir_is_elsewhere(monkeypatch, tmp_path):
    """What `hydra.job.chdir=true` does: the process runs in the output dir, Hydra remembers the launch dir."""
    from hydra.core.hydra_config import HydraConfig

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        hydra_cfg = compose(config_name="train", return_hydra_config=True)
    hydra_cfg.hydra.runtime.cwd = os.getcwd()
    HydraConfig.instance().set_config(hydra_cfg)
    (tmp_path / "chdir").mkdir()
    monkeypatch.chdir(tmp_path / "chdir")
    yield
    HydraConfig.instance().cfg = None


def test_a_crash_leaves_the_last_iteration_and_resuming_it_is_exact(empo2_run, tmp_path, launch_dir_is_elsewhere):
    """With the shipped checkpoint settings, a run that crashes inside iteration 2 (after an optimizer step) leaves
    last.ckpt of iteration 1 and nothing else. Resuming from it: 2 iterations + crash + resume + 2 == 4
    uninterrupted iterations in weights, optimizer state, memory entries, novelty counts and every logged metric
    (timings aside). The checkpoint path is relative to the launch dir while the process runs elsewhere
    (hydra.job.chdir=true)."""
    full = empo2_run["objs"]
    uri_full = empo2_run["cfg"].logger.mlflow.tracking_uri
    grad_norms = [v for _, v in _metric_history(uri_full, full["loggers"][0].run_id, "train/grad_norm")]
    assert len(grad_norms) == 8 and all(v > 0 for v in grad_norms)  # every optimizer step trained
    crashed = _cfg(tmp_path / "crashed", *EXACT_RUN, "+callbacks.crash._target_=probes.CrashAtIteration",
                   "+callbacks.crash.iteration=2")
    with pytest.raises(RuntimeError, match="injected crash in iteration 2 at global step 5"):
        train(crashed)
    saved = tmp_path / "crashed" / "run" / "checkpoints" / "last.ckpt"
    assert sorted(p.name for p in saved.parent.iterdir()) == ["last.ckpt"]
    head = torch.load(saved, map_location="cpu", weights_only=True)
    assert (head["global_step"], head["iteration"]) == (4, 1)  # iteration 1's end, not the half-done iteration 2
    relative = os.path.relpath(saved, get_original_cwd())
    assert not Path(relative).exists()  # not from the current directory
    cfg = _cfg(tmp_path, *EXACT_RUN, f"ckpt_path={relative}")
    resumed = train(cfg)
    assert resumed["trainer"].global_step == 8
    uri_resumed = cfg.logger.mlflow.tracking_uri
    assert [v for _, v in _metric_history(uri_resumed, resumed["loggers"][0].run_id, "iteration")] == [2.0, 3.0]
    got = _metrics_of_iterations_2_and_3(uri_resumed, resumed["loggers"][0].run_id)
    want = _metrics_of_iterations_2_and_3(uri_full, full["loggers"][0].run_id)
    assert len(got["val/score"]) == 1 and len(got["rollout/return"]) == 2 and len(got["train/pg_loss"]) == 4
    assert set(got) == set(want)
    assert [k for k in sorted(want) if got[k] != want[k]] == []
    at_resume = torch.load(saved, map_location="cpu", weights_only=True)["state_dict"]
    assert any(not torch.equal(at_resume[f"policy.{k}"], p) for k, p in full["module"].policy.state_dict().items())
    for name, p in full["module"].policy.state_dict().items():
        assert torch.equal(resumed["module"].policy.state_dict()[name], p), name
    opt_full = torch.load(full["last_checkpoint"], map_location="cpu", weights_only=False)["optimizer_states"][0]
    opt_resumed = torch.load(resumed["last_checkpoint"], map_location="cpu", weights_only=False)["optimizer_states"][0]
    assert opt_full["param_groups"] == opt_resumed["param_groups"]
    assert opt_full["state"].keys() == opt_resumed["state"].keys() and opt_full["state"]
    assert any(bool(state["exp_avg"].any()) for state in opt_full["state"].values())  # AdamW has moments to restore
    for i, state in opt_full["state"].items():
        for k, v in state.items():
            assert torch.equal(opt_resumed["state"][i][k], v), (i, k)
    assert _memory_state(resumed["memory"]) == _memory_state(full["memory"])
    assert sum(sum(c) for c in full["memory"].novelty.visits().values()) > 0


def test_restored_memory_retrieves_like_the_saved_one(empo2_run):
    """A fresh memory callback restored from the checkpoint holds every entry and retrieves as the saved one."""
    from src.callbacks.memory import MemoryCallback

    state = torch.load(empo2_run["objs"]["last_checkpoint"], map_location="cpu", weights_only=False)
    state = state["callbacks"]["MemoryCallback"]
    fresh = MemoryCallback.from_config(empo2_run["cfg"].memory)
    assert len(fresh.tips) == 0
    fresh.load_state_dict(state)
    assert len(fresh.tips) == sum(len(p["entries"]) for p in state["tips"]["partitions"].values())
    assert fresh.novelty.visits() == empo2_run["objs"]["memory"].novelty.visits()
    partition, part = next(iter(state["tips"]["partitions"].items()))
    key = torch.as_tensor(part["keys"])[-1:].numpy()
    hits = fresh.tips.retrieve([partition], key)[0]
    assert hits and {e.content for e in hits} <= {e["content"] for e in part["entries"]}
    original = empo2_run["objs"]["memory"].tips.retrieve([partition], key)[0]
    assert [e.content for e in hits] == [e.content for e in original]


def test_grpo_runs_without_memory(tmp_path):
    cfg = _cfg(tmp_path, "algorithm=grpo", "trainer.max_epochs=1", "logger=csv")
    assert cfg.algorithm.use_memory is False and cfg.algorithm.memory_rollout_prob == 0
    objs = train(cfg)
    assert objs["memory"] is None and objs["trainer"].global_step == 1
    ckpt = torch.load(objs["last_checkpoint"], map_location="cpu", weights_only=False)
    assert "MemoryCallback" not in ckpt["callbacks"]
    assert "rollout/return" in objs["metrics"]


def test_grpo_with_the_novelty_bonus_writes_and_shows_no_tip(tmp_path):
    """algorithm=grpo_novelty: EMPO²'s novelty bonus, nothing else of its memory (the arm that tells the memory's
    effect from the bonus's)."""
    cfg = _cfg(tmp_path, "algorithm=grpo_novelty", "trainer.max_epochs=2", "logger=csv", "seed=3")
    assert cfg.algorithm.name == "grpo_novelty" and cfg.algorithm.memory_rollout_prob == 0
    objs = train(cfg)
    memory = objs["memory"]
    assert memory is not None and len(memory.tips) == 0 and len(memory.novelty) > 0
    import csv

    (path,) = Path(cfg.paths.output_dir).glob("csv/*/metrics.csv")
    rows = [r for r in csv.DictReader(path.open()) if r.get("rollout/mode")]
    assert len(rows) == 2 and all(float(r["rollout/mode"]) == 0 for r in rows)  # on-policy only
    assert all(float(r["rollout/intrinsic_return"]) > 0 for r in rows)  # the bonus is paid
    assert not any(r.get("rollout/tips_written") for r in rows)
    assert not list(Path(cfg.paths.output_dir).glob("tips/*written.json"))


def test_auto_precision_is_tagged_and_only_the_last_checkpoint_is_kept(tmp_path, monkeypatch):
    """trainer.precision=auto (the CPU experiments' setting) runs with this machine's choice, which the MLflow run
    records as the tag precision_used, beside the machine it ran on (tag machine); by default a run keeps last.ckpt
    only (no disk growth per iteration), and log_checkpoint_artifact=false keeps its copy out of the MLflow
    artifacts."""
    from src.utils import precision_choice
    from src.utils.logging import machine_description

    monkeypatch.setenv(precision_choice.ENV_VAR, "")  # probe here (restored afterwards)
    cfg = _cfg(tmp_path, "algorithm=grpo", "trainer.max_epochs=2", "trainer.precision=auto",
               "trainer.check_val_every_n_epoch=2", "log_checkpoint_artifact=false")
    objs = train(cfg)
    chosen = os.environ[precision_choice.ENV_VAR].split("|")[1]
    assert chosen in ("32-true", "bf16-mixed") and objs["trainer"].precision == chosen
    client = mlflow.MlflowClient(tracking_uri=cfg.logger.mlflow.tracking_uri)
    tags = client.get_run(objs["loggers"][0].run_id).data.tags
    assert tags["precision_used"] == chosen
    assert tags["machine"] == machine_description() and f"{os.cpu_count()} cores" in tags["machine"]  # where it ran
    assert sorted(p.name for p in Path(objs["last_checkpoint"]).parent.iterdir()) == ["last.ckpt"]
    assert [a.path for a in client.list_artifacts(objs["loggers"][0].run_id) if a.path == "checkpoints"] == []


def test_checkpoints_follow_every_n_epochs_and_always_hold_the_last_iteration(tmp_path):
    """The shipped checkpoint settings with every_n_epochs=2 over 3 iterations: last.ckpt appears after iteration 1
    (global step 2), and the run ends with the final iteration saved (global step 3), one file on disk."""
    from stub_envs import STUB_CFG

    cfg = _cfg(tmp_path, "algorithm=grpo", "logger=csv", "data.val=null", "trainer.max_epochs=3",
               "callbacks.model_checkpoint.every_n_epochs=2", "+callbacks.probe._target_=probes.LastCheckpointProbe")
    cfg.env = OmegaConf.create({**STUB_CFG, "reward_per_char": 0.01, "max_steps": 2})
    objs = train(cfg)
    [probe] = [c for c in objs["trainer"].callbacks if type(c).__name__ == "LastCheckpointProbe"]
    assert probe.seen == [None, None, 2]  # global step of last.ckpt when iterations 0, 1, 2 start
    last = Path(objs["last_checkpoint"])
    assert last.name == "last.ckpt" and [p.name for p in last.parent.iterdir()] == ["last.ckpt"]
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == 3


def test_memory_mode_without_memory_is_refused(tmp_path):
    cfg = _cfg(tmp_path, "algorithm.use_memory=false", "trainer.max_epochs=1", "logger=csv")
    with pytest.raises(ValueError, match="draws memory rollouts, but algorithm.use_memory=false builds no memory"):
        train(cfg)


def test_fast_dev_run_runs_one_real_iteration(tmp_path, caplog):
    """Lightning's fast_dev_run would stop after one micro-batch, before the iteration's optimizer step."""
    cfg = _cfg(tmp_path, "algorithm=grpo", "+trainer.fast_dev_run=true")
    with caplog.at_level("INFO", logger="src.data.rollout"):
        objs = train(cfg)
    trainer = objs["trainer"]
    assert trainer.global_step == 1 and trainer.current_epoch == 1  # the whole iteration and its optimizer step
    assert "rollout/return" in objs["metrics"] and "val/score" in objs["metrics"]
    # the validation episode (one held-out variation) is logged with its actions; its score is val/score
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("validation after 1 optimizer steps")]
    held_out = objs["datamodule"].val_tasks[0]
    assert len(lines) == 1 and lines[0].startswith(f"validation after 1 optimizer steps {held_out}: score "), lines
    assert float(lines[0].split(": score ")[1].split(",")[0]) == pytest.approx(float(objs["metrics"]["val/score"]))
    assert objs["loggers"] == [] and objs["last_checkpoint"] is None  # as Lightning's: no loggers, no checkpoints
    assert not (tmp_path / "logs").exists() and not (tmp_path / "run" / "checkpoints").exists()


def test_no_signal_guard_warns_then_raises(tmp_path):
    """A stub environment with zero reward under GRPO: every advantage is 0, the run learns nothing. After
    `no_signal_patience` such iterations the guard warns with the cause and the metrics, or raises."""
    from stub_envs import STUB_CFG

    def cfg(*overrides):
        c = _cfg(tmp_path, "algorithm=grpo", "logger=csv", "data.val=null", *overrides)
        c.env = OmegaConf.create({**STUB_CFG, "reward": 0.0, "max_steps": 2})
        return c

    with pytest.warns(UserWarning, match=r"no trainable signal for 2 consecutive iterations \(iterations 0\.\.1.*"
                                         r"all advantages are zero.*'rollout/adv/zero_var_group_frac': 1\.0") as seen:
        train(cfg("trainer.max_epochs=2", "algorithm.no_signal_patience=2"))
    assert len([w for w in seen if "no trainable signal" in str(w.message)]) == 1  # not after iteration 0
    with pytest.raises(RuntimeError, match="no trainable signal for 1 consecutive.*all advantages are zero"):
        train(cfg("trainer.max_epochs=2", "algorithm.no_signal_patience=1", "algorithm.fail_on_no_signal=true"))


@pytest.mark.parametrize("experiment", ["scienceworld", "webshop", "scienceworld_paper", "webshop_paper"])
def test_experiment_configs_pass_the_algorithm_checks(experiment):
    """Every experiment passes the start-up checks (WebShop has a KL penalty, so no zero-advantage skipping), and
    WebShop's memory is one partition for all goals (per-goal partitions almost never retrieve;
    docs/evaluation.md#memory-partitions-in-evaluation)."""
    from src.models.algorithm_config import AlgorithmConfig

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"experiment={experiment}"])
    AlgorithmConfig.from_dict(OmegaConf.to_container(cfg.algorithm, resolve=True))
    if experiment.startswith("webshop"):
        assert cfg.memory.partition == "task"


def test_the_smoke_run_updates_the_policy_and_logs_its_tips_to_mlflow(tmp_path):
    """`python src/train.py experiment=smoke` (the README's first command): 2 iterations that roll out, write tips,
    retrieve them (iteration 1) and take optimizer steps with a non-zero gradient, all in the MLflow store."""
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["experiment=smoke", f"paths.output_dir={tmp_path}/run",
                                                      f"paths.log_dir={tmp_path}/logs"])
    objs = train(cfg)
    uri, run_id = cfg.logger.mlflow.tracking_uri, objs["loggers"][0].run_id
    grad_norms = _metric_history(uri, run_id, "train/grad_norm")
    assert len(grad_norms) == 2 and all(v > 0 for _, v in grad_norms)
    assert all(v == 0 for _, v in _metric_history(uri, run_id, "train/update_skipped"))
    artifacts = {a.path for a in mlflow.MlflowClient(tracking_uri=uri).list_artifacts(run_id, "tips")}
    assert {"tips/iteration_0000_written.json", "tips/iteration_0001_retrieved.json"} <= artifacts
