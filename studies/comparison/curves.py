"""A metric's points per run (``Curve``) and their mean ± standard error over runs, per iteration (``Aggregate``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


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


def curve_from_points(points: list[tuple[float, float, float]]) -> Curve:
    """A ``Curve`` from ``(iteration, minutes, value)`` points, sorted by iteration (``points`` is sorted in place)."""
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
