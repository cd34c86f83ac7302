"""Do memory keys tell states apart? Cosine spread within and across partitions, and how often retrieval returns a tip
written at the same place as the query, for each ``memory.key`` (docs/method.md#memory).

    python scripts/retrieval_keys.py                                  # Coin Collector (experiment=coin's game)
    python scripts/retrieval_keys.py --env scienceworld --tasks 5
    python scripts/retrieval_keys.py --out docs/results/memory-keys/coin.json

The states are those of the warm start's reflection trajectories (per training task the gold path and a trajectory
that goes wrong: ``Environment.reflection_records``), each step stored as a memory entry under its task's partition
with the trajectory's score, as the memory stores tips. Every step then queries the memory of its own partition (its
own trajectory's entries left out) with the real ``TipMemory`` (threshold, top-k and ranking of the memory group),
and a retrieved entry is *relevant* when it was written at the same place as the query: the same room (Coin
Collector, ScienceWorld) or the same page type (WebShop: search, results, item, sub-page).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ENVS = {
    "coin": {"_target_": "src.envs.textworld_express.TextWorldExpressEnv", "max_steps": 12,
             "game_params": {"numLocations": 4, "includeDoors": 1, "numDistractorItems": 0}},
    "scienceworld": {"_target_": "src.envs.scienceworld.ScienceWorldEnv", "task": "find-non-living-thing",
                     "max_steps": 6, "action_correction": True},
    "webshop": {"_target_": "src.envs.webshop.WebShopEnv", "data_dir": str(ROOT / "data" / "webshop"),
                "max_steps": 15, "observation_instruction": False},
}


def place(env: str, observation: str, previous: str | None) -> str | None:
    """Where a state is: the room (coin, ScienceWorld; an observation that names none keeps the last room) or the
    WebShop page type."""
    if env == "webshop":
        if "Back to Search" not in observation:
            return "search"
        if "Buy Now" in observation:
            return "item"
        if "< Prev" in observation or "Next >" in observation or "Page " in observation:
            return "results"
        return "sub-page"
    pattern = r"You are in the ([\w -]+?)\." if env == "coin" else r"This room is called the ([\w -]+?)\."
    found = re.search(pattern, observation)
    return found.group(1) if found else previous


def states(env: str, records: list[dict]) -> list[dict]:
    out = []
    for r, record in enumerate(records):
        where = None
        for t, observation in enumerate([record["initial_observation"], *record["observations"][:-1]]):
            where = place(env, observation, where)
            out.append({"record": r, "step": t, "task": json.dumps(record["task"], sort_keys=True),
                        "instruction": record["instruction"], "observation": observation, "place": where,
                        "score": float(record["score"])})
    return out


def measure(rows: list[dict], keys: np.ndarray, threshold: float, top_k: int, rank_by: str) -> dict:
    from src.memory.tip_memory import TipMemory

    cos = keys @ keys.T
    task = np.array([r["task"] for r in rows])
    record = np.array([r["record"] for r in rows])
    same = (task[:, None] == task[None, :]) & (record[:, None] != record[None, :])
    other = task[:, None] != task[None, :]
    memories: dict[tuple[str, int], TipMemory | None] = {}  # per (task, query's record): the other records' entries

    def memory_for(row: dict) -> TipMemory | None:
        mark = (row["task"], row["record"])
        if mark not in memories:
            mine = [i for i, r in enumerate(rows) if r["task"] == row["task"] and r["record"] != row["record"]]
            memories[mark] = None
            if mine:
                memories[mark] = TipMemory(dim=keys.shape[1], embedder_name="x", threshold=threshold, top_k=top_k,
                                           rank_by=rank_by)
                memories[mark].add_rows("p", keys[mine], [str(i) for i in mine], [rows[i]["score"] for i in mine],
                                        [rows[i]["step"] for i in mine])
        return memories[mark]

    relevant, hits, shown = [], 0, 0
    for q, row in enumerate(rows):
        memory = memory_for(row)
        if memory is None:
            continue
        got = [int(e.content) for e in memory.retrieve(["p"], keys[q:q + 1])[0]]
        hits += bool(got)
        shown += len(got)
        relevant += [rows[i]["place"] == row["place"] for i in got]

    def spread(mask):
        values = cos[mask]
        return {"mean": float(values.mean()), "p5": float(np.percentile(values, 5)),
                "p95": float(np.percentile(values, 95))}

    return {"within_partition": spread(same), "across_partitions": spread(other), "queries": len(rows),
            "hit_rate": hits / len(rows), "tips_per_query": shown / len(rows),
            "relevance": float(np.mean(relevant)) if relevant else None,
            "relevance_if_random": _chance(rows)}


def _chance(rows: list[dict]) -> float:
    """The share of same-place pairs among a partition's entries of other trajectories: what a retrieval that
    ignored the state would score."""
    pairs = [(a["place"] == b["place"]) for a in rows for b in rows
             if a["task"] == b["task"] and a["record"] != b["record"]]
    return float(np.mean(pairs)) if pairs else 0.0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", choices=sorted(ENVS), default="coin")
    ap.add_argument("--tasks", type=int, default=20, help="training tasks (two trajectories each)")
    ap.add_argument("--threshold", type=float, default=0.5, help="memory.tip_memory.threshold")
    ap.add_argument("--top-k", type=int, default=3, help="memory.tip_memory.top_k (the CPU experiments: 3)")
    ap.add_argument("--rank-by", default="score", choices=["score", "similarity"])
    ap.add_argument("--data-dir", default=str(ROOT / "data"), help="where gold paths are cached")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from src.callbacks.memory import state_text
    from src.memory.settings import KEYS
    from src.data.reflections import reflection_records
    from src.memory.embedder import Embedder

    gold_dir = Path(args.data_dir) / ("scienceworld_gold" if args.env == "scienceworld" else "textworld_express")
    records, _, _ = reflection_records(ENVS[args.env], args.tasks, gold_dir)
    rows = states(args.env, records)
    embedder = Embedder(name_or_path="embedded:all-MiniLM-L6-v2")
    result = {"env": args.env, "tasks": args.tasks, "trajectories": len(records), "threshold": args.threshold,
              "top_k": args.top_k, "rank_by": args.rank_by, "keys": {}}
    for key in KEYS:
        texts = [state_text(key, r["instruction"], r["observation"]) for r in rows]
        result["keys"][key] = measure(rows, embedder.encode(texts), args.threshold, args.top_k, args.rank_by)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
