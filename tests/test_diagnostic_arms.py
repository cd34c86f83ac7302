"""The diagnostic arms of the adaptation protocol (src/evaluation/fixed_tips.py) on real Coin Collector with a tiny
random policy: every arm plays the same trial 0, the oracle and empty arms show their lines from trial 1 on, the
placeholder lines match the oracle lines' token lengths, training refuses a diagnostic memory, and arms run in
separate evaluations (``eval.own_tips=false``) merge into the summary one run would have written."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["experiment=coin", "model=tiny", "model.warm_start=null", "env.max_steps=3", "data.max_response_tokens=4",
         "memory.tip_max_tokens=8", "trainer.precision=32-true"]


def _compose(config: str, tmp: Path, *overrides: str):
    base = [f"paths.output_dir={tmp}/out", f"paths.log_dir={tmp}/logs", f"paths.data_dir={tmp}/data", *SMALL]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name=config, overrides=base + list(overrides))


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    from src.evaluation.runner import run_eval

    tmp = tmp_path_factory.mktemp("arms")
    return run_eval(_compose("eval", tmp, "eval.protocol=adaptation", "eval.trials=1", "eval.num_tasks=3",
                             "eval.episodes_per_task=2", "eval.control=true", "eval.oracle_tips=true",
                             "eval.empty_tips=true", "logger=none"))


@pytest.fixture(scope="module")
def oracle_only(tmp_path_factory):
    """The oracle arm alone, in a second evaluation of the same settings as ``summary``."""
    from src.evaluation.runner import run_eval

    tmp = tmp_path_factory.mktemp("oracle_only")
    return run_eval(_compose("eval", tmp, "eval.protocol=adaptation", "eval.trials=1", "eval.num_tasks=3",
                             "eval.episodes_per_task=2", "eval.own_tips=false", "eval.oracle_tips=true",
                             "logger=none"))


def _without(summary, arm):
    """``summary`` as a run without ``arm`` would have written it."""
    out = {k: v for k, v in summary.items() if k != f"{arm}_trials"}
    out["episode_rows"] = {a: rows for a, rows in summary["episode_rows"].items() if a != arm}
    out["paired_vs_off"] = {a: p for a, p in summary["paired_vs_off"].items() if a != arm}
    return out


def test_every_arm_plays_the_same_trial_0(summary):
    episodes = summary["episode_rows"]
    assert set(episodes) == {"memory", "control", "oracle", "empty"}
    trial0 = {arm: [(e["task"]["variation"], e["episode"], e["actions"]) for e in runs[0]]
              for arm, runs in episodes.items()}
    assert len(trial0["control"]) == 6 and all(rows == trial0["control"] for rows in trial0.values())
    for arm in ("oracle", "empty", "own"):
        first = summary["paired_vs_off"][arm][0]["score_diff"]
        assert first["mean"] == 0.0 and first["n"] == 6
    # from trial 1 on the prompts differ by the tips shown, so the same streams give other replies
    trial1 = {arm: [e["actions"] for e in runs[1]] for arm, runs in episodes.items()}
    assert trial1["oracle"] != trial1["control"] and trial1["empty"] != trial1["oracle"]
    assert summary["oracle_trials"][1]["memory"] and not summary["oracle_trials"][0]["memory"]


def test_oracle_tips_name_the_coin_and_placeholders_keep_their_length(tmp_path, tiny_policy):
    from src.envs.textworld_express import TextWorldExpressEnv
    from src.evaluation.fixed_tips import empty_tips, oracle_tips, task_key

    env = TextWorldExpressEnv(game_params={"numLocations": 4, "includeDoors": 1, "numDistractorItems": 0},
                              num_test_seeds=3)
    try:
        tasks = env.tasks("test")
        oracle = oracle_tips(env, tasks, {}, str(tmp_path))
    finally:
        env.close()
    lines = oracle.tips[task_key(tasks[0])]
    assert lines[0].startswith("The coin is in the ") and lines[1].startswith("The way: ")
    assert oracle.retrieve(tasks[:1], None) == [lines]
    tokenizer = tiny_policy.tokenizer
    empty = empty_tips(oracle, tokenizer)
    for key, oracle_lines in oracle.tips.items():
        for line, blank in zip(oracle_lines, empty.tips[key]):
            assert set(blank) <= {"-", " "}
            assert len(tokenizer(blank, add_special_tokens=False)["input_ids"]) == len(
                tokenizer(line, add_special_tokens=False)["input_ids"])


def test_training_refuses_a_diagnostic_memory(tmp_path):
    from src.train import train

    cfg = _compose("train", tmp_path, "memory._target_=src.evaluation.fixed_tips.FixedTips", "logger=csv")
    with pytest.raises(ValueError, match="is a diagnostic arm of src/eval.py"):
        train(cfg)


def test_the_arms_belong_to_the_adaptation_protocol(tmp_path):
    from src.evaluation.protocols import check_eval_config

    cfg = _compose("eval", tmp_path, "eval.oracle_tips=true")
    with pytest.raises(ValueError, match="eval.oracle_tips=true with eval.protocol='standard'"):
        check_eval_config(cfg.eval)


def test_an_arm_run_alone_repeats_its_episodes_and_merges_into_the_four_arm_summary(summary, oracle_only):
    from studies.merge_arms import merge_arms

    assert set(oracle_only["episode_rows"]) == {"oracle"} and "trials" not in oracle_only
    assert "paired_vs_off" not in oracle_only  # no control in this run
    # the same streams in another process: every trial of the oracle arm is the same episodes
    assert oracle_only["episode_rows"]["oracle"] == summary["episode_rows"]["oracle"]
    merged = merge_arms(_without(summary, "oracle"), oracle_only)
    assert merged["paired_vs_off"] == summary["paired_vs_off"]
    assert merged["oracle_trials"] == summary["oracle_trials"]
    assert merged["paired"] == summary["paired"] and merged["trials"] == summary["trials"]
    assert merged["episode_rows"] == summary["episode_rows"]


def test_merging_refuses_runs_that_are_not_the_same_evaluation(summary, oracle_only):
    import copy

    from studies.merge_arms import merge_arms

    base = _without(summary, "oracle")
    other = copy.deepcopy(oracle_only)
    other["episode_rows"]["oracle"][0][0]["actions"] = ["look around"]  # another stream in trial 0
    with pytest.raises(ValueError, match="trial 0 of extra's oracle arm is not base's"):
        merge_arms(base, other)
    with pytest.raises(ValueError, match="weights_sha256: base has"):
        merge_arms(base, {**oracle_only, "weights_sha256": "0" * 64})
    with pytest.raises(ValueError, match="has no arm that base lacks"):
        merge_arms(summary, oracle_only)


def test_leaving_out_the_own_tips_needs_another_arm(tmp_path):
    from src.evaluation.protocols import check_eval_config

    cfg = _compose("eval", tmp_path, "eval.protocol=adaptation", "eval.own_tips=false")
    with pytest.raises(ValueError, match="eval.own_tips=false with no other arm"):
        check_eval_config(cfg.eval)


def test_the_report_counts_a_buy_click_before_any_product():
    import importlib.util

    spec = importlib.util.spec_from_file_location("adaptation_report", ROOT / "scripts" / "adaptation_report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    early = report.buys_before_a_product
    assert early({"actions": ["search[tea]", "click[buy now]", "click[B0ABCDEFGH]", "click[buy now]"]})
    assert not early({"actions": ["search[tea]", "click[b0abcdefgh]", "click[chamomile]", "click[buy now]"]})
    assert early({"actions": ["search[tea]", "click[strawberry]", "click[buy now]"]})  # 10 letters, not an id
    assert not early({"actions": ["search[tea]", "click[next >]"]})
