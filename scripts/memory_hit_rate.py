"""Measure the tip memory's retrieval hit rate under each memory partition.

    python scripts/memory_hit_rate.py                                   # WebShop, tiny policy, 4 iterations
    python scripts/memory_hit_rate.py --iterations 6 model=smollm2      # extra Hydra overrides go last

Trains with ``src/train.py``'s ``train`` (every iteration a memory iteration: ``algorithm.memory_rollout_prob=1``,
CSV logger, no validation) once per partition and prints ``memory/hit_rate`` (fraction of the rollout's memory
queries that retrieved at least one tip) per iteration. Iteration 0 starts from an empty memory, so its hit rate
is 0 whatever the partition. Logs and checkpoints go to a temporary directory.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PROJECT_ROOT", str(ROOT))


def hit_rates(experiment: str, partition: str, iterations: int, overrides: list[str], out: Path) -> list[float]:
    """``memory/hit_rate`` of each iteration of one run."""
    from hydra import compose, initialize_config_dir

    from src.train import train

    run_dir = out / partition
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            f"experiment={experiment}", "model=tiny", "logger=csv", "data.val=null", f"memory.partition={partition}",
            "algorithm.memory_rollout_prob=1.0", f"trainer.max_epochs={iterations}", "~callbacks.rich_progress_bar",
            "trainer.enable_progress_bar=false", f"paths.output_dir={run_dir}", f"paths.log_dir={out}/logs",
            *overrides])
    train(cfg)
    rows = list(csv.DictReader(open(next(run_dir.rglob("metrics.csv")))))
    return [float(r["rollout/memory/hit_rate"]) for r in rows if r.get("rollout/memory/hit_rate")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", default="webshop")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--partitions", nargs="+", default=["variation", "task"])
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. model=smollm2 seed=1")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {p: hit_rates(args.experiment, p, args.iterations, args.overrides, Path(tmp))
                   for p in args.partitions}
    print(f"\nmemory/hit_rate per iteration ({args.experiment}, {args.iterations} memory iterations, "
          f"overrides {args.overrides or 'none'}):")
    for partition, rates in results.items():
        later = rates[1:]
        mean = sum(later) / len(later) if later else float("nan")
        print(f"  {partition:>9}: {' '.join(f'{r:.2f}' for r in rates)}   (mean after iteration 0: {mean:.2f})")


if __name__ == "__main__":
    main()
