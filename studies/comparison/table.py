"""The results table of a comparison (``results.md``): every number read from the runs' MLflow store."""
from __future__ import annotations

from typing import Sequence

import mlflow
import numpy as np
from mlflow.entities import Run

from studies.comparison.runs import (ALGORITHM_LABELS, VAL_KEYS, algorithm_rank, iteration_times,
                                            per_iteration_sum, per_iteration_values, run_info)
from src.evaluation.stats import mean_stderr

TIMING_KEYS = {"rollout": "rollout/rollout_s", "tips": "rollout/tip_write_s", "update": "train/update_s"}


def _fmt(values: Sequence[float], digits: int) -> str:
    """``mean ± s.e.`` of ``values`` (``src.evaluation.stats.mean_stderr``); the mean alone for one value."""
    stats = mean_stderr(values)
    return f"{stats['mean']:.{digits}f}" + ("" if stats["stderr"] is None else f" ± {stats['stderr']:.{digits}f}")


def _warm_start_text(metrics: dict[str, float], digits: int) -> str:
    """``score ± s.e. / success`` of a run's ``warm_start/*`` metrics; ``none`` for a run without a warm start."""
    if "warm_start/score" not in metrics:
        return "none"
    return (f"{metrics['warm_start/score']:.{digits}f} ± {metrics['warm_start/score_stderr']:.{digits}f} / "
            f"{metrics['warm_start/success_rate']:.2f}")


def results_table(client: mlflow.MlflowClient, runs: Sequence[Run], env) -> str:
    """Markdown table of the compared runs, per algorithm: warm-start held-out score and success, final held-out
    score and success (the last validation of each run; mean ± s.e. over runs), iterations, wall-clock minutes,
    seconds per iteration (rollout / tips / update) and the seeds. Every number is read from the MLflow store.
    Runs whose warm starts scored differently (built on different machines) get one entry each, with their seeds."""
    digits = 3 if env.max_score <= 1 else 1
    unit = env.score_unit
    lines = [f"| algorithm | seeds | iterations | wall-clock (min) | s / iteration: rollout / tips / update | "
             f"warm start: held-out score ({unit}) / success | final held-out score | final success |",
             "|---|---|---|---|---|---|---|---|"]
    for algo in sorted({r.data.params["algorithm/name"] for r in runs}, key=algorithm_rank):
        mine = sorted((r for r in runs if r.data.params["algorithm/name"] == algo),
                      key=lambda r: (len(str(r.data.params.get("seed"))), str(r.data.params.get("seed"))))
        info = [run_info(client, r) for r in mine]
        last = {k: [client.get_metric_history(r.info.run_id, k) for r in mine] for k in VAL_KEYS.values()}
        finals = {k: [max(h, key=lambda m: m.timestamp).value for h in hs if h] for k, hs in last.items()}
        ws_runs: dict[str, list[str]] = {}
        for r, i in zip(mine, info):
            ws_runs.setdefault(_warm_start_text(r.data.metrics, digits), []).append(str(i["seed"]))
        ws_txt = next(iter(ws_runs)) if len(ws_runs) == 1 else "; ".join(
            f"{text} (seed{'s' if len(seeds) > 1 else ''} {', '.join(seeds)})" for text, seeds in ws_runs.items())
        timing = []
        for key in TIMING_KEYS.values():
            vals = [v for r in mine if (v := per_iteration_sum(client, r, key)) is not None]
            timing.append(f"{np.mean(vals):.0f}" if vals else "–")
        minutes = [i["minutes"] for i in info if i["minutes"] is not None]
        score = _fmt(finals["val/score"], digits) if finals["val/score"] else "–"
        success = _fmt(finals["val/success_rate"], 2) if finals["val/success_rate"] else "–"
        lines.append(f"| {ALGORITHM_LABELS.get(algo, algo)} | {', '.join(str(i['seed']) for i in info)} | "
                     f"{np.mean([i['iterations'] for i in info]):.0f} | "
                     f"{np.mean(minutes):.0f} | {' / '.join(timing)} | {ws_txt} | {score} | {success} |")
    return "\n".join(lines) + "\n"


# (column, metric key, how the iteration's values are summarised, digits; None: the score's); "first / max" shows
# the first optimizer step's value, where the old log-probs are the policy's own (0 on policy; tips in them off
# policy), and the largest.
ITERATION_COLUMNS = (
    ("rollout score", "rollout/score", "last", None),
    ("zero-variance groups", "rollout/adv/zero_var_group_frac", "last", 2),
    # groups whose advantages only the novelty bonus sets (equal environment returns; advantages.py)
    ("bonus-only groups", "rollout/adv/bonus_only_group_frac", "last", 2),
    ("approx_kl first / max", "train/approx_kl", "first/max", 3),
    ("clip frac", "train/clip_frac", "mean", 3),
    ("masked frac", "train/masked_frac", "mean", 3),
    ("tips written", "rollout/tips_written", "last", 0),
    ("tips that are actions", "rollout/tip_action_frac", "last", 2),
    ("retrieval hit rate", "rollout/memory/hit_rate", "last", 2),
)


def _summary(values: list[float], how: str, digits: int) -> str:
    if not values:
        return "–"
    if how == "first/max":
        return f"{values[0]:.{digits}f} / {max(values):.{digits}f}"
    return f"{(values[-1] if how == 'last' else float(np.mean(values))):.{digits}f}"


def iterations_table(client: mlflow.MlflowClient, runs: Sequence[Run], env) -> str:
    """Markdown table, one row per run and training iteration: the update mode drawn, the rollout score, the
    share of groups without signal and of groups whose advantages only the novelty bonus sets, approx_kl (first
    optimizer step / largest), mean clip and masked fractions, and the memory's tips written, the share of them
    that are actions and the retrieval hit rate (``–``: not logged, e.g. GRPO has no memory). Where EMPO² and GRPO
    part, this says which iteration and which mode did it.
    """
    score_digits = 3 if env.max_score <= 1 else 1
    lines = ["| run | iteration | mode | " + " | ".join(c[0] for c in ITERATION_COLUMNS) + " |",
             "|---|---|---|" + "---|" * len(ITERATION_COLUMNS)]
    for run in sorted(runs, key=lambda r: (algorithm_rank(r.data.params["algorithm/name"]),
                                           str(r.data.params.get("seed")))):
        iters = iteration_times(client, run)
        modes = {k.removeprefix("rollout/mode_"): per_iteration_values(client, run, k, iters)
                 for k in run.data.metrics if k.startswith("rollout/mode_")}
        columns = [(per_iteration_values(client, run, key, iters), how, score_digits if digits is None else digits)
                   for _, key, how, digits in ITERATION_COLUMNS]
        for _, it in iters:
            mode = next((m for m, v in modes.items() if v.get(it, [0.0])[-1] == 1.0), "–")
            cells = [_summary(values.get(it, []), how, digits) for values, how, digits in columns]
            lines.append(f"| {run.info.run_name} | {it:.0f} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def paired_table(runs: dict[str, dict[int, list[dict]]], digits: int = 3, unit: str = "") -> tuple[str, dict]:
    """Markdown table (``paired.md``) and numbers of every later algorithm minus every earlier one (order:
    ``algorithm_rank``; EMPO² − GRPO, EMPO² − GRPO + novelty, GRPO + novelty − GRPO), from per-episode files
    (``runs``: ``{algorithm: {seed: rows}}``, ``studies.episode_table.read_runs``).

    Columns: the seed-level difference (mean over training seeds of each run's held-out mean, ± its s.e. from the
    spread between seeds), the paired-by-episode difference (± evaluation noise only), and each run's mean."""
    from studies.episode_table import paired_differences

    algos = sorted(runs, key=algorithm_rank)
    label = lambda a: ALGORITHM_LABELS.get(a, a)  # noqa: E731
    f = lambda s: "n/a" if s["mean"] is None else (  # noqa: E731
        f"{s['mean']:+.{digits}f}" + ("" if s["stderr"] is None else f" ± {s['stderr']:.{digits}f}"))
    runs_txt = lambda per: ", ".join(f"{per[s]:.{digits}f}" for s in sorted(per))  # noqa: E731
    lines = [f"| difference | seeds | episodes | seed-level ({unit or 'score'}) | paired by episode | "
             "per-run means (seed order) |", "|---|---|---|---|---|---|"]
    numbers = {}
    for i, b in enumerate(algos):
        for a in algos[i + 1:]:
            d = paired_differences(runs[a], runs[b])
            numbers[f"{a}-{b}"] = d
            lines.append(f"| {label(a)} − {label(b)} | {d['seed_level']['n_seeds'][0]} vs "
                         f"{d['seed_level']['n_seeds'][1]} | {d['episodes']} | {f(d['seed_level'])} | "
                         f"{f(d['paired_by_episode'])} | {runs_txt(d['runs_a'])} vs {runs_txt(d['runs_b'])} |")
    return "\n".join(lines) + "\n", numbers
