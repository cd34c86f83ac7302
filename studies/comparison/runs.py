"""Reading the runs to compare from an MLflow store: which runs, their curves, their facts and timings.

Runs are training runs of ``src/train.py``, grouped by their ``algorithm/name`` parameter.
"""
from __future__ import annotations

import ast
from typing import Any, Sequence

import mlflow
import numpy as np
from mlflow.entities import Run

from studies.comparison.curves import Curve, curve_from_points

ALGORITHM_LABELS = {"grpo": "GRPO", "grpo_novelty": "GRPO + novelty", "empo2": "EMPO²",
                    "empo2_authors": "EMPO² (authors' code)"}
ROLLOUT_KEYS = ("rollout/return", "rollout/score", "rollout/success_rate")
VAL_KEYS = {"rollout/score": "val/score", "rollout/success_rate": "val/success_rate"}


def algorithm_rank(algo: str) -> tuple[int, str]:
    """GRPO first, then GRPO + novelty, EMPO², EMPO² with the authors' semantics, then anything else alphabetically."""
    known = list(ALGORITHM_LABELS)
    return (known.index(algo) if algo in known else len(known), algo)


def run_tags(run: Run) -> list[str]:
    """The run's Hydra ``tags`` (logged as the parameter ``tags``, the string form of a list)."""
    raw = run.data.params.get("tags", "")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return [raw] if raw else []
    return [str(t) for t in value] if isinstance(value, (list, tuple)) else [str(value)]


def _run_by_id(client: mlflow.MlflowClient, run_id: str) -> Run:
    """The run ``run_id`` of this store, or the run imported from the record of the run ``run_id`` (records.py).

    Raises:
        ValueError: neither is in the store.
    """
    from mlflow.exceptions import MlflowException

    from studies.comparison.records import RECORD_SOURCE_TAG

    try:
        return client.get_run(run_id)
    except MlflowException:
        experiments = [e.experiment_id for e in client.search_experiments()]
        found = client.search_runs(experiments, filter_string=f"tags.`{RECORD_SOURCE_TAG}` = '{run_id}'")
        if not found:
            raise ValueError(f"no run {run_id!r} in this store, nor one imported from its record") from None
        return found[0]


def select_runs(client: mlflow.MlflowClient, experiment: str | None, tags: Sequence[str] = (),
                run_ids: Sequence[str] = (), algorithms: Sequence[str] = tuple(ALGORITHM_LABELS),
                include_unfinished: bool = False) -> list[Run]:
    """Training runs to compare: ``run_ids`` as given (an original id finds the run imported from its record), or
    the runs of ``experiment`` that carry every tag in ``tags`` and whose ``algorithm/name`` is in ``algorithms``
    (finished ones unless ``include_unfinished``).

    Raises ValueError for an unknown experiment, a run id that is not a training run, or no matching run.
    """
    if run_ids:
        runs = [_run_by_id(client, rid) for rid in run_ids]
        for run in runs:
            if "algorithm/name" not in run.data.params:
                raise ValueError(f"run {run.info.run_id} ({run.info.run_name}) has no 'algorithm/name' parameter: "
                                 "expected a training run of src/train.py")
        return runs
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = [e.name for e in client.search_experiments()]
        raise ValueError(f"no MLflow experiment named {experiment!r}; the store has {names}")
    status = "" if include_unfinished else "attributes.status = 'FINISHED'"
    runs = client.search_runs([exp.experiment_id], filter_string=status, max_results=5000,
                              order_by=["attributes.start_time ASC"])
    runs = [r for r in runs if r.data.params.get("algorithm/name") in algorithms
            and set(tags) <= set(run_tags(r))]
    if not runs:
        raise ValueError(f"no {'' if include_unfinished else 'finished '}run in experiment {experiment!r} with "
                         f"algorithm in {list(algorithms)} and tags {list(tags)}")
    return runs


def run_environment(runs: Sequence[Run]):
    """The ``Environment`` class (src/envs/base.py) the runs trained in, from their ``env/_target_``: its name, score
    unit and best score label the tables and figures.

    Raises:
        ValueError: the runs mix environments, or one names no environment class that can be imported.
    """
    from src.envs.base import environment_class

    targets = {run.data.params.get("env/_target_", "") for run in runs}
    if len(targets) != 1:
        raise ValueError(f"the selected runs mix environments {sorted(targets)}; compare one environment at a time "
                         "(filter with --tag or --run-ids)")
    target = targets.pop()
    try:
        return environment_class(target)
    except (ImportError, AttributeError, TypeError, ValueError) as err:
        raise ValueError(f"the runs' env/_target_={target!r} is not an environment this checkout can import "
                         f"({type(err).__name__}: {err})") from err


def comparison_title(runs: Sequence[Run], env) -> str:
    """The figures' title: the algorithms compared (GRPO first), the environment and the tasks."""
    tasks = sorted({r.data.params.get("env/task") for r in runs} - {None, "None"})
    algos = sorted({r.data.params["algorithm/name"] for r in runs}, key=algorithm_rank)
    return f"{' vs '.join(ALGORITHM_LABELS.get(a, a) for a in algos)} on {env.display_name}" + (
        f" ({', '.join(tasks)})" if tasks else "")


def rollout_curve(client: mlflow.MlflowClient, run: Run, key: str) -> Curve:
    """A per-iteration rollout metric (``rollout/*``) against its iteration index.

    Each point is matched to the ``iteration`` point logged in the same call (same step; the closest timestamp
    if several iterations share a step). Raises ValueError if a point has no ``iteration`` at its step.
    """
    iters: dict[int, list[tuple[int, float]]] = {}
    for m in client.get_metric_history(run.info.run_id, "iteration"):
        iters.setdefault(m.step, []).append((m.timestamp, m.value))
    points = []
    for m in client.get_metric_history(run.info.run_id, key):
        if m.step not in iters:
            raise ValueError(f"run {run.info.run_id}: {key} at step {m.step} has no 'iteration' metric at that "
                             "step (expected a run logged by src/train.py)")
        _, it = min(iters[m.step], key=lambda ti: abs(ti[0] - m.timestamp))
        points.append((it, (m.timestamp - run.info.start_time) / 60_000.0, m.value))
    return curve_from_points(points)


def iteration_times(client: mlflow.MlflowClient, run: Run) -> list[tuple[int, float]]:
    """(timestamp, iteration) of every rollout of ``run``, in time order."""
    return sorted((m.timestamp, m.value) for m in client.get_metric_history(run.info.run_id, "iteration"))


def iteration_at(iterations: list[tuple[int, float]], timestamp: int) -> float | None:
    """The latest iteration logged at or before ``timestamp``; None if none was."""
    before = [it for ts, it in iterations if ts <= timestamp]
    return before[-1] if before else None


def val_curve(client: mlflow.MlflowClient, run: Run, key: str) -> Curve:
    """A validation metric (``val/*``) against the iterations completed before it: 1 + the iteration of the
    latest rollout logged before it (validation runs at the end of a training iteration), 0 if none.

    A run that started from an imitation warm start has its held-out result (``warm_start/<name>``, the same
    protocol as ``val/<name>``, logged at the run's start) as the point at iteration 0, minute 0.
    """
    rollouts = iteration_times(client, run)
    points = [(0.0, 0.0, m.value) for m in
              client.get_metric_history(run.info.run_id, "warm_start/" + key.removeprefix("val/"))]
    for m in client.get_metric_history(run.info.run_id, key):
        it = iteration_at(rollouts, m.timestamp)
        points.append((it + 1 if it is not None else 0.0, (m.timestamp - run.info.start_time) / 60_000.0, m.value))
    return curve_from_points(points)


def collect(client: mlflow.MlflowClient, runs: Sequence[Run]) -> dict[str, dict[str, list[Curve]]]:
    """``{algorithm: {metric key: [Curve per run]}}`` for the rollout and validation keys (runs without a
    metric, e.g. validation never reached, contribute nothing to it)."""
    out: dict[str, dict[str, list[Curve]]] = {}
    for run in runs:
        algo = run.data.params["algorithm/name"]
        metrics = out.setdefault(algo, {})
        for key in ROLLOUT_KEYS:
            metrics.setdefault(key, []).append(rollout_curve(client, run, key))
        for key in VAL_KEYS.values():
            metrics.setdefault(key, []).append(val_curve(client, run, key))
        for key in list(metrics):
            metrics[key] = [c for c in metrics[key] if len(c.value)]
    return out


def run_info(client: mlflow.MlflowClient, run: Run) -> dict[str, Any]:
    """Name, algorithm, seed, status, wall-clock minutes, iterations logged and minutes per iteration of a run
    (``run_id``: the id it was first logged under, also for a run imported from a record)."""
    from studies.comparison.records import original_run_id

    iterations = len(client.get_metric_history(run.info.run_id, "iteration"))
    minutes = (run.info.end_time - run.info.start_time) / 60_000.0 if run.info.end_time else None
    return {"run_id": original_run_id(run), "name": run.info.run_name, "algorithm": run.data.params["algorithm/name"],
            "seed": run.data.params.get("seed"), "status": run.info.status, "minutes": minutes,
            "iterations": iterations,
            "minutes_per_iteration": minutes / iterations if minutes is not None and iterations else None}


def per_iteration_values(client: mlflow.MlflowClient, run: Run, key: str,
                         iters: list[tuple[int, float]] | None = None) -> dict[float, list[float]]:
    """``{iteration: [values of key logged during it]}`` in logging order: a value belongs to the latest rollout
    logged at or before it (an optimizer step's ``train/*`` to the iteration whose rollout it trains on); values
    logged before the first rollout count with it. Empty when the run never logged ``key`` or no iteration.
    ``iters``: the run's ``iteration_times`` when the caller already read them."""
    iters = iteration_times(client, run) if iters is None else iters
    out: dict[float, list[float]] = {}
    if not iters:
        return out
    for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: (m.timestamp, m.step)):
        it = iteration_at(iters, m.timestamp)
        out.setdefault(iters[0][1] if it is None else it, []).append(m.value)
    return out


def per_iteration_sum(client: mlflow.MlflowClient, run: Run, key: str) -> float | None:
    """Mean over iterations of a timing metric summed within each iteration (e.g. ``train/update_s`` is logged once
    per optimizer step); None when the run never logged it."""
    iters = iteration_times(client, run)
    values = per_iteration_values(client, run, key, iters)
    if not values:
        return None
    return float(np.mean([sum(values.get(it, [])) for _, it in iters]))
