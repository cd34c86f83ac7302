"""Print the tips a training run wrote and retrieved, iteration by iteration (the tables of src/callbacks/tip_tables.py).

    python scripts/show_tips.py logs/train/runs/<run>                 # a run directory: every iteration
    python scripts/show_tips.py <MLflow run id> --iteration 1         # an MLflow run (logs/mlflow.db by default)
    python scripts/show_tips.py <run> --iteration 1 --table retrieved --limit 5

Written tips are grouped by episode (one reflection per episode, stored once per step with that step's action);
retrieved tips by the prompt (episode, step) they were put into, best rank first.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PROJECT_ROOT", str(ROOT))
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # the download is a few kB

from src.callbacks.tip_tables import DIRECTORY, TABLES, read_table  # noqa: E402

FILE = re.compile(r"iteration_(\d+)_(written|retrieved)\.json$")


def table_files(source: str, tracking_uri: str, into: Path) -> dict[tuple[int, str], Path]:
    """``{(iteration, table): file}`` of a run directory, or of an MLflow run's artifacts (downloaded into ``into``).

    Raises:
        SystemExit: neither a directory with tip tables nor an MLflow run that has them.
    """
    path = Path(source)
    if path.is_dir():
        folder = path if path.name == DIRECTORY else path / DIRECTORY
        if not folder.is_dir():
            raise SystemExit(f"{path} has no {DIRECTORY}/ folder: not a training run directory, or a run from before "
                             "tip tables were logged, or a run without memory (algorithm=grpo)")
    elif os.sep in source or source.startswith("."):
        raise SystemExit(f"no directory {source!r} (expected a run directory such as logs/train/runs/<run>, or an "
                         "MLflow run id)")
    else:
        import mlflow

        store = tracking_uri.removeprefix("sqlite:///")
        if tracking_uri.startswith("sqlite:///") and not Path(store).is_file():
            raise SystemExit(f"no MLflow store at {store} (--tracking-uri {tracking_uri})")
        try:
            client = mlflow.MlflowClient(tracking_uri=tracking_uri)
            client.get_run(source)
        except Exception as err:  # noqa: BLE001 - MLflow raises its own exception types
            raise SystemExit(f"{source!r} is neither a directory nor a run id in {tracking_uri} ({err})") from err
        if not client.list_artifacts(source, DIRECTORY):
            raise SystemExit(f"MLflow run {source} has no {DIRECTORY}/ artifacts (a run without memory, or from "
                             "before tip tables were logged)")
        folder = Path(client.download_artifacts(source, DIRECTORY, str(into)))
    found = {}
    for f in folder.iterdir():
        m = FILE.search(f.name)
        if m:
            found[int(m.group(1)), m.group(2)] = f
    return found


def show_written(rows: list[dict], limit: int | None) -> None:
    episodes: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        episodes[row["partition"], row["episode"], row["tip"]].append(row)
    print(f"  {len(rows)} entries written, {len(episodes)} reflections")
    for (partition, episode, tip), steps in list(episodes.items())[:limit]:
        first = steps[0]
        print(f"  {partition}  episode {episode}  score {first['episode_score']:g}/{first['max_score']:g}")
        print(f"    tip: {tip}")
        print("    steps: " + "; ".join(f"{s['step']}: {s['action']}" for s in steps))


def show_retrieved(rows: list[dict], limit: int | None) -> None:
    prompts: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        prompts[row["partition"], row["episode"], row["step"]].append(row)
    print(f"  {len(rows)} tips shown in {len(prompts)} prompts")
    for (partition, episode, step), tips in list(prompts.items())[:limit]:
        print(f"  {partition}  episode {episode}  step {step}: {len(tips)} tips")
        for t in sorted(tips, key=lambda r: r["rank"]):
            print(f"    #{t['rank']} cos {t['similarity']:.3f}, stored score {t['tip_score']:g} (written in iteration "
                  f"{t['tip_iteration']}, step {t['tip_step']}): {t['content']}")


def positive(text: str) -> int:
    """An argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="a run directory (logs/train/runs/<run>) or an MLflow run id")
    ap.add_argument("--iteration", type=int, default=None, help="only this iteration (default: all)")
    ap.add_argument("--table", choices=[*TABLES, "both"], default="both")
    ap.add_argument("--limit", type=positive, default=None, help="at most this many episodes / prompts per table")
    ap.add_argument("--tracking-uri", default=f"sqlite:///{ROOT / 'logs' / 'mlflow.db'}")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = table_files(args.source, args.tracking_uri, Path(tmp))
        iterations = sorted({it for it, _ in files})
        if args.iteration is not None:
            if args.iteration not in iterations:
                raise SystemExit(f"no tip tables for iteration {args.iteration}; the run has {iterations}")
            iterations = [args.iteration]
        if not iterations:
            raise SystemExit(f"{args.source}: no tip tables in its {DIRECTORY}/ folder")
        for it in iterations:
            for table in TABLES if args.table == "both" else [args.table]:
                if (it, table) not in files:  # empty tables are not written
                    print(f"iteration {it}, {table}: none" + (" (an on_policy iteration, or nothing in the memory "
                                                               "was close enough)" if table == "retrieved" else ""))
                    continue
                try:
                    rows = read_table(files[it, table])
                except ValueError as err:
                    raise SystemExit(str(err)) from err
                print(f"iteration {it} ({rows[0]['mode'] if rows else '?'}), {table}:")
                (show_written if table == "written" else show_retrieved)(rows, args.limit)


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:  # the reader stopped (| head): quiet, as a Unix tool is
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
