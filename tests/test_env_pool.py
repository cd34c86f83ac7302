"""EnvPool with real ScienceWorld workers: parallel == sequential, crash/hang recovery, request checks."""
from __future__ import annotations

import math
import os
import signal
import threading
import time

import pytest

from src.envs.pool import EnvPool
from src.envs.scienceworld import ScienceWorldEnv

FIND = "find-non-living-thing"
CFG = {"_target_": "src.envs.scienceworld.ScienceWorldEnv", "task": FIND}
TASKS = [{"task_name": FIND, "variation": 0}, {"task_name": FIND, "variation": 1}]
# Valid, invalid and ambiguous actions for both variations (variation 1 starts in the art studio).
SCRIPT = ["open door to kitchen", "go to kitchen", "look around", "look at door", "pick up chair", "xyzzy",
          "go to hallway", "look around"]


@pytest.fixture(scope="module")
def pool():
    with EnvPool(CFG, num_workers=2, timeout_s=60) as p:
        yield p


@pytest.fixture(scope="module")
def reference():
    """The same episodes run one after the other in a single in-process environment."""
    env = ScienceWorldEnv(FIND)
    runs = []
    for task in TASKS:
        runs.append([env.reset(task)] + [env.step(a) for a in SCRIPT])
    env.close()
    return runs, env.system_prompt


def test_parallel_workers_match_sequential_env(pool, reference):
    got = [[r] for r in pool.reset(list(enumerate(TASKS)))]
    for action in SCRIPT:
        for run, result in zip(got, pool.step([(0, action), (1, action)])):
            run.append(result)
    runs, system_prompt = reference
    assert got == runs
    assert pool.system_prompt == system_prompt
    assert pool.tasks("train") == [{"task_name": FIND, "variation": v} for v in range(5)]


def _wait_until_dead(pid: int, timeout_s: float = 30.0) -> None:
    """Until the process has exited (a zombie or gone): its end of the pipe is closed then."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.01)
    raise TimeoutError(f"process {pid} still running after SIGKILL")


@pytest.mark.parametrize("when", ["before_the_call", "during_the_call"])
def test_killed_worker_gives_error_result_and_restarts(pool, reference, when):
    """Whether the worker is already gone when the step is sent (the send fails) or dies while the step runs (the
    answer never comes), the result is the same: an error result for its episode and a restarted worker."""
    pool.reset(list(enumerate(TASKS)))
    restarts, old_pid = pool.num_restarts, pool.worker_pids[0]
    if when == "before_the_call":
        os.kill(old_pid, signal.SIGKILL)
        _wait_until_dead(old_pid)
    else:  # stopped, so it cannot answer before it is killed half a second into the call
        os.kill(old_pid, signal.SIGSTOP)
        threading.Timer(0.5, os.kill, (old_pid, signal.SIGKILL)).start()
    (obs0, r0, term0, trunc0, info0), second = pool.step([(0, "look around"), (1, SCRIPT[0])])
    # what run_episodes acts on: an "error" entry marks the episode failed (NaN reward, terminated)
    assert isinstance(info0["error"], str) and info0["error"] and info0["worker"] == 0
    assert obs0 == "" and math.isnan(r0) and term0 and not trunc0 and not info0["success"]
    runs, _ = reference
    assert second == runs[1][1]  # the other worker is unaffected
    assert pool.num_restarts == restarts + 1 and pool.worker_pids[0] != old_pid
    # The restarted worker's start-up (seconds: process and JVM) does not count against the next call's timeout.
    pool.timeout_s = 1.0
    try:
        assert pool.tasks("train") == [{"task_name": FIND, "variation": v} for v in range(5)]
    finally:
        pool.timeout_s = 60.0
    assert pool.reset([(0, TASKS[0])]) == [runs[0][0]]  # the restarted worker serves the next episode


def test_hung_worker_times_out_and_restarts(pool, reference):
    pool.reset([(1, TASKS[1])])
    old_pid, pool.timeout_s = pool.worker_pids[1], 2.0
    try:
        os.kill(old_pid, signal.SIGSTOP)
        (obs, reward, terminated, _, info), = pool.step([(1, "look around")])
    finally:
        pool.timeout_s = 60.0
    assert obs == "" and math.isnan(reward) and terminated and "no answer" in info["error"]
    assert pool.worker_pids[1] != old_pid
    assert pool.reset([(1, TASKS[1])]) == [reference[0][1][0]]


def test_hung_worker_read_first_fails_only_its_episode():
    """A worker hung in ``step`` and read first: the others, which answered at once, keep their results and
    their processes; only the hung one is timed out and restarted (issue 59)."""
    cfg = {"_target_": "stub_envs.HangingStubEnv", "num_tasks": 4, "hang_variation": 0, "hang_s": 60}
    with EnvPool(cfg, num_workers=4, timeout_s=2.0) as pool:
        pool.reset([(i, {"task_name": "stub", "variation": i}) for i in range(4)])
        pids, restarts = pool.worker_pids, pool.num_restarts
        results = pool.step([(i, "wait") for i in range(4)])  # worker 0 (hung) is the first one read
        assert pool.num_restarts == restarts + 1
        assert pool.worker_pids[0] != pids[0] and pool.worker_pids[1:] == pids[1:]
    assert "no answer" in results[0][4]["error"] and math.isnan(results[0][1])
    for i, (obs, reward, _, _, info) in enumerate(results[1:], 1):
        assert "error" not in info and (obs, reward) == (f"Variation {i}, step 1.", 0.0)


def test_bad_requests(pool):
    with pytest.raises(ValueError, match="worker indices"):
        pool.step([(2, "look around")])
    with pytest.raises(ValueError, match="once per call"):
        pool.step([(0, "look around"), (0, "look around")])
    restarts = pool.num_restarts
    # The environment refusing an episode's input fails that episode only (never the run); the worker is kept.
    (obs, info), = pool.reset([(0, {"task_name": "bogus", "variation": 0})])
    assert obs == "" and "ValueError: Unknown ScienceWorld task" in info["error"]
    assert pool.num_restarts == restarts
    with pytest.raises(ValueError, match="EnvPool.tasks: worker 0: ValueError"):  # a caller mistake is raised
        pool.tasks("bogus-split")
    assert pool.step([]) == []


def test_resize_and_construction_errors(pool):
    pool.resize(3)
    assert pool.num_workers == 3
    obs, info = pool.reset([(2, TASKS[0])])[0]
    assert info["task_id"] == FIND and "error" not in info
    pool.resize(2)
    assert pool.num_workers == 2
    with pytest.raises(RuntimeError, match="Unknown ScienceWorld task 'bogus'"):
        EnvPool({**CFG, "task": "bogus"}, num_workers=1)
    with pytest.raises(ValueError, match="_target_"):
        EnvPool({"task": FIND}, num_workers=1)


@pytest.mark.parametrize("game", ["coin", "webshop"])
def test_an_environment_refusing_its_settings_is_answered_in_one_line(tmp_path, game):
    """What only the simulator or the data can tell (a Coin Collector game setting, a malformed WebShop file) stops
    the pool with the environment's own line, not the worker's chained tracebacks; other failures keep theirs."""
    from src.utils.config_error import RunError

    if game == "coin":
        cfg = {"_target_": "src.envs.textworld_express.TextWorldExpressEnv",
               "game_params": {"numLocations": 50, "includeDoors": 1, "numDistractorItems": 0}}
        message = (r"worker 0 could not build its environment \(src.envs.textworld_express.TextWorldExpressEnv\): "
                   r"env.game_params=.*'numLocations': 50.*the simulator says Number of locations must be less than "
                   r"or equal to 11")
    else:
        for name, text in (("items_shuffle.json", '{"broken": '), ("items_ins_v2.json", "{}"),
                           ("items_human_ins.json", "{}")):
            (tmp_path / name).write_text(text)
        cfg = {"_target_": "src.envs.webshop.WebShopEnv", "real_data_dir": str(tmp_path)}
        message = rf"env.real_data_dir='{tmp_path}': items_shuffle.json: not valid JSON \(Expecting value"
    with pytest.raises(RunError, match=message) as err:
        EnvPool(cfg, num_workers=2)
    assert "\n" not in str(err.value) and "Traceback" not in str(err.value) and err.value.__cause__ is None
