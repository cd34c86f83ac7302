"""The evaluation protocols (``eval.protocol``): ``standard`` and ``adaptation`` (see ``src/eval.py``).

Both run their episodes through ``src.data.rollout_datamodule.evaluate``, the code of in-training validation.
"""
from __future__ import annotations

import logging
import math
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
    for name in ("episodes_per_task", "trials") + (("num_tasks",) if ev.get("num_tasks") is not None else ()):
        value = ev.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"eval.{name}={value!r}: expected an int >= 1")
    if not float(ev.get("temperature")) > 0:
        raise ValueError(f"eval.temperature={ev.get('temperature')!r}: expected > 0 (sampling)")
    if ev.get("memory_file") and protocol == "adaptation":
        raise ValueError(f"eval.memory_file={ev.get('memory_file')!r} with eval.protocol=adaptation: the adaptation "
                         "protocol starts from an empty memory; set eval.memory_file=null or eval.protocol=standard")


def run_standard(cfg, b, pool, tasks, memory, write_tips: bool) -> dict[str, Any]:
    import lightning as L

    from src.data.rollout import evaluate

    ev, module, dm = cfg.eval, b["module"], b["datamodule"]
    rollout_cfg = dm.rollout_config(use_tips=memory is not None, temperature=float(ev.temperature))
    start_state = memory.state_dict() if memory is not None else None
    all_episodes, per_seed, rollout_s = [], [], 0.0
    for seed in ev.seeds:
        L.seed_everything(seed, verbose=False)
        if memory is None:
            metrics, episodes = evaluate(pool, module, tasks, int(ev.episodes_per_task), rollout_cfg,
                                         dm.max_steps, return_episodes=True)
            rollout_s += metrics["rollout_s"]
        else:
            memory.load_state_dict(start_state)
            episodes = []
            for _ in range(int(ev.episodes_per_task)):  # rounds: one episode per task, then its tips
                metrics, round_episodes = evaluate(pool, module, tasks, 1, rollout_cfg, dm.max_steps, memory,
                                                   return_episodes=True)
                rollout_s += metrics["rollout_s"]
                if write_tips:
                    with module.rollout_context():
                        memory.write_tips(round_episodes, module.policy, pool.system_prompt)
                episodes += round_episodes
        seed_summary = episode_summary(episodes)
        per_seed.append({"seed": seed, "score": seed_summary["score"]["mean"],
                         "success_rate": seed_summary["success_rate"]["mean"], "episodes": len(episodes)})
        log.info("seed %d: score %s, success rate %s", seed, per_seed[-1]["score"], per_seed[-1]["success_rate"])
        all_episodes += episodes
    return {**episode_summary(all_episodes), "per_seed": per_seed, "rollout_s": rollout_s}


def run_adaptation(cfg, b, pool, tasks, memory) -> dict[str, Any]:
    import lightning as L

    from src.data.rollout import evaluate

    ev, module, dm = cfg.eval, b["module"], b["datamodule"]
    trials = int(ev.trials)
    configs = {use: dm.rollout_config(use_tips=use, temperature=float(ev.temperature)) for use in (False, True)}
    empty = memory.state_dict()
    per_trial: list[list] = [[] for _ in range(trials + 1)]
    memory_sizes = [[] for _ in range(trials + 1)]
    rollout_s = 0.0
    for seed in ev.seeds:
        L.seed_everything(seed, verbose=False)
        memory.load_state_dict(empty)
        for trial in range(trials + 1):
            # trial 0 passes the memory too (no retrieval): its states are embedded so its tips can be written
            metrics, episodes = evaluate(pool, module, tasks, int(ev.episodes_per_task), configs[trial > 0],
                                         dm.max_steps, memory, return_episodes=True)
            rollout_s += metrics["rollout_s"]
            memory_sizes[trial].append(len(memory.tips))
            with module.rollout_context():
                memory.write_tips(episodes, module.policy, pool.system_prompt)
            per_trial[trial] += episodes
            log.info("seed %d trial %d (%s): score %.2f", seed, trial, "tips" if trial else "no memory",
                     episode_summary(episodes)["score"]["mean"] or math.nan)
    rows = []
    for trial, episodes in enumerate(per_trial):
        s = episode_summary(episodes)
        rows.append({"trial": trial, "memory": trial > 0, "score": s["score"]["mean"],
                     "score_stderr": s["score"]["stderr"], "success_rate": s["success_rate"]["mean"],
                     "success_rate_stderr": s["success_rate"]["stderr"], "episode_length": s["episode_length"],
                     "episodes": s["episodes"], "failed_episodes": s["failed_episodes"],
                     "memory_size_before": float(sum(memory_sizes[trial]) / len(memory_sizes[trial]))})
    scores = [r["score"] for r in rows]
    if any(s is None for s in scores):
        raise RuntimeError(f"a trial has no finished episode (scores per trial: {scores}); see the worker errors")
    best = max(range(1, trials + 1), key=lambda k: scores[k])
    return {"trials": rows, "trial0_score": scores[0], "best_trial": best, "best_score": scores[best],
            "best_absolute_gain": scores[best] - scores[0], "best_relative_gain": best_relative_gain(scores),
            "rollout_s": rollout_s}
