"""TextWorldExpress on the real simulator (src/envs/textworld_express.py, one JVM): gold paths, invalid actions, seeds
and folds, gold paths the same in every run, the hindsight tips, a JVM killed under the worker pool."""
from __future__ import annotations

import os
import signal

import pytest

from src.envs.base import replay
from src.envs.pool import EnvPool
from src.envs.textworld_express import TextWorldExpressEnv, textworld_express_tip

COIN = {"numLocations": 4, "includeDoors": 1, "numDistractorItems": 0}
CFG = {"_target_": "src.envs.textworld_express.TextWorldExpressEnv", "game_params": COIN, "max_steps": 40,
       "num_train_seeds": 20, "num_test_seeds": 20}


@pytest.fixture(scope="module")
def coin():
    env = TextWorldExpressEnv(game_params=COIN, max_steps=40, num_train_seeds=20, num_test_seeds=20)
    yield env
    env.close()


def test_a_gold_path_reaches_score_1(coin, tmp_path):
    for task in coin.tasks("train")[:10] + coin.tasks("test")[:5]:
        record = coin.demonstrations([task], {}, str(tmp_path))[0]
        assert record["success"] and record["score"] == 1.0, (task, record["actions"])
        assert record["actions"][-1] == "take coin"
    cooking = TextWorldExpressEnv(game="cookingworld", game_params={"numLocations": 1, "numIngredients": 2,
                                                                   "numDistractorItems": 0, "includeDoors": 0},
                                  max_steps=40, num_train_seeds=3)
    try:
        for record in cooking.demonstrations(cooking.tasks("train"), {}, str(tmp_path)):
            assert record["success"] and record["score"] == 1.0 and record["actions"][-1] == "eat meal"
    finally:
        cooking.close()


def test_an_invalid_action_is_a_no_op(coin):
    task = coin.tasks("train")[5]
    observation, info = coin.reset(task)
    assert observation.startswith("Your task is to search the environment and find the coin.")
    assert info["admissible_actions"] == sorted(info["admissible_actions"]) and "look around" in info["admissible_actions"]
    for reply in ("fly to the moon", "", "move south"):  # seed 5's kitchen has no exit to the south
        obs, reward, terminated, truncated, step_info = coin.step(reply)
        assert step_info["valid_action"] is False and reward == 0.0 and not (terminated or truncated)
        assert step_info["score"] == 0.0 and step_info["steps"] == 1 + ("fly to the moon", "", "move south").index(reply)
    # nothing moved: the room is as it was
    assert coin.step("look around")[0] == observation.split("\n\n", 1)[1]
    obs, _, _, _, step_info = coin.step("<action>open door to east</action> then more")
    assert step_info["valid_action"] and step_info["action"] == "open door to east" and "pantry" in obs


def test_the_same_seed_gives_the_same_game_and_folds_do_not_overlap(coin):
    other = TextWorldExpressEnv(game_params=COIN, num_train_seeds=20, num_test_seeds=20)
    try:
        for task in (coin.tasks("train")[3], coin.tasks("test")[7]):
            assert coin.reset(task)[0] == other.reset(task)[0]
            for action in ("move west", "move east", "open door to north", "move north"):
                assert coin.step(action)[0] == other.step(action)[0]
        assert coin.reset(coin.tasks("train")[3])[0] != coin.reset(coin.tasks("train")[4])[0]
    finally:
        other.close()
    seeds = {split: {t["variation"] for t in coin.tasks(split)} for split in ("train", "dev", "test")}
    assert all(len(s) == 20 for s in seeds.values())
    assert not (seeds["train"] & seeds["test"]) and not (seeds["train"] & seeds["dev"]) and not (
        seeds["dev"] & seeds["test"])
    with pytest.raises(ValueError, match=r"variation=5: expected a seed of the test fold \(20000\.\.20999\)"):
        coin.reset({"task_name": "coin", "variation": 5, "fold": "test"})
    with pytest.raises(ValueError, match="game='zork'"):
        TextWorldExpressEnv(game="zork")


def test_gold_paths_are_the_same_in_every_run_and_explore_in_seeded_orders(coin):
    """The simulator draws its coin gold path at random on every call (an unseeded JVM generator): two JVMs must
    still demonstrate the same paths, or every machine builds another warm start."""
    tasks = coin.tasks("train")[:12]
    first = [r["actions"] for r in coin.demonstrations(tasks, {}, "unused")]
    other = TextWorldExpressEnv(game_params=COIN, max_steps=40, num_train_seeds=20)
    try:
        assert [r["actions"] for r in other.demonstrations(tasks, {}, "unused")] == first
        assert [coin.gold_actions(t) for t in tasks] == [other.gold_actions(t) for t in tasks]
    finally:
        other.close()
    # the exits are tried in an order drawn from the game's seed, not always the same direction first
    assert len({a for path in first for a in path[:1] if a.startswith(("move", "open"))}) >= 3
    # a room with no coin in sight is left again: the path shows each room it enters, then backs out of dead ends
    assert any("move east" in p and "move west" in p for p in first)


def test_the_gold_path_never_walks_into_a_room_it_can_see_it_has_seen():
    """In houses of 11 rooms the exits make cycles: the search looks at where an exit leads (through an open door,
    or once it has opened it) and does not go back into a room it has seen, so no loop is left to cut."""
    big = TextWorldExpressEnv(game_params={**COIN, "numLocations": 11}, max_steps=100, num_train_seeds=60)
    try:
        for task in big.tasks("train"):
            gold = big.gold_actions(task)
            assert replay(big, task, gold)["success"] and big.without_loops(task, gold) == gold, (task, gold)
    finally:
        big.close()


def test_reflection_records_go_right_and_wrong_and_tips_say_where_the_coin_was(coin, tmp_path):
    records = coin.reflection_records(coin.tasks("train")[:6], {}, str(tmp_path))
    assert [r["success"] for r in records] == [True, False] * 6
    assert all("take coin" not in r["actions"] for r in records[1::2])
    tips = [" ".join(textworld_express_tip(r)) for r in records]
    assert all(t.startswith("Score 1: worked.") for t in tips[::2])
    assert any(t.startswith("Score 0: I ran out of steps") and "go there and take coin" in t for t in tips[1::2])


def test_a_killed_jvm_is_restarted_by_the_pool():
    import psutil

    with EnvPool(CFG, num_workers=1, timeout_s=60) as pool:
        task = pool.tasks("test")[0]
        observation, info = pool.reset([(0, task)])[0]
        assert "error" not in info and "coin" in observation
        (jvm,) = [c for c in psutil.Process(pool.worker_pids[0]).children(recursive=True) if "java" in c.name()]
        os.kill(jvm.pid, signal.SIGKILL)
        jvm.wait(10)
        *_, info = pool.step([(0, "move west")])[0]
        assert "error" in info and info["valid_action"] is False  # the episode is lost, the worker rebuilt
        assert pool.num_restarts == 1
        observation, info = pool.reset([(0, task)])[0]
        assert "error" not in info and info["variation"] == 20000 and "coin" in observation


def test_coin_trajectories_replay_to_their_record(coin):
    task = coin.tasks("train")[2]
    record = replay(coin, task, ["look around", "inventory", "move east"])
    assert record["actions"] == ["look around", "inventory", "move east"] and record["admissible_actions"]


def test_loops_that_show_nothing_new_are_cut_also_back_to_the_start():
    """A path that steps back and forth between rooms already seen loops; a loop that shows nothing new is cut, also one
    that returns to the first room, and also where the path with the loop ran out of steps."""
    probe = TextWorldExpressEnv(game_params=COIN, max_steps=40)
    task = probe.tasks("train")[2]
    gold = probe.gold_actions(task)
    probe.close()
    looped = ["look around", "look around"] + gold  # a loop at the first room: nothing new seen
    env = TextWorldExpressEnv(game_params=COIN, max_steps=len(gold) + 1)
    try:
        assert not replay(env, task, looped)["success"]  # the loop costs the steps the coin needed
        cut = env.without_loops(task, looped)
        assert cut[-1] == "take coin" and replay(env, task, cut)["success"] and len(cut) <= len(gold) + 1
        assert "look around" not in cut[:1]
    finally:
        env.close()


@pytest.mark.parametrize("name,fold", [("num_train_seeds", "train"), ("num_test_seeds", "test")])
def test_more_seeds_than_a_fold_holds_is_refused_naming_that_fold(name, fold):
    with pytest.raises(ValueError, match=rf"{name}=1000000: the {fold} fold holds (\d+) seeds") as err:
        TextWorldExpressEnv(game_params=COIN, **{name: 1_000_000})
    # the size named is that fold's
    probe = TextWorldExpressEnv(game_params=COIN, num_train_seeds=1, num_test_seeds=1)
    try:
        size = {"train": len(probe._folds["train"]), "test": len(probe._folds["test"])}[fold]
    finally:
        probe.close()
    assert f"holds {size} seeds" in str(err.value)
