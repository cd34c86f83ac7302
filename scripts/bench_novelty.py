"""The novelty bonus's cost per environment step (issue 59): ``NoveltyMemory.rewards`` for one step of 8 episodes
(6 new states and 2 revisits, one task) against a store of N random unit vectors (dim 384), best of ``--repeats``.

    python scripts/bench_novelty.py                          # N = 1,000 / 10,000 / 100,000, prints the table
    python scripts/bench_novelty.py --before 891d9e3 --out docs/results/novelty/bench.json

``--before REV`` also times ``src/memory/novelty.py`` as of git revision REV (read from git, not kept in the tree)
on the same stores and steps, and says whether it gave the same rewards. ``faiss_range_search_s``: one
``IndexFlatIP.range_search`` of the same 8 states over the same N states, the alternative to the product the store
reads them with. The JSON records the CPU (``lscpu``), the load average around the run and whether it was idle.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import faiss
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python scripts/bench_novelty.py` from anywhere
from src.memory.novelty import NoveltyMemory  # noqa: E402

DIM, THRESHOLD = 384, 0.9


def unit_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    x = rng.standard_normal((n, DIM), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def module_at(rev: str) -> types.ModuleType:
    """``src/memory/novelty.py`` as of git revision ``rev``, as a module."""
    source = subprocess.run(["git", "show", f"{rev}:src/memory/novelty.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType(f"novelty_at_{rev}")
    exec(compile(source, f"{rev}:src/memory/novelty.py", "exec"), module.__dict__)
    return module


def best_seconds(call, inputs: list) -> float:
    """The least time ``call(x)`` took over ``inputs``."""
    best = float("inf")
    for x in inputs:
        start = time.perf_counter()
        call(x)
        best = min(best, time.perf_counter() - start)
    return best


def time_steps(memory, states: np.ndarray, steps: list[np.ndarray]) -> tuple[float, list[list[float]]]:
    """Best seconds of one ``rewards`` call over ``steps`` (each [8, DIM]) on a store loaded with ``states``, and
    the rewards of every step."""
    memory.load_state_dict({"format": "empo2.novelty.v2", "dim": DIM, "states": {"t": torch.from_numpy(states)},
                            "counts": {"t": torch.ones(len(states), dtype=torch.int64)}})
    rewards = []
    seconds = best_seconds(lambda step: rewards.append(memory.rewards(["t"] * len(step), step).tolist()), steps)
    return seconds, rewards


def machine() -> dict:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"}).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    return {"model_name": fields.get("Model name", "?").strip(), "cpus": os.cpu_count(),
            "amx": any(f.startswith("amx") for f in flags), "avx512_bf16": "avx512_bf16" in flags}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--before", help="a git revision whose novelty store is timed too")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    before = module_at(args.before) if args.before else None
    load = [os.getloadavg()[0]]
    rows = []
    for n in args.sizes:
        rng = np.random.default_rng(n)
        states = unit_rows(rng, n)
        steps = [np.concatenate([unit_rows(rng, 6), states[rng.integers(0, n, 2)]]) for _ in range(args.repeats)]
        row = {"n": n}
        row["seconds_per_step"], rewards = time_steps(NoveltyMemory(DIM, threshold=THRESHOLD), states, steps)
        index = faiss.IndexFlatIP(DIM)
        index.add(states)
        row["faiss_range_search_s"] = best_seconds(lambda step: index.range_search(step, THRESHOLD), steps)
        if before is not None:
            row["before_seconds_per_step"], old = time_steps(before.NoveltyMemory(DIM, threshold=THRESHOLD), states,
                                                             steps)
            row["same_rewards_as_before"] = old == rewards
        rows.append(row)
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    load.append(os.getloadavg()[0])
    report = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "machine": machine(),
              "load_average_1min": load, "idle": max(load) < 0.5, "dim": DIM, "threshold": THRESHOLD,
              "states_per_step": 8, "repeats": args.repeats, "before": args.before,
              "numpy": np.__version__, "faiss": faiss.__version__, "results": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "results"}))


if __name__ == "__main__":
    main()
