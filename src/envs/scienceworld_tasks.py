"""ScienceWorld's 30 tasks by name, alphabetical index and paper id, their action caps and the checks of the
settings that need no simulator (``settings_problems``); docs/environments.md#scienceworld.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from scienceworld.constants import ID2TASK

from src.envs.base import count_problem

# Paper ids ("4-2") -> task names, from the table the package ships (scienceworld/tasks.json, the numbering of
# the ScienceWorld paper, Wang et al. 2022, Table 1).
PAPER_IDS: dict[str, str] = dict(ID2TASK)
# Alphabetical order of the 30 names: the integer task index ``env.task`` accepts (power-component = 25). The
# simulator's getTaskNames() returns the same 30 names (checked in tests/test_scienceworld.py), so names can be
# resolved before any JVM starts.
TASK_NAMES: tuple[str, ...] = tuple(sorted(ID2TASK.values()))

# Max actions per episode (after the paper; docs/environments.md#scienceworld): 30, with longer caps for the long tasks.
DEFAULT_MAX_STEPS = 30
MAX_STEPS_OVERRIDES: dict[str, int] = {
    "chemistry-mix": 60,
    "chemistry-mix-paint-secondary-color": 60,
    "chemistry-mix-paint-tertiary-color": 60,
    "measure-melting-point-known-substance": 120,
    "boil": 100,
    "melt": 80,
    "freeze": 80,
}


def resolve_task(task: str | int) -> str:
    """Map a task given as alphabetical index (int or digit string, 0..29), paper id ("3-1") or name to its name.
    Raises ValueError naming the bad value and listing the valid names (with index and paper id)."""
    if isinstance(task, bool):  # bool is an int subclass; True would silently mean task 1
        raise ValueError(_unknown_task_message(task))
    if isinstance(task, int) or (isinstance(task, str) and task.strip().isdigit()):
        idx = int(task)
        if 0 <= idx < len(TASK_NAMES):
            return TASK_NAMES[idx]
        raise ValueError(_unknown_task_message(task))
    if isinstance(task, str):
        key = task.strip()
        if key in PAPER_IDS:
            return PAPER_IDS[key]
        if key in TASK_NAMES:
            return key
    raise ValueError(_unknown_task_message(task))


def _unknown_task_message(task: Any) -> str:
    paper_of = {name: pid for pid, name in PAPER_IDS.items()}
    listing = ", ".join(f"{i}={name} ({paper_of[name]})" for i, name in enumerate(TASK_NAMES))
    return (f"Unknown ScienceWorld task {task!r}: expected an alphabetical index 0..{len(TASK_NAMES) - 1}, "
            f"a paper id like '3-1', or one of the names. Valid tasks: {listing}")


def default_max_steps(task_name: str) -> int:
    """Per-task action cap (``MAX_STEPS_OVERRIDES``, else ``DEFAULT_MAX_STEPS``) for a resolved task name."""
    return MAX_STEPS_OVERRIDES.get(task_name, DEFAULT_MAX_STEPS)


def task_list(task: Any) -> list[Any]:
    """``env.task`` as a list: one task, or any sequence (list, tuple, OmegaConf's ListConfig). Raises ValueError
    for neither (e.g. null or a float)."""
    if isinstance(task, (str, int)):
        return [task]
    if isinstance(task, Sequence):
        return list(task)
    raise ValueError(f"env.task={task!r}: expected a task (a name, a paper id like '4-2' or an index) or a list of "
                     "them")


def settings_problems(env_cfg: dict[str, Any], training: bool = False) -> list[str]:
    """What ``ScienceWorldEnv`` cannot run in ``env_cfg`` (every key: ``Environment.with_defaults``) without asking
    the simulator: the task list, the variation counts (training needs a training variation), the action cap and the
    correction threshold, one line per bad ``env.<key>``."""
    problems = []
    try:
        tasks = task_list(env_cfg["task"])
    except ValueError as err:
        problems, tasks = [str(err)], None
    if tasks == []:
        problems.append("env.task=[]: expected a task or a list of tasks (a name, a paper id like '4-2' or an "
                        "index)")
    for task in tasks or []:
        try:
            resolve_task(task)
        except ValueError as err:
            problems.append(f"env.task={task!r}: {err}")
    problems += count_problem("num_train_variations", env_cfg["num_train_variations"], int(training),
                              "training variations per task")
    problems += count_problem("num_test_variations", env_cfg["num_test_variations"], 0,
                              "held-out variations per task")
    problems += count_problem("max_steps", env_cfg["max_steps"], 1, "actions per episode; null: the per-task cap",
                              allow_none=True)
    similarity = env_cfg["correction_min_similarity"]
    if isinstance(similarity, bool) or not isinstance(similarity, (int, float)) or not 0 <= similarity <= 100:
        problems.append(f"env.correction_min_similarity={similarity!r}: expected a number in 0..100 (the thefuzz "
                        "ratio a corrected action needs)")
    return problems
