"""Memory performance, side by side in one run: tip retrieval against a list scan, and the memory's share of a
training run's rollout phase.

    python src/train.py experiment=scienceworld        # a run with a memory iteration (seed 8: iteration 1)
    python scripts/bench_memory.py                      # retrieval table + the newest run's memory share
    python scripts/bench_memory.py --run-id ID --sizes 1000 10000 100000 --queries 16

1. Retrieval: ``TipMemory.retrieve`` against ``ListScanMemory`` (a plain Python list scanned entry by entry with
   the authors' semantics: cosine > threshold, top k by stored score, dedup by content, FIFO), on random unit
   keys clustered around one direction (cosine to each other ~0.5, so about half of a partition passes the 0.5
   threshold), one partition, one batch of ``--queries`` queries, ranked by score (the default; a read scans the
   entries in score order and stops once every query's top k is settled) and by similarity (always a full
   scan). Prints ms per query, the ratio and whether the two return the same entries in the same order.
2. From a run's MLflow metrics (default: the newest run in logs/mlflow.db): per iteration the memory's share of
   the rollout phase, (embedding + retrieval + novelty + tip writing) / (rollout + tip writing), split into its
   parts, and rollout time / generation time (the time ``Policy.generate`` took for the same tokens).
"""
from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python scripts/bench_memory.py` from anywhere
from src.memory.tip_memory import TipMemory  # noqa: E402


class ListScanMemory:
    """The reference: one partition as a Python list of (key, content, score), scanned entry by entry.

    Same semantics as ``TipMemory``: a write skips contents already stored or repeated in the batch, then the
    oldest entries leave beyond ``capacity``; a read keeps entries with cosine (clamped to [-1, 1]) > threshold
    and sorts them by (score desc, cosine desc, older first) or (cosine desc, score desc, older first).
    """

    def __init__(self, capacity: int = 1000, threshold: float = 0.5, top_k: int = 10, rank_by: str = "score"):
        self.capacity, self.threshold, self.top_k, self.rank_by = capacity, threshold, top_k, rank_by
        self.entries: list[tuple[np.ndarray, str, float]] = []

    def add(self, keys: np.ndarray, contents: list[str], scores: list[float]) -> None:
        stored = {c for _, c, _ in self.entries}
        for key, content, score in zip(keys, contents, scores):
            if content not in stored:
                stored.add(content)
                self.entries.append((np.asarray(key, np.float32), content, float(score)))
        del self.entries[: max(0, len(self.entries) - self.capacity)]

    def retrieve(self, query: np.ndarray) -> list[str]:
        found = []
        for age, (key, content, score) in enumerate(self.entries):
            cosine = min(1.0, max(-1.0, float(np.dot(key, query))))
            if cosine > self.threshold:
                found.append((-score, -cosine, age, content) if self.rank_by == "score"
                             else (-cosine, -score, age, content))
        return [content for *_, content in sorted(found)[: self.top_k]]


def clustered_keys(rng: np.random.Generator, n: int, dim: int = 384) -> np.ndarray:
    """n unit vectors around one random direction, pairwise cosine ~0.5 (noise variance 1/dim per component)."""
    center = rng.standard_normal(dim)
    x = center / np.linalg.norm(center) + rng.standard_normal((n, dim)) / np.sqrt(dim)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def best_time(fn, repeats: int) -> tuple[float, object]:
    """(shortest wall time of ``repeats`` calls in s, the last result): the least disturbed run on a shared
    machine."""
    times, result = [], None
    for _ in range(repeats):
        tic = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - tic)
    return min(times), result


def bench_retrieval(sizes: list[int], num_queries: int, repeats: int = 3, rank_by: str = "score",
                    seed: int = 0) -> list[dict]:
    """One row per size: ms/query of both (best of ``repeats``), the ratio, and whether the results are
    identical."""
    out = []
    for n in sizes:
        rng = np.random.default_rng([seed, n])
        keys = clustered_keys(rng, n + num_queries)
        keys, queries = keys[:n], keys[n:]
        contents = [f"tip {i}" for i in range(n)]
        scores = rng.integers(0, 20, size=n).astype(float)  # few distinct scores: many ties, as in real runs
        memory = TipMemory(dim=keys.shape[1], embedder_name="bench", capacity=n, rank_by=rank_by)
        memory.add("p", keys, contents, scores, np.zeros(n, int))
        reference = ListScanMemory(capacity=n, rank_by=rank_by)
        reference.add(keys, contents, scores)
        fast_s, fast = best_time(lambda: memory.retrieve(["p"] * num_queries, queries), repeats)
        slow_s, slow = best_time(lambda: [reference.retrieve(q) for q in queries], repeats)
        identical = [[e.content for e in r] for r in fast] == slow
        out.append({"entries": n, "list_ms": 1e3 * slow_s / num_queries, "retrieve_ms": 1e3 * fast_s / num_queries,
                    "ratio": slow_s / max(fast_s, 1e-12), "identical": identical})
    return out


def print_retrieval(rows: list[dict], num_queries: int, repeats: int, rank_by: str) -> None:
    print(f"Retrieval, one partition, {num_queries} queries in one batch, top 10 by {rank_by}, threshold 0.5, "
          f"best of {repeats}:")
    print(f"{'entries':>9} {'list scan ms/q':>15} {'retrieve ms/q':>14} {'ratio':>8} {'identical':>10}")
    for r in rows:
        print(f"{r['entries']:>9,} {r['list_ms']:>15.2f} {r['retrieve_ms']:>14.3f} {r['ratio']:>7.0f}x "
              f"{str(r['identical']):>10}")


def memory_share(tracking_uri: str, experiment: str, run_id: str | None) -> None:
    """Print the memory's share of each iteration's rollout phase from a run's MLflow metrics."""
    import mlflow

    if tracking_uri.startswith("sqlite:///") and not Path(tracking_uri[len("sqlite:///"):]).is_file():
        print(f"\nno MLflow store at {tracking_uri}: memory share skipped")
        return
    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    if run_id is None:
        exp = client.get_experiment_by_name(experiment)
        runs = client.search_runs([exp.experiment_id], order_by=["start_time DESC"], max_results=1) if exp else []
        if not runs:
            print(f"\nno run of experiment {experiment!r} in {tracking_uri}: memory share skipped")
            return
        run_id = runs[0].info.run_id
    run = client.get_run(run_id)

    def series(key: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]

    names = ["rollout_s", "generate_s", "memory_s", "tip_write_s", "tip_generate_s", "memory/embed_s",
             "memory/retrieve_s", "tip_prompt_tokens", "tip_prompt_cached_tokens", "mode_on_policy",
             "mode_on_policy_with_tips", "mode_off_policy"]
    data = {k: series(f"rollout/{k}") for k in names}
    print(f"\nMemory's share of the rollout phase, run {run.info.run_name} ({run_id}):")
    print(f"{'iter':>4} {'mode':>20} {'rollout s':>10} {'tips s':>7} {'embed':>7} {'retrieve':>9} {'novelty':>8} "
          f"{'tips':>7} {'total':>7} {'emb+ret':>8} {'rollout/gen':>12} {'tip ids (cached)':>17}")
    for i, rollout in enumerate(data["rollout_s"]):
        get = lambda k: data[k][i] if i < len(data[k]) else float("nan")  # noqa: E731
        mode = next((m for m in ("on_policy", "on_policy_with_tips", "off_policy") if get(f"mode_{m}") == 1.0), "?")
        tips = get("tip_write_s") if data["tip_write_s"] else get("tip_generate_s")
        embed, retrieve = get("memory/embed_s"), get("memory/retrieve_s")
        novelty = get("memory_s") - embed - retrieve
        phase = rollout + tips
        ids = f"{get('tip_prompt_tokens'):.0f} ({get('tip_prompt_cached_tokens'):.0f})"
        print(f"{i:>4} {mode:>20} {rollout:>10.1f} {tips:>7.1f} {embed / phase:>7.1%} {retrieve / phase:>9.2%} "
              f"{novelty / phase:>8.2%} {tips / phase:>7.1%} {(get('memory_s') + tips) / phase:>7.1%} "
              f"{(embed + retrieve) / phase:>8.2%} {rollout / get('generate_s'):>12.2f} {ids:>17}")
    print("shares of rollout + tip writing; novelty = memory_s - embedding - retrieval; rollout/gen = rollout time "
          "/ time in Policy.generate for the same tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank-by", nargs="+", default=["score", "similarity"], choices=["score", "similarity"])
    parser.add_argument("--tracking-uri", default="sqlite:///logs/mlflow.db")
    parser.add_argument("--experiment", default="empo2")
    parser.add_argument("--run-id", default=None)
    args = parser.parse_args()
    print(f"{datetime.date.today()}, {platform.machine()} {platform.processor() or ''}".strip())
    for rank_by in args.rank_by:
        rows = bench_retrieval(args.sizes, args.queries, args.repeats, rank_by)
        print_retrieval(rows, args.queries, args.repeats, rank_by)
    memory_share(args.tracking_uri, args.experiment, args.run_id)


if __name__ == "__main__":
    main()
