"""Generate ScienceWorld gold trajectories offline and cache them as JSON (docs/environments.md#scienceworld).

Asking the simulator for a gold path slows every later reset of that JVM, so this runs in its own process;
training and SFT read the cache with ``src.envs.scienceworld_gold.load_gold``. Each path is replayed through
``ScienceWorldEnv`` and stored with the observations the agent sees, rewards, scores and a success flag.

    python scripts/cache_gold_trajectories.py --task find-non-living-thing 4-1 --split train \
        --num-variations 5 --out-dir data/scienceworld_gold

Writes (merging into an existing file) ``<out-dir>/<task_name>.json`` and logs each task's gold-path lengths against
its default action cap (the table of ``src/envs/scienceworld_gold_lengths.py`` comes from this output).
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a plain script from any directory

from src.envs.scienceworld import ScienceWorldEnv  # noqa: E402
from src.envs.scienceworld_tasks import default_max_steps, resolve_task  # noqa: E402
from src.envs.scienceworld_gold import generate_gold, save_gold  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", nargs="+", required=True,
                        help="task(s): alphabetical index, paper id like 3-1, or name")
    parser.add_argument("--split", choices=["train", "dev", "test"], default="train")
    parser.add_argument("--num-variations", type=int, default=None,
                        help="first N variations of the split (default: 5 for train, 20 for dev/test)")
    parser.add_argument("--variations", type=int, nargs="+", default=None,
                        help="explicit variation indices (overrides --split/--num-variations)")
    parser.add_argument("--simplification", default="easy")
    parser.add_argument("--out-dir", default="data/scienceworld_gold")
    parser.add_argument("--jvm-heap", default="768m")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    for noisy in ("py4j", "scienceworld"):  # per-JVM and per-load INFO lines
        logging.getLogger(noisy).setLevel(logging.WARNING)

    try:
        names = [resolve_task(t) for t in args.task]
    except ValueError as exc:
        parser.error(str(exc))
    if args.num_variations is not None and args.num_variations < 1:
        parser.error(f"--num-variations={args.num_variations}: expected a positive count")
    n = args.num_variations if args.num_variations is not None else (5 if args.split == "train" else 20)

    if args.variations is not None:
        tasks = [{"task_name": name, "variation": v} for name in names for v in args.variations]
    else:
        # The split lists come from the simulator; this env's JVM never makes gold paths.
        lister = ScienceWorldEnv(names, simplification=args.simplification, num_train_variations=n,
                                 num_test_variations=n, jvm_heap=args.jvm_heap)
        try:
            tasks = lister.tasks(args.split)
        finally:
            lister.close()
    start = time.perf_counter()
    records = generate_gold(tasks, simplification=args.simplification, jvm_heap=args.jvm_heap)
    paths = save_gold(args.out_dir, records)
    ok = sum(r["success"] for r in records)
    logging.info("%d/%d gold paths replay to success (%.1f s) -> %s", ok, len(records),
                 time.perf_counter() - start, ", ".join(map(str, paths)))
    lengths: dict[str, list[int]] = {}
    for r in records:
        lengths.setdefault(r["task_name"], []).append(len(r["observations"]))
    for name, n in lengths.items():
        cap = default_max_steps(name)
        logging.info("%s: gold path %d-%d actions, default cap %d%s", name, min(n), max(n), cap,
                     "  <- longer than the cap" if max(n) > cap else "")
    for r in records:
        if not r["success"]:
            logging.warning("no success: %s variation %d (score %s)", r["task_name"], r["variation"],
                            r["final_score"])
    return 0 if ok == len(records) else 1


if __name__ == "__main__":
    sys.exit(main())
