"""Per-episode held-out files and the paired differences recomputed from them (studies/episode_table.py,
scripts/compare_runs.py --episodes-dir): known answers computed by hand."""
import json
import math

import pytest

from studies.episode_table import (COLUMNS, append_rows, paired_differences, read_rows, read_runs)


def _rows(iteration, scores, failed=()):
    return [{"iteration": iteration, "task": f'{{"variation": {i}}}', "episode": i, "score": s, "success": int(s > 0),
             "steps": 3, "failed": int(i in failed)} for i, s in enumerate(scores)]


# scores on tasks 0..3 at the last validation (iteration 10); task 3 failed in one run, so it is left out everywhere;
# iteration 5's rows (all zero) must be ignored
RUNS = {
    "empo2": {0: _rows(5, [0, 0, 0, 0]) + _rows(10, [1, 0, 1, 1], failed=(3,)), 1: _rows(10, [1, 1, 1, 0])},
    "grpo": {0: _rows(5, [0, 0, 0, 0]) + _rows(10, [0, 0, 1, 1]), 1: _rows(10, [1, 0, 1, 0])},
}


def test_paired_differences_known_answer():
    d = paired_differences(RUNS["empo2"], RUNS["grpo"])
    # per-run means over tasks 0-2: empo2 2/3 and 1, grpo 1/3 and 2/3
    assert d["runs_a"] == pytest.approx({0: 2 / 3, 1: 1.0}) and d["runs_b"] == pytest.approx({0: 1 / 3, 1: 2 / 3})
    assert d["episodes"] == 3 and d["iterations"] == [10]
    # seed level: 5/6 - 1/2; each side's variance of the means is 1/18, over 2 seeds 1/36
    assert d["seed_level"]["mean"] == pytest.approx(1 / 3)
    assert d["seed_level"]["stderr"] == pytest.approx(math.sqrt(2) / 6)
    assert d["seed_level"]["n_seeds"] == [2, 2]
    # by episode: empo2 per task (1, 1/2, 1) minus grpo (1/2, 0, 1) = (1/2, 1/2, 0): mean 1/3, s.e. 1/6
    assert d["paired_by_episode"]["mean"] == pytest.approx(1 / 3)
    assert d["paired_by_episode"]["stderr"] == pytest.approx(1 / 6)


def test_paired_differences_refuses_runs_without_common_episodes():
    with pytest.raises(ValueError, match="both algorithms"):
        paired_differences(RUNS["empo2"], {})
    with pytest.raises(ValueError, match="every run"):
        paired_differences({0: _rows(1, [1], failed=(0,))}, {0: _rows(1, [1])})


def test_rows_round_trip_through_the_file(tmp_path):
    path = tmp_path / "run" / "validation_episodes.csv"
    append_rows(path, RUNS["empo2"][0][:4])
    append_rows(path, RUNS["empo2"][0][4:])
    text = path.read_text()
    assert text.count("iteration,") == 1 and text.splitlines()[0] == ",".join(COLUMNS)
    assert read_rows(path) == RUNS["empo2"][0]
    (tmp_path / "bad.csv").write_text("task,score\nx,1\n")
    with pytest.raises(ValueError, match="lacks the columns"):
        read_rows(tmp_path / "bad.csv")


def test_compare_runs_recomputes_the_pairs_from_the_files(tmp_path):
    from scripts import compare_runs

    for algo, runs in RUNS.items():
        for seed, rows in runs.items():
            append_rows(tmp_path / "episodes" / f"{algo}-seed{seed}.csv", rows)
    assert set(read_runs(tmp_path / "episodes")) == {"empo2", "grpo"}
    compare_runs.main(["--episodes-dir", str(tmp_path / "episodes"), "--out-dir", str(tmp_path / "out")])
    numbers = json.loads((tmp_path / "out" / "paired.json").read_text())
    assert numbers["empo2-grpo"]["seed_level"]["mean"] == pytest.approx(1 / 3)
    table = (tmp_path / "out" / "paired.md").read_text()
    assert "| EMPO² − GRPO | 2 vs 2 | 3 | +0.333 ± 0.236 | +0.333 ± 0.167 | 0.667, 1.000 vs 0.333, 0.667 |" in table
