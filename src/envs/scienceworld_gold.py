"""ScienceWorld gold trajectories: generated from the simulator, verified by replay, cached as JSON
(``scripts/cache_gold_trajectories.py``); the imitation warm start's demonstrations come from this cache."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from src.envs.base import close_jvm
from src.envs.scienceworld import ScienceWorldEnv, start_jvm
from src.envs.scienceworld_demos import gold_file, load_gold  # noqa: F401 - load_gold is re-exported
from src.envs.scienceworld_tasks import resolve_task
from src.utils.io import write_json_atomic
from src.utils.timing import EtaLog

logger = logging.getLogger(__name__)


def generate_gold(tasks: list[dict[str, Any]], simplification: str = "easy",
                  jvm_heap: str = "768m") -> list[dict[str, Any]]:
    """Generate and verify the simulator's gold action path for each ``{"task_name", "variation"}`` in ``tasks``:
    one JVM asks for the paths (which slows its later resets: run this offline), another replays each through
    ``ScienceWorldEnv`` (no cap) to record what an agent sees. The simulator picks among equivalent paths at random.

    Returns one record per task, in order: {task_name, variation, simplification, instruction,
    initial_observation, initial_score, actions: [str], observations: [str], rewards: [points],
    scores: [points], final_score, success, num_steps}. Paths that do not replay to success are kept with
    ``success`` False (and logged).
    """
    names = [resolve_task(t["task_name"]) for t in tasks]
    generator = start_jvm(jvm_heap)
    replay = None
    records: list[dict[str, Any]] = []
    progress = EtaLog(logger, "gold paths", len(tasks), every_s=5.0)
    try:
        if tasks:
            replay = ScienceWorldEnv(names, simplification=simplification, num_train_variations=0,
                                     num_test_variations=0, max_steps=10**9, jvm_heap=jvm_heap)
        for name, task in zip(names, tasks):
            variation = int(task["variation"])
            generator.load(name, variation, simplification, generateGoldPath=True)
            actions = [str(a) for a in generator.server.getGoldActionSequence()]
            observation, info = replay.reset({"task_name": name, "variation": variation})
            record: dict[str, Any] = {
                "task_name": name, "variation": variation, "simplification": simplification,
                "instruction": info["instruction"], "initial_observation": observation,
                "initial_score": info["score"], "actions": actions, "observations": [], "rewards": [],
                "scores": [], "final_score": info["score"], "success": False, "num_steps": len(actions)}
            for action in actions:
                observation, reward, terminated, _, info = replay.step(action)
                record["observations"].append(observation)
                record["rewards"].append(reward)
                record["scores"].append(info["score"])
                record["final_score"], record["success"] = info["score"], info["success"]
                if terminated:
                    break
            if not record["success"]:
                logger.warning("gold path of %s variation %s replays to score %s without success",
                               name, variation, record["final_score"])
            records.append(record)
            progress.step(detail=f"{name} variation {variation}: {len(record['observations'])} actions")
    finally:
        if replay is not None:
            replay.close()
        close_jvm(generator, "gold")
    return records


def save_gold(out_dir: str | os.PathLike, records: list[dict[str, Any]]) -> list[Path]:
    """Merge gold records (from ``generate_gold``) into ``<out_dir>/<task_name>.json``, written atomically as
    {"task_name", "simplification", "variations": {"<variation>": record}}. Returns the paths written. Raises
    ValueError if a file holds another simplification."""
    by_task: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_task.setdefault(record["task_name"], []).append(record)
    paths = []
    for name, task_records in by_task.items():
        simplification = task_records[0]["simplification"]
        if any(r["simplification"] != simplification for r in task_records):
            raise ValueError(f"gold records of {name!r} mix simplifications; save them to separate directories")
        path = gold_file(out_dir, name)
        data: dict[str, Any] = {"task_name": name, "simplification": simplification, "variations": {}}
        if path.exists():
            existing = json.loads(path.read_text())
            if existing.get("simplification") != simplification:
                raise ValueError(f"{path} holds simplification {existing.get('simplification')!r}, not "
                                 f"{simplification!r}; use another output directory")
            data["variations"].update(existing.get("variations", {}))
        data["variations"].update({str(r["variation"]): r for r in task_records})
        data["variations"] = dict(sorted(data["variations"].items(), key=lambda kv: int(kv[0])))
        write_json_atomic(path, data, indent=1)
        paths.append(path)
    return paths
