"""Compare GRPO and EMPO² training runs from an MLflow store: learning curves and the adaptation curve as PNGs.

    python scripts/compare_runs.py --tag scienceworld                         # finished runs tagged scienceworld
    python scripts/compare_runs.py --tag study-20261130-011000 --out-dir logs/comparison/study
    python scripts/compare_runs.py --run-ids <id> <id> ... --no-log           # only write the files
    python scripts/compare_runs.py --tag scienceworld --adaptation logs/eval/a.json logs/eval/b.json

Reads only (training is launched by `scripts/run_study.py`). Runs are grouped by `algorithm/name`; several seeds
give the mean and a ± standard-error band (std with Bessel correction / sqrt(n)). Writes to `--out-dir`:

- `learning_curves_iteration.png`: rollout return, score and success rate (solid) and validation score and success
  rate (dashed) against the number of training iterations the policy had completed when it played: the rollout of
  iteration k used the policy after k iterations, the validation after iteration k the policy after k + 1.
- `learning_curves_wallclock.png`: the same points against wall-clock minutes since each run's start (x: the mean
  over seeds of the time at which the point was logged).
- `adaptation.png` (with `--adaptation`): score per trial of the OOD adaptation protocol
  (docs/evaluation.md#the-adaptation-protocol).
- `results.md`: the results table (``results_table``): warm start, final held-out score and success per
  algorithm (mean ± s.e. over seeds), iterations, wall-clock and seconds per iteration.
- `curves.json`: the plotted numbers.

and logs them as artifacts of a new MLflow run `comparison-...` in the experiment of the compared runs.
Units come from the runs' `env/_target_`: ScienceWorld scores are points (−100..100), WebShop scores are in [0, 1].
"""
from __future__ import annotations

import argparse
import ast
import json
import logging
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import mlflow  # noqa: E402
import numpy as np  # noqa: E402
from mlflow.entities import Run  # noqa: E402

log = logging.getLogger("compare_runs")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python scripts/compare_runs.py` from anywhere: src.* is importable
DEFAULT_TRACKING_URI = f"sqlite:///{ROOT}/logs/mlflow.db"
ALGORITHM_LABELS = {"grpo": "GRPO", "empo2": "EMPO²"}
ALGORITHM_COLORS = {"grpo": "tab:blue", "empo2": "tab:orange"}
ROLLOUT_KEYS = ("rollout/return", "rollout/score", "rollout/success_rate")
VAL_KEYS = {"rollout/score": "val/score", "rollout/success_rate": "val/success_rate"}
FIGSIZE, DPI = (16.0, 5.0), 110  # learning-curve figures: 1760 x 550 pixels
ADAPT_FIGSIZE = (8.0, 5.0)       # adaptation figure: 880 x 550 pixels


@dataclass
class Curve:
    """One metric of one run: ``iteration``, ``minutes`` and ``value`` are arrays of shape (n,), one per point.

    ``iteration`` = training iterations the policy had completed when the episodes were played; ``minutes`` =
    wall-clock minutes from the run's start to the point's MLflow timestamp.
    """

    iteration: np.ndarray
    minutes: np.ndarray
    value: np.ndarray


@dataclass
class Aggregate:
    """A metric over seeds, per iteration; arrays of shape (m,) sorted by iteration.

    ``sem`` is the standard error of the mean (NaN where fewer than 2 seeds have the point); ``n`` the seed count.
    """

    iteration: np.ndarray
    minutes: np.ndarray
    mean: np.ndarray
    sem: np.ndarray
    n: np.ndarray

    def to_json(self) -> dict[str, list]:
        return {k: [None if isinstance(v, float) and np.isnan(v) else v for v in getattr(self, k).tolist()]
                for k in ("iteration", "minutes", "mean", "sem", "n")}


# ---------------------------------------------------------------------------------------------------- selection
def run_tags(run: Run) -> list[str]:
    """The run's Hydra ``tags`` (logged as the parameter ``tags``, the string form of a list)."""
    raw = run.data.params.get("tags", "")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return [raw] if raw else []
    return [str(t) for t in value] if isinstance(value, (list, tuple)) else [str(value)]


def select_runs(client: mlflow.MlflowClient, experiment: str | None, tags: Sequence[str] = (),
                run_ids: Sequence[str] = (), algorithms: Sequence[str] = ("grpo", "empo2"),
                include_unfinished: bool = False) -> list[Run]:
    """Training runs to compare: ``run_ids`` as given, or the runs of ``experiment`` that carry every tag in
    ``tags`` and whose ``algorithm/name`` is in ``algorithms`` (finished ones unless ``include_unfinished``).

    Raises ValueError for an unknown experiment, a run id that is not a training run, or no matching run.
    """
    if run_ids:
        runs = [client.get_run(rid) for rid in run_ids]
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


def env_kind(runs: Sequence[Run]) -> str:
    """``"scienceworld"`` or ``"webshop"`` from the runs' ``env/_target_``; ValueError if mixed or unknown."""
    kinds = set()
    for run in runs:
        target = run.data.params.get("env/_target_", "").lower()
        kind = "scienceworld" if "scienceworld" in target else "webshop" if "webshop" in target else None
        if kind is None:
            raise ValueError(f"run {run.info.run_id} has env/_target_={target!r}: expected a ScienceWorld or "
                             "WebShop environment")
        kinds.add(kind)
    if len(kinds) != 1:
        raise ValueError(f"the selected runs mix environments {sorted(kinds)}; compare one environment at a time "
                         "(filter with --tag or --run-ids)")
    return kinds.pop()


# ---------------------------------------------------------------------------------------------------- extraction
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
    return _curve(points)


def _iterations(client: mlflow.MlflowClient, run: Run) -> list[tuple[int, float]]:
    """(timestamp, iteration) of every rollout of ``run``, in time order."""
    return sorted((m.timestamp, m.value) for m in client.get_metric_history(run.info.run_id, "iteration"))


def _iteration_at(iterations: list[tuple[int, float]], timestamp: int) -> float | None:
    """The latest iteration logged at or before ``timestamp``; None if none was."""
    before = [it for ts, it in iterations if ts <= timestamp]
    return before[-1] if before else None


def val_curve(client: mlflow.MlflowClient, run: Run, key: str) -> Curve:
    """A validation metric (``val/*``) against the iterations completed before it: 1 + the iteration of the
    latest rollout logged before it (validation runs at the end of a training iteration), 0 if none.

    A run that started from an imitation warm start has its held-out result (``warm_start/<name>``, the same
    protocol as ``val/<name>``, logged at the run's start) as the point at iteration 0, minute 0.
    """
    rollouts = _iterations(client, run)
    points = [(0.0, 0.0, m.value) for m in
              client.get_metric_history(run.info.run_id, "warm_start/" + key.removeprefix("val/"))]
    for m in client.get_metric_history(run.info.run_id, key):
        it = _iteration_at(rollouts, m.timestamp)
        points.append((it + 1 if it is not None else 0.0, (m.timestamp - run.info.start_time) / 60_000.0, m.value))
    return _curve(points)


def _curve(points: list[tuple[float, float, float]]) -> Curve:
    points.sort()
    arr = np.asarray(points, dtype=float).reshape(-1, 3)
    return Curve(iteration=arr[:, 0], minutes=arr[:, 1], value=arr[:, 2])


def aggregate(curves: Sequence[Curve]) -> Aggregate:
    """Mean over runs per iteration (of the value and of the minutes) with the standard error of the value.

    A run with several points at one iteration contributes their mean. Shapes: see ``Aggregate``.
    """
    per_iter: dict[float, list[tuple[float, float]]] = {}
    for c in curves:
        for it in np.unique(c.iteration):
            sel = c.iteration == it
            per_iter.setdefault(float(it), []).append((float(c.minutes[sel].mean()), float(c.value[sel].mean())))
    its = sorted(per_iter)
    mean, sem, minutes, n = [], [], [], []
    for it in its:
        t, v = np.asarray(per_iter[it]).T
        mean.append(v.mean())
        minutes.append(t.mean())
        n.append(len(v))
        sem.append(v.std(ddof=1) / np.sqrt(len(v)) if len(v) > 1 else np.nan)
    return Aggregate(iteration=np.asarray(its, dtype=float), minutes=np.asarray(minutes, dtype=float),
                     mean=np.asarray(mean, dtype=float), sem=np.asarray(sem, dtype=float),
                     n=np.asarray(n, dtype=int))


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


# ---------------------------------------------------------------------------------------------------- plotting
def units(kind: str) -> dict[str, str]:
    """Axis labels per metric for an environment kind (ScienceWorld points, WebShop [0, 1])."""
    if kind == "scienceworld":
        return {"rollout/return": "episode return (points; EMPO² adds the novelty bonus)",
                "rollout/score": "episode score (points, −100…100)",
                "rollout/success_rate": "success rate (fraction of episodes, 0…1)"}
    return {"rollout/return": "episode return (Σ reward; EMPO² adds the novelty bonus)",
            "rollout/score": "episode score (0…1)",
            "rollout/success_rate": "success rate (fraction of episodes, 0…1)"}


def _atomic_savefig(fig: plt.Figure, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=DPI, format="png")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
        plt.close(fig)


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _band(ax, x: np.ndarray, mean: np.ndarray, sem: np.ndarray, color: str, style: str, label: str,
          rank: int = 1) -> None:
    # earlier-ranked curves are drawn wider, so a curve hidden under an identical later one still shows as an edge
    width = 3.5 if rank == 0 else 2.0
    ax.plot(x, mean, style, color=color, marker="o" if style == "-" else "s", markersize=width + 3, linewidth=width,
            label=label)
    ok = ~np.isnan(sem)
    if style == "--" and ok.any():  # validation is sparse (often a single point): error bars, not a band
        ax.errorbar(x[ok], mean[ok], yerr=sem[ok], fmt="none", ecolor=color, capsize=5, linewidth=1.5)
    elif ok.any():
        ax.fill_between(x[ok], (mean - sem)[ok], (mean + sem)[ok], color=color, alpha=0.18, linewidth=0)


def _algo_rank(algo: str) -> tuple[int, str]:
    """GRPO first, then EMPO², then anything else alphabetically."""
    known = list(ALGORITHM_LABELS)
    return (known.index(algo) if algo in known else len(known), algo)


def plot_learning_curves(data: dict[str, dict[str, list[Curve]]], kind: str, x_axis: str, title: str,
                         path: Path) -> dict[str, dict[str, Aggregate]]:
    """Three panels (return, score, success rate) for ``x_axis`` ``"iteration"`` or ``"minutes"``; each algorithm
    in its colour, training rollouts solid, validation dashed, single seeds as faint dots. Returns the aggregates.
    """
    if x_axis not in ("iteration", "minutes"):
        raise ValueError(f"x_axis={x_axis!r}: expected 'iteration' or 'minutes'")
    labels = units(kind)
    # shared x: validation points sit one iteration past the last rollout, all panels should line up
    fig, axes = plt.subplots(1, 3, figsize=FIGSIZE, dpi=DPI, sharex=True)
    aggs: dict[str, dict[str, Aggregate]] = {}
    for ax, key in zip(axes, ROLLOUT_KEYS):
        for rank, algo in enumerate(sorted(data, key=_algo_rank)):
            color = ALGORITHM_COLORS.get(algo, "tab:green")
            name = ALGORITHM_LABELS.get(algo, algo)
            for metric, style, what in ((key, "-", "training rollouts"), (VAL_KEYS.get(key), "--", "validation")):
                curves = data[algo].get(metric) if metric else None
                if not curves:
                    continue
                agg = aggregate(curves)
                aggs.setdefault(algo, {})[metric] = agg
                x = agg.iteration if x_axis == "iteration" else agg.minutes
                for c in curves:
                    ax.plot(c.iteration if x_axis == "iteration" else c.minutes, c.value, "o" if style == "-"
                            else "s", color=color, alpha=0.25, markersize=3, linestyle="none")
                seeds = f"n={len(curves)} seed" + "s" * (len(curves) > 1)
                _band(ax, x, agg.mean, agg.sem, color, style, f"{name} {what} ({seeds})", rank)
        ax.set_ylabel(labels[key])
        ax.set_xlabel("training iterations completed" if x_axis == "iteration"
                      else "wall-clock time since run start (minutes)")
        ax.set_title(key.split("/")[1].replace("_", " "))
        if key == "rollout/success_rate" or (kind == "webshop" and key == "rollout/score"):
            ax.set_ylim(-0.03, 1.03)
        if x_axis == "iteration":
            ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    if x_axis == "minutes":  # after all panels are drawn: fixing a limit earlier would freeze the shared x range
        axes[0].set_xlim(left=0)
    handles, names = [], []
    for ax in axes:  # one legend for the figure, each entry once
        for h, n in zip(*ax.get_legend_handles_labels()):
            if n not in names:
                handles.append(h)
                names.append(n)
    fig.suptitle(title + "  —  line: mean over seeds, band / bars: ± 1 standard error, dots: single seeds")
    fig.legend(handles, names, loc="lower center", ncol=min(len(names), 4), frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    _atomic_savefig(fig, path)
    return aggs


def _env_kind_of(target: str | None) -> str | None:
    t = (target or "").lower()
    return "scienceworld" if "scienceworld" in t else "webshop" if "webshop" in t else None


def _adaptation_label(doc: dict, path: Path) -> str:
    """``label``/``algorithm`` of the summary, else the algorithm of the training run that wrote ``ckpt_path``
    (its Hydra ``.hydra/config.yaml`` two levels above the checkpoint), else the file's directory name."""
    algo = doc.get("label") or doc.get("algorithm")
    if isinstance(algo, dict):
        algo = algo.get("name")
    if not algo and "ckpt_path" in doc:
        if not doc["ckpt_path"]:
            return "base model (untrained)"
        ckpt = Path(doc["ckpt_path"])
        for run_dir in (ckpt.parent.parent, ROOT / ckpt.parent.parent):
            if (run_dir / ".hydra" / "config.yaml").is_file():
                from omegaconf import OmegaConf

                algo = OmegaConf.load(run_dir / ".hydra" / "config.yaml").get("algorithm", {}).get("name")
                break
    return ALGORITHM_LABELS.get(str(algo), str(algo)) if algo else path.parent.name or path.stem


def load_adaptation(specs: Sequence[str | Path]) -> dict[str, dict[str, Any]]:
    """Read adaptation summaries (``eval_summary.json`` of ``src/eval.py`` with ``eval.protocol=adaptation``).

    ``specs``: paths, or ``LABEL=PATH`` to name the curve. Per-trial scores come from ``trials`` (a list of
    objects with ``score`` and optionally ``score_stderr``, as src/eval.py writes) or ``trial_scores`` (a list of
    numbers, or of per-episode score lists that are averaged), at the top level or under ``summary``. Trial 0 is
    the no-memory trial. Without ``LABEL=`` the label is found by ``_adaptation_label``; files with one label are
    averaged. Returns ``{label: {"scores": array (n_files, n_trials), "stderr": array (n_trials,) or None
    (a single file's per-trial standard error over its episodes), "env", "task", "files"}}``.

    Raises ValueError naming the file when it has no per-trial scores or files with one label disagree on the
    number of trials.
    """
    out: dict[str, dict[str, Any]] = {}
    for spec in specs:
        spec = str(spec)
        # an existing path wins: Hydra multirun directories contain '=' themselves
        if Path(spec).exists() or "=" not in spec:
            label, path = "", Path(spec)
        else:
            label, rest = spec.split("=", 1)
            path = Path(rest)
        doc = json.loads(path.read_text())
        found = None
        for scope in (doc, doc.get("summary")):
            if isinstance(scope, dict) and (found := _trial_scores(scope)) is not None:
                break
        if found is None:
            raise ValueError(f"{path}: no per-trial scores; expected 'trials': [{{'score': ...}}, ...] (src/eval.py "
                             f"eval.protocol=adaptation) or 'trial_scores': [...] (keys found: {sorted(doc)})")
        scores, stderr = found
        label = label or _adaptation_label(doc, path)
        entry = out.setdefault(label, {"scores": [], "stderr": stderr, "env": doc.get("env"),
                                       "task": doc.get("task"), "files": []})
        if entry["scores"] and len(entry["scores"][0]) != len(scores):
            raise ValueError(f"{path}: {len(scores)} trials, but {entry['files'][0]} (same label {label!r}) has "
                             f"{len(entry['scores'][0])}")
        entry["scores"].append(scores)
        entry["files"].append(str(path))
    for entry in out.values():
        entry["scores"] = np.asarray(entry["scores"], dtype=float)
        if len(entry["scores"]) > 1 or entry["stderr"] is None:
            entry["stderr"] = None
        else:
            entry["stderr"] = np.asarray(entry["stderr"], dtype=float)
    return out


def _trial_scores(scope: dict) -> tuple[list[float], list[float] | None] | None:
    """(per-trial scores, per-trial standard errors or None) from one JSON object, None if it has neither."""
    trials = scope.get("trials")
    if isinstance(trials, list) and trials and all(isinstance(t, dict) and "score" in t for t in trials):
        stderr = [t.get("score_stderr") for t in trials]
        return ([float(t["score"]) for t in trials],
                None if any(s is None for s in stderr) else [float(s) for s in stderr])
    if isinstance(scope.get("trial_scores"), list):
        return [float(np.mean(s)) if isinstance(s, list) else float(s) for s in scope["trial_scores"]], None
    return None


def plot_adaptation(adapt: dict[str, dict[str, Any]], kind: str | None, path: Path) -> dict[str, Any]:
    """Score per trial (trial 0 without memory, then memory trials) per label.

    Band: ± standard error over files with one label, or, for a single file, the summary's own per-trial
    standard error over its episodes (and seeds). Units from the summaries' ``env`` (else ``kind``).
    Returns ``{label: {"mean": [...], "sem": [...], "best_relative_gain": float | None, "files": [...]}}`` with
    the gain as ``src.evaluation.stats.best_relative_gain`` defines it (max over trials ≥ 1 of (score − score₀) / |score₀|).
    """
    from src.evaluation.stats import best_relative_gain

    fig, ax = plt.subplots(figsize=ADAPT_FIGSIZE, dpi=DPI)
    summary = {}
    inv = {v: k for k, v in ALGORITHM_LABELS.items()}
    for i, (label, entry) in enumerate(adapt.items()):
        scores = entry["scores"]
        trials = np.arange(scores.shape[1], dtype=float)
        mean = scores.mean(axis=0)
        if len(scores) > 1:
            sem, spread = scores.std(axis=0, ddof=1) / np.sqrt(len(scores)), f"n={len(scores)} evaluations"
        elif entry["stderr"] is not None:
            sem, spread = entry["stderr"], "band: s.e. over episodes"
        else:
            sem, spread = np.full_like(mean, np.nan), "1 evaluation"
        color = ALGORITHM_COLORS.get(inv.get(label, ""), f"C{i + 2}")
        gain = best_relative_gain(mean.tolist()) if len(mean) > 1 else None
        gain_txt = f", best gain {gain:+.0%} over trial 0" if gain is not None else ""
        _band(ax, trials, mean, sem, color, "-", f"{label} ({spread}{gain_txt})", i)
        ax.axhline(mean[0], color=color, linestyle=":", linewidth=1)
        summary[label] = {"mean": mean.tolist(), "sem": [None if np.isnan(s) else float(s) for s in sem],
                          "best_relative_gain": gain, "files": entry["files"]}
    envs = {_env_kind_of(e["env"]) for e in adapt.values()} - {None}
    kind = envs.pop() if len(envs) == 1 else kind
    tasks = sorted({str(e["task"]) for e in adapt.values() if e["task"]})
    ax.set_xlabel("trial (0: no memory; 1…K: memory on, tips from earlier trials; no weight updates)")
    ax.set_ylabel({"scienceworld": "mean episode score (points, −100…100)",
                   "webshop": "mean episode score (0…1)"}.get(kind or "", "mean episode score"))
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    where = {"scienceworld": "ScienceWorld", "webshop": "WebShop"}.get(kind or "", "")
    ax.set_title(f"OOD adaptation with memory{' on ' + where if where else ''}"
                 f"{' (' + ', '.join(tasks) + ')' if tasks else ''}\n"
                 "line: mean score per trial, band: ± 1 standard error, dotted: trial 0 level", fontsize=10)
    ax.legend(loc="best", fontsize=9)
    fig.tight_layout()
    _atomic_savefig(fig, path)
    return summary


# ---------------------------------------------------------------------------------------------------- main
def _title(runs: Sequence[Run], kind: str) -> str:
    env = {"scienceworld": "ScienceWorld", "webshop": "WebShop"}[kind]
    tasks = sorted({r.data.params.get("env/task") for r in runs} - {None, "None"})
    algos = sorted({r.data.params["algorithm/name"] for r in runs}, key=_algo_rank)
    return f"{' vs '.join(ALGORITHM_LABELS.get(a, a) for a in algos)} on {env}" + (f" ({', '.join(tasks)})"
                                                                                    if tasks else "")


def run_info(client: mlflow.MlflowClient, run: Run) -> dict[str, Any]:
    """Name, algorithm, seed, status, wall-clock minutes, iterations logged and minutes per iteration of a run."""
    iterations = len(client.get_metric_history(run.info.run_id, "iteration"))
    minutes = (run.info.end_time - run.info.start_time) / 60_000.0 if run.info.end_time else None
    return {"run_id": run.info.run_id, "name": run.info.run_name, "algorithm": run.data.params["algorithm/name"],
            "seed": run.data.params.get("seed"), "status": run.info.status, "minutes": minutes,
            "iterations": iterations,
            "minutes_per_iteration": minutes / iterations if minutes is not None and iterations else None}


def _per_iteration_sum(client: mlflow.MlflowClient, run: Run, key: str) -> float | None:
    """Mean over iterations of a timing metric summed within each iteration (e.g. ``train/update_s`` is logged once
    per optimizer step); None when the run never logged it."""
    iters = _iterations(client, run)
    hist = client.get_metric_history(run.info.run_id, key)
    if not iters or not hist:
        return None
    sums: dict[float, float] = {}
    for m in hist:
        it = _iteration_at(iters, m.timestamp)
        it = iters[0][1] if it is None else it  # logged before the first rollout: counted with it
        sums[it] = sums.get(it, 0.0) + m.value
    return float(np.mean([sums.get(it, 0.0) for _, it in iters]))


TIMING_KEYS = {"rollout": "rollout/rollout_s", "tips": "rollout/tip_write_s", "update": "train/update_s"}


def _fmt(values: Sequence[float], digits: int) -> str:
    """``mean ± s.e.`` of ``values`` (``src.evaluation.stats.mean_stderr``); the mean alone for one value."""
    from src.evaluation.stats import mean_stderr

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
    for algo in sorted({r.data.params["algorithm/name"] for r in runs}, key=_algo_rank):
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
            vals = [v for r in mine if (v := _per_iteration_sum(client, r, key)) is not None]
            timing.append(f"{np.mean(vals):.0f}" if vals else "–")
        minutes = [i["minutes"] for i in info if i["minutes"] is not None]
        score = _fmt(finals["val/score"], digits) if finals["val/score"] else "–"
        success = _fmt(finals["val/success_rate"], 2) if finals["val/success_rate"] else "–"
        lines.append(f"| {ALGORITHM_LABELS.get(algo, algo)} | {', '.join(str(i['seed']) for i in info)} | "
                     f"{np.mean([i['iterations'] for i in info]):.0f} | "
                     f"{np.mean(minutes):.0f} | {' / '.join(timing)} | {ws_txt} | {score} | {success} |")
    return "\n".join(lines) + "\n"


def log_comparison(client: mlflow.MlflowClient, experiment_id: str, files: Sequence[Path], runs: Sequence[Run],
                   name: str) -> str:
    """Create the MLflow run ``name`` in ``experiment_id``, log ``files`` as its artifacts and the compared run
    ids as parameters; return its run id."""
    run = client.create_run(experiment_id, run_name=name, tags={"empo2.kind": "comparison"})
    rid = run.info.run_id
    try:
        for algo in sorted({r.data.params["algorithm/name"] for r in runs}):
            client.log_param(rid, f"runs/{algo}",
                             ",".join(r.info.run_id for r in runs if r.data.params["algorithm/name"] == algo))
        for f in files:
            client.log_artifact(rid, str(f))
    except Exception:
        client.set_terminated(rid, status="FAILED")
        raise
    client.set_terminated(rid)
    return rid


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse ``argv``, write the figures and ``curves.json`` to ``--out-dir``, log them unless ``--no-log``.

    Returns ``{"files": [Path, ...], "comparison_run_id": str | None, "runs": [run ids]}``.
    """
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tracking-uri", default=DEFAULT_TRACKING_URI, help="MLflow store (default: %(default)s)")
    ap.add_argument("--experiment", default="empo2", help="MLflow experiment name (default: %(default)s)")
    ap.add_argument("--tag", action="append", default=[], help="keep runs whose Hydra tags include this "
                    "(repeatable: all must match)")
    ap.add_argument("--run-ids", nargs="+", default=[], help="compare exactly these runs (ignores --tag)")
    ap.add_argument("--algorithms", nargs="+", default=["grpo", "empo2"], help="algorithm/name values to keep")
    ap.add_argument("--include-unfinished", action="store_true", help="also running, failed and killed runs")
    ap.add_argument("--adaptation", nargs="+", default=[], help="adaptation summaries (eval_summary.json of "
                    "src/eval.py eval.protocol=adaptation), as PATH or LABEL=PATH")
    ap.add_argument("--out-dir", default=str(ROOT / "logs" / "comparison"), help="where the PNGs go")
    ap.add_argument("--name", default=None, help="name of the comparison MLflow run (default: comparison-<tags>)")
    ap.add_argument("--no-log", action="store_true", help="only write the files, no MLflow comparison run")
    args = ap.parse_args(argv)

    client = mlflow.MlflowClient(tracking_uri=args.tracking_uri)
    runs = select_runs(client, args.experiment, args.tag, args.run_ids, args.algorithms, args.include_unfinished)
    kind = env_kind(runs)
    for r in runs:
        log.info("run %s %s (%s)", r.info.run_id, r.info.run_name, r.info.status)
    out = Path(args.out_dir)
    data = collect(client, runs)
    title = _title(runs, kind)
    files = [out / "learning_curves_iteration.png", out / "learning_curves_wallclock.png"]
    aggs = plot_learning_curves(data, kind, "iteration", title, files[0])
    plot_learning_curves(data, kind, "minutes", title, files[1])
    report: dict[str, Any] = {
        "env": kind, "title": title, "tracking_uri": args.tracking_uri,
        "runs": {a: [r.info.run_id for r in runs if r.data.params["algorithm/name"] == a] for a in data},
        "run_info": [run_info(client, r) for r in runs],
        "curves": {a: {k: agg.to_json() for k, agg in per.items()} for a, per in aggs.items()},
    }
    if args.adaptation:
        adapt = load_adaptation(args.adaptation)
        files.append(out / "adaptation.png")
        report["adaptation"] = plot_adaptation(adapt, kind, files[-1])
    files.append(out / "results.md")
    _atomic_write_text(files[-1], results_table(client, runs, kind))
    files.append(out / "curves.json")
    _atomic_write_text(files[-1], json.dumps(report, indent=1))
    run_id = None
    if not args.no_log:
        name = args.name or "comparison-" + ("-".join(args.tag) if args.tag else "runs")
        run_id = log_comparison(client, runs[0].info.experiment_id, files, runs, name)
        print(f"logged {len(files)} artifacts to MLflow run {name} ({run_id})")
    for f in files:
        print(f"wrote {f}")
    return {"files": files, "comparison_run_id": run_id, "runs": [r.info.run_id for r in runs]}


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        main()
    except ValueError as e:
        sys.exit(f"compare_runs: {e}")
