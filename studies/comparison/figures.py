"""The comparison's figures: learning curves (against iterations or wall-clock minutes) and the adaptation curve."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from studies.comparison.adaptation import environment_of_target  # noqa: E402
from studies.comparison.curves import Aggregate, Curve, aggregate  # noqa: E402
from studies.comparison.runs import ALGORITHM_LABELS, ROLLOUT_KEYS, VAL_KEYS, algorithm_rank  # noqa: E402
from src.evaluation.stats import best_relative_gain  # noqa: E402
from src.utils.io import atomic_file  # noqa: E402

ALGORITHM_COLORS = {"grpo": "tab:blue", "empo2": "tab:orange", "empo2_authors": "tab:red"}
FIGSIZE, DPI = (16.0, 5.0), 110  # learning-curve figures: 1760 x 550 pixels
ADAPT_FIGSIZE = (8.0, 5.0)       # adaptation figure: 880 x 550 pixels


def units(env) -> dict[str, str]:
    """Axis labels per metric for an ``Environment`` class (its score unit: ScienceWorld points, WebShop [0, 1])."""
    return {"rollout/return": "episode return (Σ reward; EMPO² adds the novelty bonus)",
            "rollout/score": f"episode score ({env.score_unit})",
            "rollout/success_rate": "success rate (fraction of episodes, 0…1)"}


def _save(fig: plt.Figure, path: Path) -> None:
    """Write ``fig`` as a PNG to ``path`` atomically (``src.utils.io.atomic_file``) and close it."""
    try:
        with atomic_file(path, "wb") as f:
            fig.savefig(f, dpi=DPI, format="png")
    finally:
        plt.close(fig)


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


def plot_learning_curves(data: dict[str, dict[str, list[Curve]]], env, x_axis: str, title: str,
                         path: Path) -> dict[str, dict[str, Aggregate]]:
    """Three panels (return, score, success rate) for ``x_axis`` ``"iteration"`` or ``"minutes"``; each algorithm
    in its colour, training rollouts solid, validation dashed, single seeds as faint dots. Returns the aggregates.
    """
    if x_axis not in ("iteration", "minutes"):
        raise ValueError(f"x_axis={x_axis!r}: expected 'iteration' or 'minutes'")
    labels = units(env)
    # shared x: validation points sit one iteration past the last rollout, all panels should line up
    fig, axes = plt.subplots(1, 3, figsize=FIGSIZE, dpi=DPI, sharex=True)
    aggs: dict[str, dict[str, Aggregate]] = {}
    for ax, key in zip(axes, ROLLOUT_KEYS):
        for rank, algo in enumerate(sorted(data, key=algorithm_rank)):
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
        if key == "rollout/success_rate" or (env.max_score == 1.0 and key == "rollout/score"):
            ax.set_ylim(-0.03, 1.03)
        if x_axis == "iteration":
            ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    if x_axis == "minutes":  # after all panels are drawn: fixing a limit earlier would freeze the shared x range
        axes[0].set_xlim(left=0)
    legend: dict[str, Any] = {}  # one legend for the figure, each entry once
    for ax in axes:
        for h, n in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(n, h)
    fig.suptitle(title + "  —  line: mean over seeds, band / bars: ± 1 standard error, dots: single seeds")
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=min(len(legend), 4), frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    _save(fig, path)
    return aggs


def plot_adaptation(adapt: dict[str, dict[str, Any]], env, path: Path) -> dict[str, Any]:
    """Score per trial (trial 0 without memory, then memory trials) per label.

    Band: ± standard error over files with one label, or, for a single file, the summary's own per-trial
    standard error over its episodes (and seeds). Units from the summaries' ``env`` (else ``env``, an ``Environment``
    class or None). Returns ``{label: {"mean": [...], "sem": [...], "best_relative_gain": float | None, "files":
    [...]}}``, the gain as ``src.evaluation.stats.best_relative_gain`` defines it.
    """
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
    envs = {environment_of_target(e["env"]) for e in adapt.values()} - {None}
    env = envs.pop() if len(envs) == 1 else env
    tasks = sorted({str(e["task"]) for e in adapt.values() if e["task"]})
    ax.set_xlabel("trial (0: no memory; 1…K: memory on, tips from earlier trials; no weight updates)")
    ax.set_ylabel(f"mean episode score ({env.score_unit})" if env else "mean episode score")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    where = env.display_name if env else ""
    ax.set_title(f"OOD adaptation with memory{' on ' + where if where else ''}"
                 f"{' (' + ', '.join(tasks) + ')' if tasks else ''}\n"
                 "line: mean score per trial, band: ± 1 standard error, dotted: trial 0 level", fontsize=10)
    ax.legend(loc="best", fontsize=9)
    fig.tight_layout()
    _save(fig, path)
    return summary
