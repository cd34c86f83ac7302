"""ScienceWorldEnv on the real simulator (one JVM for the module) and the gold-trajectory cache."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from src.envs.scienceworld import (
    ScienceWorldEnv,
    TASK_NAMES,
    default_max_steps,
    load_gold,
    parse_action,
    resolve_task,
)

REPO = Path(__file__).resolve().parents[1]
FIND = "find-non-living-thing"
LIFESPAN = "lifespan-shortest-lived"
BASE_KEYS = {"score", "success", "won", "valid_action", "action", "task_id", "variation", "instruction",
             "max_score"}


@pytest.fixture(scope="module")
def env():
    e = ScienceWorldEnv([FIND, LIFESPAN, "power-component"])
    yield e
    e.close()


def test_gold_trajectory_replays_to_success(tmp_path, env):
    # Generated in a separate process, as in production (gold generation slows its own JVM).
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "cache_gold_trajectories.py"), "--task", "4-2",
                           "--variations", "0", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    gold = load_gold(FIND, tmp_path)
    assert list(gold) == [0]
    record = gold[0]
    assert record["success"] and record["final_score"] == 100.0

    obs, info = env.reset({"task_name": FIND, "variation": 0})
    assert obs == record["initial_observation"]
    initial = info["score"]
    total = 0.0
    for k, action in enumerate(record["actions"]):
        obs, reward, terminated, truncated, info = env.step(action)
        total += reward
        assert info["valid_action"], action
        assert obs == record["observations"][k]
        assert not truncated
    assert terminated and info["success"] and info["won"]
    assert info["score"] == 100.0 and info["max_score"] == 100.0
    assert total == 100.0 - initial  # rewards are score deltas from the post-reset score


def test_wrong_focus_scores_minus_100_and_terminates(env):
    obs, info = env.reset({"task_name": LIFESPAN, "variation": 0})
    assert info["score"] == 0.0  # this task awards nothing for the starting state
    assert "a picture" in obs  # the agent starts in the hallway, where a picture hangs
    obs, reward, terminated, truncated, info = env.step("focus on picture")
    assert reward == -100.0 and info["score"] == -100.0
    assert terminated and not truncated
    assert not info["success"] and not info["won"] and info["valid_action"]
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("look around")


def test_invalid_action_is_a_noop(env):
    first, info0 = env.reset({"task_name": FIND, "variation": 0})
    for bad in ["xyzzy the moon", "reset task", "", "look around."]:
        obs, reward, terminated, truncated, info = env.step(bad)
        assert not info["valid_action"], bad
        assert reward == 0.0 and not terminated and not truncated
        assert info["score"] == info0["score"]
        assert BASE_KEYS <= set(info)
    # Nothing moved: looking around shows the starting room unchanged.
    obs, *_ = env.step("look around")
    assert first.endswith(obs)


def test_action_parsing_and_ambiguity(env):
    assert parse_action("<think>kitchen first</think>\n<action> go to kitchen </action>") == "go to kitchen"
    assert parse_action("\n\n  look around \nthen more") == "look around"
    assert parse_action("<action>open door to kitchen") == "open door to kitchen"  # cut at the token limit
    assert parse_action("   \n") == ""

    env.reset({"task_name": FIND, "variation": 0})
    _, reward, _, _, info = env.step("<action>go to kitchen</action>")
    assert info["valid_action"] and info["action"] == "go to kitchen" and reward == 17.0  # 8 -> 25 points
    # Three doors in the kitchen: the simulator asks which; the alphabetically first option is taken.
    obs, _, _, _, info = env.step("look at door")
    assert info["action"] == "look at door between bathroom and kitchen"
    assert info["valid_action"] and obs == "A door to the bathroom (that is open)"


def test_action_cap_truncates(env):
    env.max_steps = 3
    try:
        _, info = env.reset({"task_name": FIND, "variation": 1})
        assert info["max_steps"] == 3
        flags = [env.step("look around")[2:4] for _ in range(3)]
        assert flags == [(False, False), (False, False), (False, True)]
        with pytest.raises(RuntimeError):
            env.step("look around")
    finally:
        env.max_steps = None
    _, info = env.reset({"task_name": FIND, "variation": 1})
    assert info["max_steps"] == 30
    assert [default_max_steps(t) for t in ("boil", "melt", "freeze", "chemistry-mix-paint-tertiary-color",
                                           "measure-melting-point-known-substance", "power-component")] == \
        [100, 80, 80, 60, 120, 30]


def test_action_correction_and_admissible_actions(env):
    env.action_correction = env.include_admissible_actions = True
    try:
        _, info = env.reset({"task_name": FIND, "variation": 0})
        actions = info["admissible_actions"]
        assert actions == sorted(actions) and "look around" in actions and "reset task" not in actions
        _, reward, _, _, info = env.step("Go to the kitchen.")
        assert info["action"] == "go to kitchen" and info["raw_action"] == "Go to the kitchen."
        assert info["valid_action"] and reward == 17.0
    finally:
        env.action_correction = env.include_admissible_actions = False


def test_task_resolution_and_errors(env, monkeypatch):
    assert resolve_task(25) == resolve_task("25") == resolve_task("3-1") == resolve_task("power-component") \
        == "power-component"
    assert resolve_task(7) == resolve_task("4-2") == FIND
    assert list(TASK_NAMES) == sorted(str(n) for n in env._server.getTaskNames())
    assert len(TASK_NAMES) == 30

    with pytest.raises(ValueError, match="power-component") as err:
        ScienceWorldEnv("not-a-task")
    assert "'not-a-task'" in str(err.value) and FIND in str(err.value)
    for bad in (30, -1, "11-1", True):
        with pytest.raises(ValueError, match="Unknown ScienceWorld task"):
            resolve_task(bad)
    with pytest.raises(ValueError, match="variation=20"):
        env.reset({"task_name": "power-component", "variation": 20})  # it has variations 0..19
    with pytest.raises(ValueError, match="task_name"):
        env.reset({"variation": 0})

    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeError, match="openjdk-17-jre-headless"):
        ScienceWorldEnv(FIND)


def test_tasks_splits(env):
    # find-non-living-thing has 300 variations: train 0-149, dev 150-224, test 225-299 (simulator's split).
    find = lambda split: [t["variation"] for t in env.tasks(split) if t["task_name"] == FIND]  # noqa: E731
    assert find("train") == [0, 1, 2, 3, 4]
    assert find("dev") == list(range(150, 170))
    assert find("test") == list(range(225, 245))
    # power-component has only 20 variations, so fewer than 20 test ones: all of them.
    env._load("power-component", 0)
    all_test = [int(v) for v in env._server.getVariationsTest()]
    assert 0 < len(all_test) < 20
    assert [t["variation"] for t in env.tasks("test") if t["task_name"] == "power-component"] == all_test
    assert len(env.tasks("train")) == 3 * 5
    with pytest.raises(ValueError, match="split"):
        env.tasks("validation")
    assert "focus on" in env.system_prompt
