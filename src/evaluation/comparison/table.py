"""The results table of a comparison (``results.md``): every number read from the runs' MLflow store."""
from __future__ import annotations

from typing import Sequence

import mlflow
import numpy as np
from mlflow.entities import Run

from src.evaluation.comparison.runs import ALGORITHM_LABELS, VAL_KEYS, algorithm_rank, per_iteration_sum, run_info
from src.evaluation.stats import mean_stderr

TIMING_KEYS = {"rollout": "rollout/rollout_s", "tips": "rollout/tip_write_s", "update": "train/update_s"}


def _fmt(values: Sequence[float], digits: int) -> str:
    """``mean ± s.e.`` of ``values`` (``src.evaluation.stats.mean_stderr``); the mean alone for one value."""
    stats = mean_stderr(values)
    return f"{stats['mean']:.{digits}f}" + ("" if stats["stderr"] is None else f" ± {stats['stderr']:.{digits}f}")


def results_table(client: mlflow.MlflowClient, runs: Sequence[Run], kind: str) -> str:
    """Markdown table of the compared runs, per algorithm: warm-start held-out score and success, final held-out
    score and success (the last validation of each run; mean ± s.e. over runs), iterations, wall-clock minutes,
    seconds per iteration (rollout / tips / update) and the seeds. Every number is read from the MLflow store."""
    digits = 3 if kind == "webshop" else 1
    unit = "score in [0, 1]" if kind == "webshop" else "points"
    lines = [f"| algorithm | seeds | iterations | wall-clock (min) | s / iteration: rollout / tips / update | "
             f"warm start: held-out score ({unit}) / success | final held-out score | final success |",
             "|---|---|---|---|---|---|---|---|"]
    for algo in sorted({r.data.params["algorithm/name"] for r in runs}, key=algorithm_rank):
        mine = sorted((r for r in runs if r.data.params["algorithm/name"] == algo),
                      key=lambda r: (len(str(r.data.params.get("seed"))), str(r.data.params.get("seed"))))
        info = [run_info(client, r) for r in mine]
        last = {k: [client.get_metric_history(r.info.run_id, k) for r in mine] for k in VAL_KEYS.values()}
        finals = {k: [max(h, key=lambda m: m.timestamp).value for h in hs if h] for k, hs in last.items()}
        ws = mine[0].data.metrics  # one warm start for every run of the study
        ws_txt = ("none" if "warm_start/score" not in ws else f"{ws['warm_start/score']:.{digits}f} ± "
                  f"{ws['warm_start/score_stderr']:.{digits}f} / {ws['warm_start/success_rate']:.2f}")
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
