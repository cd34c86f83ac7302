"""ScienceWorld's demonstrations (gold paths) and hindsight tips for the imitation warm start (``ScienceWorldEnv``'s
``Environment`` hooks; docs/usage.md#imitation-warm-start)."""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from src.envs.base import environment_class, replay
from src.envs.scienceworld_tasks import resolve_task
from src.utils.io import json_digest, write_json_atomic

log = logging.getLogger(__name__)

GOLD_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cache_gold_trajectories.py"
SCIENCEWORLD_WASTE = ("look around", "inventory")  # actions that show but never change the state


def gold_file(out_dir: str | os.PathLike, task: str | int) -> Path:
    """Path of a task's gold cache: ``<out_dir>/<task_name>.json``."""
    return Path(out_dir) / f"{resolve_task(task)}.json"


def load_gold(task: str | int, out_dir: str | os.PathLike = "data/scienceworld_gold",
              simplification: str = "easy") -> dict[int, dict[str, Any]]:
    """Read a task's cached gold trajectories: ``{variation: record}`` (record as in ``generate_gold``). Raises
    FileNotFoundError (saying how to create the cache) or ValueError on a simplification mismatch."""
    path = gold_file(out_dir, task)
    if not path.exists():
        raise FileNotFoundError(f"No gold trajectories at {path}; create them with "
                                f"`python scripts/cache_gold_trajectories.py --task {resolve_task(task)} "
                                f"--out-dir {out_dir}`")
    data = json.loads(path.read_text())
    if data.get("simplification") != simplification:
        raise ValueError(f"{path} holds simplification {data.get('simplification')!r}, expected "
                         f"{simplification!r}")
    return {int(v): rec for v, rec in data["variations"].items()}


def ensure_gold(tasks: list[dict[str, Any]], gold_dir: str | os.PathLike, simplification: str = "easy",
                jvm_heap: str = "768m", timeout_s: float = 1800.0) -> list[dict[str, Any]]:
    """Gold records (``generate_gold`` format) of every ``{"task_name", "variation"}`` in ``tasks``, in order; those
    missing from the cache ``<gold_dir>/<task>.json`` are generated into it by ``GOLD_SCRIPT`` in a subprocess.

    Raises:
        ValueError: the cache holds another simplification, or a bad task name.
        RuntimeError: the script failed (its stderr is in the message) or did not write a requested variation.
    """
    names = [resolve_task(t["task_name"]) for t in tasks]
    wanted: dict[str, list[int]] = {}
    for name, task in zip(names, tasks):
        wanted.setdefault(name, []).append(int(task["variation"]))
    cache: dict[str, dict[int, dict[str, Any]]] = {}
    for name, variations in wanted.items():
        try:
            have = load_gold(name, gold_dir, simplification)
        except FileNotFoundError:
            have = {}
        missing = [v for v in dict.fromkeys(variations) if v not in have]
        if missing:
            log.info("Generating gold trajectories of %s variations %s into %s (subprocess)", name, missing, gold_dir)
            cmd = [sys.executable, str(GOLD_SCRIPT), "--task", name, "--variations", *map(str, missing),
                   "--simplification", simplification, "--out-dir", str(gold_dir), "--jvm-heap", str(jvm_heap)]
            returncode, output = _run_logged(cmd, timeout_s)
            # Exit 1 = some paths did not replay to success; they are cached with success False and skipped later.
            if returncode not in (0, 1):
                raise RuntimeError(f"{' '.join(cmd)} exited with {returncode}:\n{output[-4000:]}")
            have = load_gold(name, gold_dir, simplification)
            still = [v for v in missing if v not in have]
            if still:
                raise RuntimeError(f"gold script did not write {name} variations {still} to {gold_dir}:\n"
                                   f"{output[-4000:]}")
        cache[name] = have
    return [cache[name][int(task["variation"])] for name, task in zip(names, tasks)]


def env_gold(tasks: list[dict[str, Any]], env_cfg: dict[str, Any], gold_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """``ensure_gold`` of ``tasks`` with the simplification and JVM heap of the environment config ``env_cfg``."""
    env_cfg = environment_class(env_cfg).with_defaults(env_cfg)
    return ensure_gold(tasks, gold_dir, env_cfg["simplification"], env_cfg["jvm_heap"])


def _run_logged(cmd: list[str], timeout_s: float) -> tuple[int, str]:
    """Run ``cmd``, logging each line it prints; returns (exit code, everything it printed). Raises
    subprocess.TimeoutExpired (after killing it) when still running after ``timeout_s``."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            lines.append(line)
            log.info("[gold] %s", line.rstrip())
            if time.monotonic() > deadline:
                proc.kill()
                raise subprocess.TimeoutExpired(cmd, timeout_s, output="".join(lines))
        proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
    return proc.returncode, "".join(lines)


def gold_records(tasks: list[dict[str, Any]], env_cfg: dict[str, Any], gold_dir: str | os.PathLike) -> list[dict]:
    """Demonstration records of ScienceWorld ``tasks`` from their gold paths, cut to the action cap (later states
    never occur in RL). Raises ValueError when prompts list admissible actions (the gold cache does not store them)."""
    from src.envs.scienceworld_tasks import default_max_steps

    if env_cfg.get("include_admissible_actions"):
        raise ValueError("env.include_admissible_actions=true puts the valid-action list in every prompt, which "
                         "the gold cache does not store; demonstration prompts could not match the RL prompts")
    records = env_gold(tasks, env_cfg, gold_dir)
    out = []
    for task, record in zip(tasks, records):
        cap = env_cfg.get("max_steps") or default_max_steps(record["task_name"])
        # The replay stops at termination, so only actions with an observation were executed.
        n = min(len(record["observations"]), cap)
        out.append({"task": task, "instruction": record["instruction"],
                    "initial_observation": record["initial_observation"], "actions": record["actions"][:n],
                    "observations": record["observations"][:n], "success": bool(record["success"]),
                    "score": float(record["final_score"])})
    return out


def _arg(action: str, verb: str) -> str | None:
    return action[len(verb):].strip() if action.startswith(verb) else None


def scienceworld_tip(record: dict[str, Any]) -> list[str]:
    """The hindsight tip on a ScienceWorld trajectory: rooms gone to, the object focused on, actions that changed
    something, needless looks (no move since the last one) counted, and what is left to do from the instruction."""
    actions, score, top = record["actions"], float(record["score"]), float(record.get("max_score", 100.0))
    waste, moved = 0, False
    for a in actions:
        if a in SCIENCEWORLD_WASTE:
            waste += 0 if moved else 1
            moved = False
        elif a.startswith(("go to", "teleport to")):
            moved = True
    key = [a for a in actions if a not in SCIENCEWORLD_WASTE and not a.startswith(("open door", "close door"))]
    focus = next((_arg(a, "focus on") for a in actions if a.startswith("focus on")), None)
    if score >= top:
        return [f"Score {score:g}: worked. {'; '.join(key)}.", "Repeat it with no extra look around."]
    if score < 0 and focus:
        return [f"Score {score:g}: focusing on the {focus} ended the episode, the wrong object.",
                "Next time focus only on an object that fits the task."]
    instruction = record["instruction"]
    thing = re.search(r"find an? ?(?:\(n\) )?([\w -]+?)\.", instruction)
    box = re.search(r"move it to (the [\w ]+?)(?: in the ([\w ]+))?\.", instruction)
    start = re.search(r"This room is called the ([\w ]+?)\.", record["initial_observation"])
    rooms = [start.group(1)] if start else []
    rooms += [_arg(a, "go to") or _arg(a, "teleport to") for a in actions if a.startswith(("go to", "teleport to"))]
    todo = []
    if box and box.group(2) and (not rooms or rooms[-1] != box.group(2)):
        todo.append(f"go straight to the {box.group(2)}")
    if not focus:
        todo.append(f"focus on a {thing.group(1)}" if thing else "focus on the object the task names")
    if box and not any(a.startswith("move") for a in actions):
        todo.append(f"move it to {box.group(1)}")
    return [f"Score {score:g}: I ran out of steps after {len(actions)} actions"
            + (f", {waste} of them needless look around" if waste else "") + ".",
            "Next time " + ("skip look around, " if waste else "") + ", then ".join(todo or ["finish in fewer steps"])
            + ".", f"Done: {'; '.join(key)}." if key else "Nothing done."]


def scienceworld_records(env, tasks: list[dict[str, Any]], gold: list[dict[str, Any]]) -> list[dict]:
    """Per training variation two trajectories replayed in ``env`` under its step cap: the gold path, and the gold
    path after needless ``look around`` steps (as many as push it past the cap, at least one), so some go right and
    some run out of steps."""
    out = []
    for task, record in zip(tasks, gold):
        cap = env.max_steps or 30
        extra = max(1, cap - len(record["actions"]) + 1)
        for actions in (record["actions"], ["look around"] * extra + record["actions"]):
            out.append(replay(env, task, actions))
    return out


def cached_replays(env, env_cfg: dict[str, Any], tasks: list[dict[str, Any]], gold: list[dict[str, Any]],
                    gold_dir: str) -> list[dict]:
    """``scienceworld_records``, cached in ``gold_dir`` on first use: the simulator lists a room's objects in an order
    that changes from one JVM to the next, so only cached replays are the same in every run."""
    settings = {k: env_cfg.get(k) for k in ("task", "simplification", "action_correction")}
    key = json_digest([settings, env.max_steps, tasks, [r["actions"] for r in gold]])
    path = Path(gold_dir) / f"reflection_replays-{key}.json"
    if path.exists():
        return json.loads(path.read_text())
    records = scienceworld_records(env, tasks, gold)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, records, default=str)
    return json.loads(path.read_text())  # the same JSON types whether just written or read later
