"""The evaluation protocols (``eval.protocol``): ``standard`` and ``adaptation`` (see ``src/eval.py``).

Both run their episodes through ``src.data.rollout.evaluate``, the code of in-training validation.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import replace
from typing import Any, Sequence

from omegaconf import DictConfig

from src.evaluation.stats import best_relative_gain, episode_summary

log = logging.getLogger(__name__)

PROTOCOLS = ("standard", "adaptation")


def check_eval_config(ev: DictConfig | dict) -> None:
    """Validate the ``eval`` group before anything heavy is built.

    Raises:
        ValueError: an unknown protocol, empty or non-integer seeds, counts below 1, or a memory file with the
            adaptation protocol — naming the bad value.
    """
    protocol = ev.get("protocol")
    if protocol not in PROTOCOLS:
        raise ValueError(f"eval.protocol={protocol!r}: expected one of {PROTOCOLS}")
    seeds = ev.get("seeds")
    if isinstance(seeds, (str, bytes)) or not isinstance(seeds, Sequence) or not seeds \
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise ValueError(f"eval.seeds={seeds!r}: expected a non-empty list of ints, e.g. [0, 1, 2]")
    for name in ("control", "own_tips", "oracle_tips", "empty_tips"):
        if not isinstance(ev.get(name, False), bool):
            raise ValueError(f"eval.{name}={ev.get(name)!r}: expected true or false")
    if ev.get("own_tips", True) is False and not any(ev.get(k) for k in ("control", "oracle_tips", "empty_tips")):
        raise ValueError("eval.own_tips=false with no other arm: set eval.control, eval.oracle_tips or "
                         "eval.empty_tips to true (the adaptation protocol needs an arm to run)")
    for name in ("episodes_per_task", "trials") + (("num_tasks",) if ev.get("num_tasks") is not None else ()):
        value = ev.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"eval.{name}={value!r}: expected an int >= 1")
    if not float(ev.get("temperature")) > 0:
        raise ValueError(f"eval.temperature={ev.get('temperature')!r}: expected > 0 (sampling)")
    for name in ("oracle_tips", "empty_tips"):
        if ev.get(name) and protocol != "adaptation":
            raise ValueError(f"eval.{name}=true with eval.protocol={protocol!r}: the diagnostic arms belong to the "
                             "adaptation protocol (eval.protocol=adaptation)")
    if ev.get("memory_file") and protocol == "adaptation":
        raise ValueError(f"eval.memory_file={ev.get('memory_file')!r} with eval.protocol=adaptation: the adaptation "
                         "protocol starts from an empty memory; set eval.memory_file=null or eval.protocol=standard")


def run_standard(cfg, b, pool, tasks, memory, write_tips: bool) -> dict[str, Any]:
    import lightning as L

    from src.data.rollout import evaluate, inference

    ev, policy, max_steps = cfg.eval, b["module"].policy, b["max_steps"]
    rollout_cfg = replace(b["rollout"], use_tips=memory is not None, temperature=float(ev.temperature))
    start_state = memory.state_dict() if memory is not None else None
    all_episodes, per_seed, rollout_s, rows = [], [], 0.0, []
    for seed in ev.seeds:
        L.seed_everything(seed, verbose=False)
        if memory is None:
            metrics, episodes = evaluate(pool, policy, tasks, int(ev.episodes_per_task), rollout_cfg, max_steps,
                                         return_episodes=True)
            rollout_s += metrics["rollout_s"]
        else:
            memory.load_state_dict(start_state)
            episodes = []
            for _ in range(int(ev.episodes_per_task)):  # rounds: one episode per task, then its tips
                metrics, round_episodes = evaluate(pool, policy, tasks, 1, rollout_cfg, max_steps, memory,
                                                   return_episodes=True)
                rollout_s += metrics["rollout_s"]
                if write_tips:
                    with inference(policy):
                        memory.write_tips(round_episodes, policy, pool.system_prompt)
                episodes += round_episodes
        seed_summary = episode_summary(episodes)
        per_seed.append({"seed": seed, "score": seed_summary["score"]["mean"],
                         "success_rate": seed_summary["success_rate"]["mean"], "episodes": len(episodes)})
        log.info("seed %d: score %s, success rate %s", seed, per_seed[-1]["score"], per_seed[-1]["success_rate"])
        all_episodes += episodes
        rows += [_episode_row(seed, e) for e in episodes]
    # every episode, so paired differences between two policies on the same tasks and seeds can be recomputed
    return {**episode_summary(all_episodes), "per_seed": per_seed, "rollout_s": rollout_s, "episode_rows": rows}


def run_adaptation(cfg, b, pool, tasks, memory, fixed_arms: dict[str, Any] | None = None) -> dict[str, Any]:
    """The adaptation protocol (docs/evaluation.md#the-adaptation-protocol): per seed, trial 0 without tips, then
    trials 1..K with tips retrieved from the reflections of the earlier trials, the policy's weights fixed.

    With ``eval.control`` the same trials also run with the memory off, so retries alone are not mistaken for
    memory. Trial k of every arm draws its tokens from the same per-episode streams, so trial 0 is the same episodes
    in all arms and a later trial differs only by the tips shown. Returns the memory arm's per-trial rows
    (``trials``), the control's (``control_trials``), the paired difference memory − control per trial (``paired``,
    ``paired_vs_control``) and the reflections written.

    ``fixed_arms`` (``{"oracle": FixedTips, "empty": FixedTips}``) show their fixed lines from trial 1 on and write
    nothing; each adds ``<arm>_trials``. ``eval.own_tips=false`` leaves the own-tips arm out (no ``trials``,
    ``best_*``, ``reflections``, ``paired``), e.g. to add arms to an earlier summary (``scripts/merge_adaptation.py``).
    """
    import lightning as L

    from src.data.rollout import evaluate, inference
    from src.utils.rng import REFLECTION, VALIDATION, stream_seed

    ev, policy = cfg.eval, b["module"].policy
    trials, n = int(ev.trials), int(ev.episodes_per_task)
    empty = memory.state_dict()
    arms = {**({"memory": memory} if ev.get("own_tips", True) else {}),
            **({"control": None} if ev.get("control") else {}), **(fixed_arms or {})}
    per_trial = {arm: [[] for _ in range(trials + 1)] for arm in arms}
    memory_sizes: list[list[int]] = [[] for _ in range(trials + 1)]
    tip_action = [[] for _ in range(trials + 1)]
    reflections, rollout_s = [], 0.0
    for seed in ev.seeds:
        for arm, mem in arms.items():
            own = arm == "memory"  # the policy's own tips: written after every trial; the fixed arms write none
            L.seed_everything(seed, verbose=False)
            if own:
                mem.load_state_dict(empty)
            for trial in range(trials + 1):
                rollout_cfg = replace(b["rollout"], use_tips=mem is not None and trial > 0,
                                      temperature=float(ev.temperature),
                                      sample_seed=stream_seed(seed, trial, VALIDATION),
                                      keep_reflection_prefix=own and mem.reuse_rollout_cache)
                # trial 0 passes the memory too (no retrieval): its states are embedded so its tips can be written
                metrics, episodes = evaluate(pool, policy, tasks, n, rollout_cfg, b["max_steps"], mem,
                                             return_episodes=True)
                rollout_s += metrics["rollout_s"]
                if own:
                    memory_sizes[trial].append(len(mem.tips))
                    with inference(policy):
                        written = mem.write_tips(episodes, policy, pool.system_prompt,
                                                 sample_seed=stream_seed(seed, trial, REFLECTION))
                    if "tip_action_frac" in written:
                        tip_action[trial].append(written["tip_action_frac"])
                    reflections += [{"seed": seed, "trial": trial, **r} for r in mem.last_reflections]
                per_trial[arm][trial].append(episodes)
                log.info("seed %d trial %d (%s): score %.2f", seed, trial,
                         "no memory" if mem is None or trial == 0 else "tips",
                         episode_summary(episodes)["score"]["mean"] or math.nan)
    rows = _arm_trial_rows(per_trial)
    # every episode of every arm, so paired differences can be recomputed from the summary (and trial 0 compared)
    episode_rows = {arm: [[_episode_row(seed, e) for seed, eps in zip(ev.seeds, runs) for e in eps]
                          for runs in per_trial[arm]] for arm in arms}
    out = {"trial0_score": rows[next(iter(arms))][0]["score"], "rollout_s": rollout_s}
    if "memory" in arms:
        out.update(_own_tips_results(rows["memory"], memory_sizes, tip_action, reflections))
    if "control" in arms:
        out["control_trials"] = rows["control"]
        out.update(paired_vs_control(episode_rows))
    out["episode_rows"] = episode_rows
    for arm in fixed_arms or {}:
        out[f"{arm}_trials"] = rows[arm]
    return out


def _arm_trial_rows(per_trial: dict[str, list[list[list]]]) -> dict[str, list[dict[str, Any]]]:
    """Per arm, one ``_trial_row`` per trial from ``per_trial[arm][trial]`` (that trial's episodes, one list per seed).

    Raises:
        RuntimeError: a trial of an arm has no finished episode.
    """
    rows = {arm: [_trial_row(trial, [e for eps in runs for e in eps], arm != "control" and trial > 0)
                  for trial, runs in enumerate(trials)] for arm, trials in per_trial.items()}
    for arm, arm_rows in rows.items():
        scores = [r["score"] for r in arm_rows]
        if any(s is None for s in scores):
            raise RuntimeError(f"a trial of the {arm} arm has no finished episode (scores per trial: {scores}); "
                               "see the worker errors")
    return rows


def _own_tips_results(rows: list[dict], memory_sizes: list[list[int]], tip_action: list[list[float]],
                      reflections: list[dict]) -> dict[str, Any]:
    """The own-tips arm's part of the adaptation summary: its trial rows, the best later trial and its gains, the
    reflections written."""
    for trial, row in enumerate(rows):
        row["memory_size_before"] = float(sum(memory_sizes[trial]) / len(memory_sizes[trial]))
        row["tip_action_frac"] = sum(tip_action[trial]) / len(tip_action[trial]) if tip_action[trial] else None
    scores = [r["score"] for r in rows]
    best = max(range(1, len(rows)), key=lambda k: scores[k])
    return {"trials": rows, "best_trial": best, "best_score": scores[best],
            "best_absolute_gain": scores[best] - scores[0], "best_relative_gain": best_relative_gain(scores),
            "reflections": reflections}


def paired_vs_control(episode_rows: dict[str, list[list[dict]]]) -> dict[str, Any]:
    """Every other arm's ``paired_by_trial`` against the control arm, as ``paired_vs_off[<arm>]`` (the own tips'
    under ``own``, also as ``paired`` with ``last_trial_paired_score_diff``); {} without a control or another arm."""
    if "control" not in episode_rows or len(episode_rows) < 2:
        return {}
    control = episode_rows["control"]
    out = {"paired_vs_off": {"own" if arm == "memory" else arm: paired_by_trial(rows, control)
                             for arm, rows in episode_rows.items() if arm != "control"}}
    if "memory" in episode_rows:
        out["paired"] = out["paired_vs_off"]["own"]
        out["last_trial_paired_score_diff"] = out["paired"][-1]["score_diff"]
    return out


def _episode_row(seed: int, episode) -> dict[str, Any]:
    return {"seed": seed, "task": episode.task, "episode": episode.id, "score": episode.score,
            "success": bool(episode.success), "steps": len(episode.steps), "failed": bool(episode.failed),
            "actions": [s.action for s in episode.steps]}


def paired_by_trial(arm_rows: list[list[dict]], control_rows: list[list[dict]]) -> list[dict[str, Any]]:
    """Arm − control per trial from two arms' episode rows (per trial, ``_episode_row``s), episodes paired by seed,
    task and episode index, failed ones skipped: per trial ``{"trial", "score_diff", "success_diff"}``, each
    ``mean_stderr`` of the per-episode differences.

    Raises:
        ValueError: the arms have different numbers of trials, or an episode of one arm has no partner (or two)
            in the other — naming it.
    """
    from src.evaluation.stats import mean_stderr

    if len(arm_rows) != len(control_rows):
        raise ValueError(f"{len(arm_rows)} trials against {len(control_rows)}: the arms must run the same trials")

    def by_key(trial_rows: list[dict]) -> dict[str, dict]:
        keyed = {}
        for row in trial_rows:
            key = json.dumps([row["seed"], row["task"], row["episode"]], sort_keys=True)
            if key in keyed:
                raise ValueError(f"episode {key} appears twice in one trial")
            keyed[key] = row
        return keyed

    out = []
    for trial, (with_arm, without) in enumerate(zip(arm_rows, control_rows)):
        a, c = by_key(with_arm), by_key(without)
        if a.keys() != c.keys():
            raise ValueError(f"trial {trial}: episodes {sorted(a.keys() ^ c.keys())[:3]} are in one arm only")
        pairs = [(a[k], c[k]) for k in a if not (a[k]["failed"] or c[k]["failed"])]
        out.append({"trial": trial, "score_diff": mean_stderr([x["score"] - y["score"] for x, y in pairs]),
                    "success_diff": mean_stderr([float(x["success"]) - float(y["success"]) for x, y in pairs])})
    return out


def _trial_row(trial: int, episodes: list, with_tips: bool) -> dict[str, Any]:
    s = episode_summary(episodes)
    return {"trial": trial, "memory": with_tips, "score": s["score"]["mean"], "score_stderr": s["score"]["stderr"],
            "success_rate": s["success_rate"]["mean"], "success_rate_stderr": s["success_rate"]["stderr"],
            "episode_length": s["episode_length"], "episodes": s["episodes"], "failed_episodes": s["failed_episodes"]}
