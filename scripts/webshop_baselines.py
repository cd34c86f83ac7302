"""Score the scripted expert and the random clicker on WebShop goals (sanity check of env + reward).

Usage:
    python scripts/webshop_baselines.py                      # generated catalog, all 500 test goals
    python scripts/webshop_baselines.py --n 100 --split train
    python scripts/webshop_baselines.py --real-data-dir /path/to/webshop/data   # the original files

Prints mean score (in [0, 1]) and success rate (score == 1) for each policy, plus data/index timings.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from src.envs.webshop import WebShopEnv  # noqa: E402
from src.envs.webshop.baselines import ExpertPolicy, RandomPolicy, run_policy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default="data/webshop", help="generated catalog + index cache directory")
    ap.add_argument("--real-data-dir", default=None, help="directory with the original WebShop files")
    ap.add_argument("--split", default="test", choices=["train", "dev", "test"])
    ap.add_argument("--n", type=int, default=None, help="number of goals (default: the whole split)")
    ap.add_argument("--catalog-size", type=int, default=1000)
    ap.add_argument("--catalog-seed", type=int, default=0)
    ap.add_argument("--synthetic-goals", action="store_true", help="synthetic instead of human goals")
    ap.add_argument("--seed", type=int, default=0, help="random clicker seed")
    args = ap.parse_args()

    t0 = time.perf_counter()
    env = WebShopEnv(args.data_dir, args.real_data_dir, catalog_size=args.catalog_size,
                     catalog_seed=args.catalog_seed, human_goals=not args.synthetic_goals)
    t_load = time.perf_counter() - t0
    tasks = env.tasks(args.split)[: args.n]
    print(f"data: {env.data.source_dir} ({'original files' if env.uses_real_data else 'generated'}); "
          f"{len(env.data.products)} products, {len(env.data.goals)} goals "
          f"(train {len(env.tasks('train'))}, test {len(env.tasks('test'))}); search stemmer {env.engine.stemmer}; "
          f"load+index {t_load:.2f}s")
    for name, policy in (("expert", ExpertPolicy(env)), ("random", RandomPolicy(args.seed))):
        t0 = time.perf_counter()
        r = run_policy(env, policy, tasks)
        print(f"{name:>6}: mean score {r['mean_score']:.3f}  success rate {r['success_rate']:.3f}  "
              f"mean steps {r['mean_steps']:.1f}  ({r['episodes']} {args.split} goals, "
              f"{time.perf_counter() - t0:.1f}s)")


if __name__ == "__main__":
    main()
