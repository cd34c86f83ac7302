"""src/eval.py (src/evaluation/) on real ScienceWorld with a tiny random policy: the standard protocol with memory off, on from the
checkpoint and on built during the evaluation; reproducibility with the same seeds; the adaptation protocol on a
transfer pair with an unchanged weight hash; statistics and config errors with known answers."""
from __future__ import annotations

import json
import math
from pathlib import Path

import mlflow
import pytest
import torch
from hydra import compose, initialize_config_dir

from src.evaluation.runner import run_eval
from src.evaluation.stats import best_relative_gain, mean_stderr, weights_sha256
from src.train import train

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model=tiny", "model.warm_start=null", "env.max_steps=3", "data.max_response_tokens=6", "memory.tip_max_tokens=8",
         "~callbacks.rich_progress_bar", "trainer.enable_progress_bar=false"]


def _compose(config: str, tmp_path: Path, *overrides: str):
    extra = SMALL if config == "train" else [o for o in SMALL if "callbacks" not in o]
    base = [f"paths.output_dir={tmp_path}/out", f"paths.log_dir={tmp_path}/logs"] + extra
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name=config, overrides=base + list(overrides))


def _without_timings(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k != "rollout_s"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> dict:
    """One EMPO² iteration on train variation 0 only, so the checkpoint's memory covers that variation."""
    tmp = tmp_path_factory.mktemp("train")
    cfg = _compose("train", tmp, "experiment=scienceworld", "env.num_train_variations=1", "data.tasks_per_iteration=1",
                   "data.group_size=2", "data.micro_batch_size=2", "trainer.max_epochs=1",
                   "trainer.check_val_every_n_epoch=5", "logger=csv")
    objs = train(cfg)
    ckpt = torch.load(objs["last_checkpoint"], map_location="cpu", weights_only=False)
    n_tips = sum(len(p["entries"]) for p in ckpt["callbacks"]["MemoryCallback"]["tips"]["partitions"].values())
    assert n_tips > 0
    # the hash of the trained weights, computed independently of run_eval: a tiny policy with the checkpoint loaded
    from src.models.policy import build_policy

    policy = build_policy(**{**dict(cfg.model.policy), "gradient_checkpointing": False})
    policy.load_state_dict({k[len("policy."):]: v for k, v in ckpt["state_dict"].items() if k.startswith("policy.")})
    return {"path": objs["last_checkpoint"], "n_tips": n_tips, "sha256": weights_sha256(policy)}


# --------------------------------------------------------------------------- known answers
def test_mean_stderr_known_values():
    # mean 10, sample std sqrt(((−10)² + 0 + 10²)/2) = 10, stderr 10/sqrt(3)
    out = mean_stderr([0.0, 10.0, 20.0])
    assert out["n"] == 3 and out["mean"] == pytest.approx(10.0)
    assert out["stderr"] == pytest.approx(10.0 / math.sqrt(3.0))
    # success indicators 1,0,0,0: p = 0.25, s² = (0.75² + 3·0.25²)/3 = 0.25, stderr = 0.5/2
    assert mean_stderr([1.0, 0.0, 0.0, 0.0])["stderr"] == pytest.approx(0.25)
    assert mean_stderr([5.0]) == {"mean": 5.0, "stderr": None, "n": 1}
    assert mean_stderr([]) == {"mean": None, "stderr": None, "n": 0}
    assert mean_stderr([3.0, 3.0])["stderr"] == 0.0


def test_best_relative_gain_known_values():
    assert best_relative_gain([10.0, 5.0, 15.0]) == pytest.approx(0.5)
    assert best_relative_gain([-20.0, -30.0, -10.0]) == pytest.approx(0.5)  # |trial 0| in the denominator
    assert best_relative_gain([10.0, 5.0]) == pytest.approx(-0.5)
    assert best_relative_gain([0.0, 0.0, 0.0]) == 0.0
    assert best_relative_gain([0.0, 25.0]) is None
    with pytest.raises(ValueError, match="at least one later trial"):
        best_relative_gain([3.0])


def test_weights_hash_sees_a_one_element_change(tiny_policy):
    before = weights_sha256(tiny_policy)
    assert weights_sha256(tiny_policy) == before
    param = next(tiny_policy.parameters())
    with torch.no_grad():
        param.view(-1)[0] += 1e-3
        assert weights_sha256(tiny_policy) != before
        param.view(-1)[0] -= 1e-3


@pytest.mark.parametrize("override, match", [
    ("eval.protocol=bogus", r"eval.protocol='bogus': expected one of \('standard', 'adaptation'\)"),
    ("eval.seeds=[]", r"eval.seeds=.*non-empty list of ints"),
    ("eval.trials=0", r"eval.trials=0: expected an int >= 1"),
    ("+env.max_step=3", r"env.max_step: not a setting of ScienceWorldEnv"),  # the environment's own checks
    ("env.max_steps=0", r"env.max_steps=0: expected an int >= 1 or null"),
])
def test_bad_eval_settings_are_refused_before_building(tmp_path, override, match):
    cfg = _compose("eval", tmp_path, "experiment=scienceworld", "logger=none", override)
    with pytest.raises(ValueError, match=match):
        run_eval(cfg)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["empty", "truncated", "corrupt", "missing keys", "nan keys"])
def test_a_damaged_memory_file_is_refused_naming_the_file_before_building(tmp_path, monkeypatch, damage):
    """eval.memory_file whose memory.json is empty, keys.npy cut short, tips.jsonl not JSON, or keys.npy gone: one
    error naming the file and what the directory should hold, before the policy is built."""
    import numpy as np

    import src.evaluation.runner as runner
    from src.memory.memory_file import write_memory_files
    from src.utils.config_error import ConfigError

    state = {"dim": 4, "embedder_name": "embedded:all-MiniLM-L6-v2", "partitions": {"t/0": {
        "keys": np.eye(4, dtype=np.float32)[:2], "entries": [{"content": f"tip {i}", "score": 1.0, "step": i,
                                                              "created_at": 0.0, "iteration": 0} for i in range(2)]}}}
    memory = write_memory_files(state, tmp_path / "memory", "variation")
    name = {"empty": "memory.json", "corrupt": "tips.jsonl"}.get(damage, "keys.npy")
    target = memory / name
    if damage == "empty":
        target.write_text("")
    elif damage == "truncated":
        target.write_bytes(target.read_bytes()[:40])
    elif damage == "corrupt":
        target.write_text('{"partition": "t/0", "content": "tip 0"\n')
    elif damage == "nan keys":
        np.save(target, np.full((2, 4), np.nan, np.float32))
    else:
        target.unlink()
    monkeypatch.setattr(runner, "_build", lambda cfg: pytest.fail("the policy was built"))
    cfg = _compose("eval", tmp_path, "experiment=scienceworld", "logger=none", f"eval.memory_file={memory}")
    with pytest.raises(ConfigError, match=rf"memory file {target} \(.*\) cannot be read: .*holds memory.json, "
                                          rf"tips.jsonl and keys.npy"):
        run_eval(cfg)


# --------------------------------------------------------------------------- end to end
def test_standard_eval_without_memory(checkpoint, tmp_path, capsys):
    cfg = _compose("eval", tmp_path, "experiment=scienceworld", f"ckpt_path={checkpoint['path']}",
                   "eval.num_tasks=1", "eval.episodes_per_task=2", "eval.seeds=[0,1]")
    summary = run_eval(cfg)
    assert summary["memory"] is False and summary["memory_source"] == "none"
    assert summary["score"]["n"] == 1 * 2 * 2 - summary["failed_episodes"] and summary["failed_episodes"] == 0
    # equal episode counts per seed: the pooled mean is the mean of the seed means
    assert summary["score"]["mean"] == pytest.approx(sum(s["score"] for s in summary["per_seed"]) / 2)
    assert summary["weights_sha256"] == checkpoint["sha256"]  # the checkpoint's weights were evaluated
    saved = json.loads(Path(cfg.eval.summary_file).read_text())
    assert saved == json.loads(json.dumps(summary))
    assert json.loads(capsys.readouterr().out) == saved
    client = mlflow.MlflowClient(tracking_uri=cfg.logger.mlflow.tracking_uri)
    run = client.search_runs([client.get_experiment_by_name(cfg.logger.mlflow.experiment_name).experiment_id])[0]
    assert run.data.metrics["eval/score"] == pytest.approx(summary["score"]["mean"])
    assert run.data.metrics["eval/success_rate_stderr"] == pytest.approx(summary["success_rate"]["stderr"])
    assert run.data.params["eval/protocol"] == "standard"
    assert run.data.tags["rollout_precision_used"] == cfg.model.policy.rollout_precision != "auto"  # what ran here
    assert "eval_summary.json" in {a.path for a in client.list_artifacts(run.info.run_id)}


def test_memory_from_checkpoint_is_read_only(checkpoint, tmp_path):
    # train variation 0 is the one the checkpoint's memory was written on: its first state must hit
    cfg = _compose("eval", tmp_path, "experiment=scienceworld", f"ckpt_path={checkpoint['path']}", "logger=none",
                   "eval.memory=true", "eval.split=train", "eval.num_tasks=1", "eval.episodes_per_task=2")
    summary = run_eval(cfg)
    assert summary["memory_source"] == "checkpoint"
    assert summary["memory_size"] == checkpoint["n_tips"]  # nothing written during the evaluation
    assert summary["memory_hit_rate"] > 0


def test_memory_built_during_eval_is_reproducible(tmp_path):
    """Base model (ckpt_path=null): rounds of one episode per task write tips; a rerun gives the same numbers."""
    args = ("experiment=scienceworld", "ckpt_path=null", "logger=none", "eval.memory=true", "eval.num_tasks=1",
            "eval.episodes_per_task=2", "eval.seeds=[3]")
    first = run_eval(_compose("eval", tmp_path / "a", *args))
    second = run_eval(_compose("eval", tmp_path / "b", *args))
    assert first["memory_source"] == "built" and first["memory_size"] > 0
    # round 2 starts from the same reset states as round 1, whose entries it must retrieve
    assert first["memory_hit_rate"] > 0
    assert _without_timings(first) == _without_timings(second)


def test_adaptation_on_a_transfer_pair_leaves_the_weights_unchanged(checkpoint, tmp_path):
    cfg = _compose("eval", tmp_path, "experiment=transfer_power_to_paint", f"ckpt_path={checkpoint['path']}",
                   "logger=csv", "eval.trials=2", "eval.num_tasks=1", "eval.episodes_per_task=1", "eval.control=true")
    summary = run_eval(cfg)
    assert summary["protocol"] == "adaptation" and summary["task"] == "chemistry-mix-paint-secondary-color"
    # the memory-off control: the same trials, the same per-episode sampling streams, no tips
    control, paired = summary["control_trials"], summary["paired"]
    assert [r["trial"] for r in control] == [0, 1, 2] and not any(r["memory"] for r in control)
    assert control[0] == {k: v for k, v in summary["trials"][0].items() if k in control[0]}  # trial 0: same episodes
    for row, ctrl, diff in zip(summary["trials"], control, paired):
        assert diff["score_diff"]["n"] == 1
        assert diff["score_diff"]["mean"] == pytest.approx(row["score"] - ctrl["score"])
    assert paired[0]["score_diff"]["mean"] == 0 and summary["last_trial_paired_score_diff"] == paired[-1]["score_diff"]
    assert [r["trial"] for r in summary["reflections"]] == [0, 1, 2] and all(r["tip"] for r in summary["reflections"])
    # the report of both arms: figure and table (scripts/adaptation_report.py)
    import importlib.util

    spec = importlib.util.spec_from_file_location("adaptation_report", ROOT / "scripts" / "adaptation_report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    text = report.report({"ScienceWorld": summary}, tmp_path / "report")
    assert (tmp_path / "report" / "adaptation_control.png").stat().st_size > 0
    assert f"| 0 | {summary['trials'][0]['score']:.1f}" in text and "Paired difference at the last trial" in text
    rows = summary["trials"]
    assert [r["trial"] for r in rows] == [0, 1, 2] and [r["memory"] for r in rows] == [False, True, True]
    assert rows[0]["memory_size_before"] == 0 and rows[1]["memory_size_before"] > 0  # trial 0 wrote tips
    assert rows[2]["memory_size_before"] > rows[1]["memory_size_before"]
    scores = [r["score"] for r in rows]
    assert summary["best_score"] == max(scores[1:])
    assert summary["best_absolute_gain"] == pytest.approx(max(scores[1:]) - scores[0])
    assert summary["best_relative_gain"] == best_relative_gain(scores)
    # no update happened: the evaluated weights are exactly the checkpoint's
    assert summary["weights_sha256"] == checkpoint["sha256"] and summary["weights_unchanged"] is True
    assert (tmp_path / "out" / "csv").exists()


def test_webshop_checkpoint_eval(tmp_path):
    """A one-iteration WebShop run (KL on, so the run had a reference model) evaluates from its checkpoint."""
    run = _compose("train", tmp_path / "train", "experiment=webshop", "data.tasks_per_iteration=1",
                   "algorithm.kl_coef=0.01", "algorithm.skip_zero_advantage=false",
                   "data.group_size=2", "data.micro_batch_size=2", "trainer.max_epochs=1",
                   "trainer.check_val_every_n_epoch=5", "data.val.num_tasks=2", "logger=none")  # never validates
    ckpt = train(run)["last_checkpoint"]
    cfg = _compose("eval", tmp_path / "eval", "experiment=webshop", f"ckpt_path={ckpt}", "logger=none",
                   "eval.num_tasks=2", "eval.episodes_per_task=1")
    summary = run_eval(cfg)
    assert summary["env"] == "src.envs.webshop.WebShopEnv" and summary["split"] == "test"
    assert summary["score"]["n"] == 2 and 0.0 <= summary["score"]["mean"] <= 1.0  # WebShop scores are in [0, 1]
    assert json.loads(Path(cfg.eval.summary_file).read_text()) == json.loads(json.dumps(summary))
