"""Held-out results one episode per row, so that paired differences between runs can be recomputed from files.

A training run writes ``<run dir>/validation_episodes.csv`` (and, with the MLflow logger, the same file as the
run's artifact): one row per validation episode, every validation of the run (column ``iteration``: the number of
RL iterations the policy had trained when it played). ``scripts/compare_runs.py`` copies each compared run's
file to ``<out-dir>/episodes/<algorithm>-seed<seed>.csv`` and computes, from those files alone
(``--episodes-dir``), the paired differences between algorithms (``paired_differences``).

Units: ``score`` in the environment's units (ScienceWorld points −100..100, WebShop and TextWorldExpress [0, 1]);
``success`` 0/1.
"""
from __future__ import annotations

import csv
import math
import re
import statistics
from pathlib import Path
from typing import Any, Sequence

from src.evaluation.stats import mean_stderr
# the writer (episode_rows, append_rows) sits with the tracking helpers, where the validation step reaches it
from src.utils.logging import EPISODE_COLUMNS as COLUMNS, EPISODES_FILE as FILE, append_rows  # noqa: F401

RUN_FILE = re.compile(r"^(?P<algorithm>.+)-seed(?P<seed>-?\d+)\.csv$")


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a file written by ``append_rows``, typed (ints, float score).

    Raises:
        ValueError: the file lacks one of ``COLUMNS``.
    """
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: not a validation-episodes file, it lacks the columns {missing}")
        return [{c: (str if c == "task" else float if c == "score" else int)(r[c]) for c in COLUMNS} for r in reader]


def read_runs(directory: str | Path) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """``{algorithm: {seed: rows}}`` from the ``<algorithm>-seed<seed>.csv`` files of ``directory``.

    Raises:
        ValueError: no such file in ``directory``.
    """
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for path in sorted(Path(directory).glob("*.csv")):
        m = RUN_FILE.match(path.name)
        if m:
            runs.setdefault(m["algorithm"], {})[int(m["seed"])] = read_rows(path)
    if not runs:
        raise ValueError(f"no <algorithm>-seed<seed>.csv file in {directory}")
    return runs


def last_validation(rows: Sequence[dict[str, Any]]) -> tuple[int, dict[tuple[str, int], float]]:
    """The last validation's iteration and its scores by ``(task, episode)``, failed episodes left out.

    Raises:
        ValueError: no rows.
    """
    if not rows:
        raise ValueError("a run without validation episodes")
    last = max(r["iteration"] for r in rows)
    return last, {(r["task"], r["episode"]): r["score"] for r in rows if r["iteration"] == last and not r["failed"]}


def paired_differences(a: dict[int, list[dict]], b: dict[int, list[dict]]) -> dict[str, Any]:
    """Held-out score of algorithm ``a`` minus ``b`` at each run's last validation, two ways.

    ``a``/``b``: ``{training seed: rows}``. Only the episodes (task, episode index) that every run of both played
    without failing count, so each run's mean is over the same episodes.

    - ``seed_level``: the difference of the means over training seeds of the per-run mean score, with the standard
      error ``sqrt(s_a²/n_a + s_b²/n_b)`` of the per-run means (Bessel-corrected): the spread between training seeds
      and the evaluation noise both.
    - ``paired_by_episode``: per episode, the mean over ``a``'s runs minus the mean over ``b``'s, then mean ± s.e.
      over episodes: the evaluation noise alone, given these runs.

    Also returns the per-run means (``runs_a``/``runs_b``: ``{seed: mean}``) and the iterations validated last.

    Raises:
        ValueError: an algorithm without runs, or no episode common to all runs.
    """
    if not a or not b:
        raise ValueError(f"need runs of both algorithms, got {len(a)} and {len(b)}")
    last = {side: {s: last_validation(rows) for s, rows in runs.items()} for side, runs in (("a", a), ("b", b))}
    common = set.intersection(*(set(scores) for per in last.values() for _, scores in per.values()))
    if not common:
        raise ValueError("no held-out episode was played by every run")
    keys = sorted(common)
    means = {side: {s: statistics.fmean(sc[k] for k in keys) for s, (_, sc) in per.items()}
             for side, per in last.items()}
    sa, sb = (mean_stderr(list(means[side].values())) for side in ("a", "b"))
    per_episode = [statistics.fmean(sc[k] for _, sc in last["a"].values())
                   - statistics.fmean(sc[k] for _, sc in last["b"].values()) for k in keys]
    seed_se = None if None in (sa["stderr"], sb["stderr"]) else math.hypot(sa["stderr"], sb["stderr"])
    return {
        "seed_level": {"mean": sa["mean"] - sb["mean"], "stderr": seed_se, "n_seeds": [sa["n"], sb["n"]]},
        "paired_by_episode": mean_stderr(per_episode),
        "runs_a": means["a"], "runs_b": means["b"],
        "iterations": sorted({it for per in last.values() for it, _ in per.values()}),
        "episodes": len(keys),
    }
