"""Compare GRPO and EMPO² training runs from an MLflow store: learning curves and the adaptation curve as PNGs.

    python scripts/compare_runs.py --tag scienceworld                         # finished runs tagged scienceworld
    python scripts/compare_runs.py --tag study-20261130-011000 --out-dir logs/comparison/study
    python scripts/compare_runs.py --run-ids <id> <id> ... --no-log           # no comparison run in MLflow
    python scripts/compare_runs.py --tag scienceworld --adaptation logs/eval/a.json logs/eval/b.json

Trains nothing (training is launched by `scripts/run_study.py`); the work is done by `studies/comparison/`.
It writes to the store only the comparison run and the runs it imports from records (below). Runs are grouped by
`algorithm/name`; several seeds give the mean and a ± standard-error band (std with Bessel correction / sqrt(n)).
Writes to `--out-dir`:

- `learning_curves_iteration.png`: rollout return, score and success rate (solid) and validation score and success
  rate (dashed) against the number of training iterations the policy had completed when it played: the rollout of
  iteration k used the policy after k iterations, the validation after iteration k the policy after k + 1.
- `learning_curves_wallclock.png`: the same points against wall-clock minutes since each run's start (x: the mean
  over seeds of the time at which the point was logged).
- `adaptation.png` (with `--adaptation`): score per trial of the OOD adaptation protocol
  (docs/evaluation.md#the-adaptation-protocol).
- `results.md`: the results table (``results_table``): warm start, final held-out score and success per
  algorithm (mean ± s.e. over seeds), iterations, wall-clock and seconds per iteration.
- `iterations.md`: one row per run and iteration (``iterations_table``): update mode, rollout score, groups without
  signal, groups ranked by the novelty bonus alone, approx_kl, clip and masked fractions, tips written, tips that
  are actions, retrieval hit rate.
- `curves.json`: the plotted numbers.
- `episodes/<algorithm>-seed<seed>.csv`: each run's `validation_episodes.csv` (every validation episode: iteration,
  task, episode, score, success), and `paired.md` / `paired.json`: the held-out score of each algorithm minus each
  other at the runs' last validation, seed-level (± the spread between training seeds) and paired by episode
  (± evaluation noise). `--episodes-dir DIR` recomputes `paired.md` / `paired.json` from such files alone (no
  MLflow store needed): the committed results can be checked from the repository.
- `runs/<algorithm>-seed<seed>.json`: each run's record (parameters, tags, every metric's history;
  `studies/comparison/records.py`). Records in `--out-dir`/runs whose runs the store lacks are imported
  before the runs are selected, so a study continued in another session or on another machine compares all its
  runs: commit the study directory, and the next comparison sees the earlier runs.

and logs them as artifacts of a new MLflow run `comparison-...` in the experiment of the compared runs.
Units come from the runs' `env/_target_`: ScienceWorld scores are points (−100..100), WebShop scores are in [0, 1].
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, Sequence

import mlflow
from mlflow.entities import Run

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python scripts/compare_runs.py` from anywhere: src.* is importable

from studies.comparison.adaptation import load_adaptation  # noqa: E402
from studies.comparison.figures import plot_adaptation, plot_learning_curves  # noqa: E402
from studies.comparison.records import (import_records, original_run_id, record_names,  # noqa: E402
                                               write_records)
from studies.comparison.runs import (ALGORITHM_LABELS, collect, comparison_title, run_environment,  # noqa: E402
                                           run_info, select_runs)
from studies.comparison.table import iterations_table, paired_table, results_table  # noqa: E402
from studies.episode_table import FILE as EPISODE_FILE  # noqa: E402
from studies.episode_table import read_rows, read_runs  # noqa: E402
from src.utils.io import write_json_atomic, write_text_atomic  # noqa: E402

log = logging.getLogger("compare_runs")

DEFAULT_TRACKING_URI = f"sqlite:///{ROOT}/logs/mlflow.db"


def log_comparison(client: mlflow.MlflowClient, experiment_id: str, files: Sequence[Path], runs: Sequence[Run],
                   name: str) -> str:
    """Create the MLflow run ``name`` in ``experiment_id``, log ``files`` as its artifacts and the compared run
    ids as parameters; return its run id."""
    run = client.create_run(experiment_id, run_name=name, tags={"empo2.kind": "comparison"})
    rid = run.info.run_id
    try:
        for algo in sorted({r.data.params["algorithm/name"] for r in runs}):
            client.log_param(rid, f"runs/{algo}",
                             ",".join(original_run_id(r) for r in runs if r.data.params["algorithm/name"] == algo))
        for f in files:  # run records under runs/, as in the out dir
            client.log_artifact(rid, str(f), artifact_path="runs" if f.parent.name == "runs" else None)
    except Exception:
        client.set_terminated(rid, status="FAILED")
        raise
    client.set_terminated(rid)
    return rid


def copy_episode_files(client: mlflow.MlflowClient, runs: Sequence[Run],
                       directory: Path) -> dict[str, dict[int, list[dict]]]:
    """Download each run's ``validation_episodes.csv`` artifact to ``directory/<algorithm>-seed<seed>.csv``;
    return ``{algorithm: {seed: rows}}`` of the runs that have one (a warning names those that do not)."""
    import shutil
    import tempfile

    out: dict[str, dict[int, list[dict]]] = {}
    for r in runs:
        algo, seed = r.data.params["algorithm/name"], int(r.data.params.get("seed", 0))
        with tempfile.TemporaryDirectory() as tmp:
            try:
                path = client.download_artifacts(r.info.run_id, EPISODE_FILE, tmp)
            except Exception:  # an older run, or one stopped before its first validation
                log.warning("run %s has no %s: left out of the paired differences", r.info.run_id, EPISODE_FILE)
                continue
            if seed in out.get(algo, {}):
                raise ValueError(f"two {algo} runs with seed {seed}: select one (--run-ids)")
            directory.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, directory / f"{algo}-seed{seed}.csv")
        out.setdefault(algo, {})[seed] = read_rows(directory / f"{algo}-seed{seed}.csv")
    return out


def write_paired(episodes: dict[str, dict[int, list[dict]]], out: Path, env=None) -> list[Path]:
    """``paired.md`` and ``paired.json`` in ``out`` (``studies.comparison.table.paired_table``)."""
    digits, unit = (3, "") if env is None else (3 if env.max_score <= 1 else 1, env.score_unit)
    text, numbers = paired_table(episodes, digits, unit)
    write_text_atomic(out / "paired.md", text)
    write_json_atomic(out / "paired.json", numbers, indent=1)
    return [out / "paired.md", out / "paired.json"]


def paired_files(client: mlflow.MlflowClient, runs: Sequence[Run], out: Path, env) -> list[Path]:
    """The runs' per-episode files in ``out/episodes/`` and, where two algorithms have them, ``paired.md`` and
    ``paired.json`` (``write_paired``); returns the paired files written."""
    episodes = copy_episode_files(client, runs, out / "episodes")
    return write_paired(episodes, out, env) if len(episodes) >= 2 else []


def build_parser() -> argparse.ArgumentParser:
    """The command line of this script (its docstring is the help text)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tracking-uri", default=DEFAULT_TRACKING_URI, help="MLflow store (default: %(default)s)")
    ap.add_argument("--experiment", default="empo2", help="MLflow experiment name (default: %(default)s)")
    ap.add_argument("--tag", action="append", default=[], help="keep runs whose Hydra tags include this "
                    "(repeatable: all must match)")
    ap.add_argument("--run-ids", nargs="+", default=[], help="compare exactly these runs (ignores --tag)")
    ap.add_argument("--algorithms", nargs="+", default=list(ALGORITHM_LABELS),
                    help="algorithm/name values to keep")
    ap.add_argument("--include-unfinished", action="store_true", help="also running, failed and killed runs")
    ap.add_argument("--adaptation", nargs="+", default=[], help="adaptation summaries (eval_summary.json of "
                    "src/eval.py eval.protocol=adaptation), as PATH or LABEL=PATH")
    ap.add_argument("--out-dir", default=str(ROOT / "logs" / "comparison"), help="where the PNGs go")
    ap.add_argument("--name", default=None, help="name of the comparison MLflow run (default: comparison-<tags>)")
    ap.add_argument("--no-log", action="store_true", help="no MLflow comparison run (records are still imported)")
    ap.add_argument("--episodes-dir", default=None, help="only recompute paired.md / paired.json from the "
                    "<algorithm>-seed<seed>.csv files of this directory (no MLflow)")
    return ap


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse ``argv``, write the figures and ``curves.json`` to ``--out-dir``, log them unless ``--no-log``.

    Returns ``{"files": [Path, ...], "comparison_run_id": str | None, "runs": [run ids]}``.
    """
    args = build_parser().parse_args(argv)
    out = Path(args.out_dir)
    if args.episodes_dir:
        files = write_paired(read_runs(args.episodes_dir), out)
        for f in files:
            print(f"wrote {f}")
        return {"files": files, "comparison_run_id": None, "runs": []}

    client = mlflow.MlflowClient(tracking_uri=args.tracking_uri)
    if (out / "runs").is_dir():  # a study continued from another store (records.py)
        imported = import_records(client, args.experiment, out / "runs", out / "episodes")
        if imported:
            log.info("imported %d run record(s) from %s that this store lacked", len(imported), out / "runs")
    runs = select_runs(client, args.experiment, args.tag, args.run_ids, args.algorithms, args.include_unfinished)
    record_names(runs)  # two runs of one algorithm and seed: refused before any file is written
    env = run_environment(runs)
    for r in runs:
        log.info("run %s %s (%s)", r.info.run_id, r.info.run_name, r.info.status)
    data = collect(client, runs)
    title = comparison_title(runs, env)
    files = [out / "learning_curves_iteration.png", out / "learning_curves_wallclock.png"]
    aggs = plot_learning_curves(data, env, "iteration", title, files[0])
    plot_learning_curves(data, env, "minutes", title, files[1])
    report: dict[str, Any] = {
        "env": env.display_name, "title": title, "tracking_uri": args.tracking_uri,
        "runs": {a: [original_run_id(r) for r in runs if r.data.params["algorithm/name"] == a] for a in data},
        "run_info": [run_info(client, r) for r in runs],
        "curves": {a: {k: agg.to_json() for k, agg in per.items()} for a, per in aggs.items()},
    }
    if args.adaptation:
        adapt = load_adaptation(args.adaptation)
        files.append(out / "adaptation.png")
        report["adaptation"] = plot_adaptation(adapt, env, files[-1])
    files.append(out / "results.md")
    write_text_atomic(files[-1], results_table(client, runs, env))
    files.append(out / "iterations.md")
    write_text_atomic(files[-1], iterations_table(client, runs, env))
    files += paired_files(client, runs, out, env)
    files += write_records(client, runs, out / "runs")
    files.append(out / "curves.json")
    write_text_atomic(files[-1], json.dumps(report, indent=1))
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
