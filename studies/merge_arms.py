"""Add the arms of one adaptation summary to another (``scripts/merge_adaptation.py``).

An adaptation run with four arms on WebShop takes hours on a CPU; the arms can run in separate evaluations
(``eval.own_tips=false`` leaves the own-tips arm out) and be merged here. The merge is valid only when both runs
are the same evaluation: the same policy weights, tasks, seeds, trials and temperature, and therefore the same
sampling streams — checked on the episodes themselves: every arm's trial 0 (no tips shown) must be the same
episodes, action by action, as the base's. The paired differences to the memory-off control are then recomputed
from the episode rows (``paired_vs_control``), as one run would have computed them.
"""
from __future__ import annotations

import copy
import json
from typing import Any

from src.evaluation.protocols import paired_vs_control

# the settings that make two adaptation summaries the same evaluation (the weights' hash names the policy)
SAME_EVALUATION = ("protocol", "model", "env", "task", "split", "num_tasks", "episodes_per_task", "seeds",
                   "temperature", "precision", "trials_k", "weights_sha256")
# the summary keys that belong to an arm, besides its ``episode_rows``
_ARM_KEYS = {"memory": ("trials", "best_trial", "best_score", "best_absolute_gain", "best_relative_gain",
                        "reflections"),
             "control": ("control_trials",)}


def _keyed(rows: list[dict]) -> dict[str, tuple]:
    return {json.dumps([r["seed"], r["task"], r["episode"]], sort_keys=True):
            (r["actions"], r["score"], r["success"], r["failed"]) for r in rows}


def _first_difference(a: list[dict], b: list[dict]) -> str | None:
    ka, kb = _keyed(a), _keyed(b)
    if ka.keys() != kb.keys():
        return f"episodes {sorted(ka.keys() ^ kb.keys())[:3]} are in one run only"
    for key in ka:
        if ka[key] != kb[key]:
            return f"episode {key}: {ka[key][:2]} against {kb[key][:2]} (actions, score)"
    return None


def merge_arms(base: dict[str, Any], extra: dict[str, Any], base_name: str = "base",
               extra_name: str = "extra") -> dict[str, Any]:
    """``base`` with the arms of ``extra`` it lacks, and ``paired_vs_off`` (and ``paired`` for the own tips)
    recomputed against the control.

    Args:
        base, extra: adaptation summaries (``src/eval.py eval.protocol=adaptation``'s ``eval.summary_file``).
        base_name, extra_name: how errors name them (e.g. their paths).

    Returns:
        A new summary in the format of one run with all arms, plus ``merged_from: [base_name, extra_name]`` and
        ``rollout_s`` summed.

    Raises:
        ValueError: the runs are not the same evaluation (a setting of ``SAME_EVALUATION`` differs, or a trial 0
            is other episodes: other sampling streams), an arm both hold differs, or ``extra`` adds no arm.
    """
    for key in SAME_EVALUATION:
        if base.get(key) != extra.get(key):
            raise ValueError(f"{key}: {base_name} has {base.get(key)!r}, {extra_name} {extra.get(key)!r}: not the "
                             "same evaluation, so their episodes do not pair")
    if base.get("protocol") != "adaptation":
        raise ValueError(f"{base_name}: protocol {base.get('protocol')!r}, expected 'adaptation'")
    rows_a, rows_b = base["episode_rows"], extra["episode_rows"]
    added = [arm for arm in rows_b if arm not in rows_a]
    if not added:
        raise ValueError(f"{extra_name} has no arm that {base_name} lacks (arms: {sorted(rows_b)})")
    reference = "control" if "control" in rows_a else next(iter(rows_a))
    for arm, runs in rows_b.items():  # trial 0 shows no tips: the same streams give the same episodes in every arm
        difference = _first_difference(runs[0], rows_a[reference][0])
        if difference:
            raise ValueError(f"trial 0 of {extra_name}'s {arm} arm is not {base_name}'s ({reference} arm): "
                             f"{difference}; the runs drew other sampling streams, so their arms do not pair")
    for arm in set(rows_a) & set(rows_b):
        for trial, (a, b) in enumerate(zip(rows_a[arm], rows_b[arm])):
            difference = _first_difference(a, b)
            if difference:
                raise ValueError(f"the {arm} arm differs between {base_name} and {extra_name} at trial {trial}: "
                                 f"{difference}")

    merged = copy.deepcopy(base)
    for arm in added:
        merged["episode_rows"][arm] = copy.deepcopy(rows_b[arm])
        for key in _ARM_KEYS.get(arm, (f"{arm}_trials",)):
            if key in extra:
                merged[key] = copy.deepcopy(extra[key])
    merged.update(paired_vs_control(merged["episode_rows"]))
    merged["rollout_s"] = float(base.get("rollout_s", 0.0)) + float(extra.get("rollout_s", 0.0))
    merged["merged_from"] = [base_name, extra_name]
    return merged
