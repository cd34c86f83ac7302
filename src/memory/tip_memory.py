"""Tip memory: partitioned FAISS store of self-generated tips (docs/method.md#memory).

A partition (str key: task variation, task, or global) is a ``faiss.IndexFlatIP`` over L2-normalised state keys plus
one ``TipEntry`` per row. Reads take a partition's queries at once, as one product with the stored keys (exact, 2-3x
faster than a FAISS range search; ``scripts/bench_memory.py``).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict
from typing import Any

import faiss
import numpy as np

from src.memory.embedder import check_unit_rows
from src.memory.settings import TipMemoryConfig
from src.memory.tip_entry import TipEntry
from src.memory.tip_partition import Partition, float32_below, one_blas_thread, stored_keys

STATE_FORMAT = "empo2.tip_memory.v1"


class TipMemory:
    """Partitioned tip store (docs/method.md#memory, "Partitions", "Retrieval").

    ``settings`` is ``memory.tip_memory`` (or its keys as keyword arguments); a tip is a candidate when cosine(key,
    query) > threshold (strict, on cosines clamped to [-1, 1]). ``semantics`` "authors" is the EMPO² authors'
    retrieval (docs/reproducing.md, difference 5; ``_authors_top_rows``); ``rank_by`` is then not read. A load with
    another ``embedder_name`` is refused. Raises ValueError for an argument out of range, naming it.
    """

    def __init__(self, dim: int, embedder_name: str, settings: TipMemoryConfig | None = None, semantics: str = "paper",
                 **values) -> None:
        if int(dim) < 1:
            raise ValueError(f"dim must be >= 1, got {dim!r}")
        if not isinstance(embedder_name, str) or not embedder_name:
            raise ValueError(f"embedder_name must be a non-empty str, got {embedder_name!r}")
        if semantics not in ("paper", "authors"):
            raise ValueError(f"semantics must be 'paper' or 'authors', got {semantics!r}")
        settings = settings or TipMemoryConfig.from_dict(values)
        self.semantics = semantics
        self.dim = int(dim)
        self.embedder_name = embedder_name
        self.capacity = settings.capacity
        self.threshold = settings.threshold
        self.top_k = settings.top_k
        self.rank_by = settings.rank_by
        self.first_chunk = 1024  # entries per first scan in score order (``_candidates_in_score_order``)
        self._parts: dict[str, Partition] = {}
        self._counters = {"added": 0, "duplicates": 0, "evicted": 0}

    def add(self, partition: str, keys: np.ndarray, contents: list[str], scores: list[float] | np.ndarray,
            steps: list[int] | np.ndarray, iteration: int | None = None) -> int:
        """Store N tips in one partition; returns how many were stored (``add_rows`` says which)."""
        return len(self.add_rows(partition, keys, contents, scores, steps, iteration))

    def add_rows(
        self,
        partition: str,
        keys: np.ndarray,
        contents: list[str],
        scores: list[float] | np.ndarray,
        steps: list[int] | np.ndarray,
        iteration: int | None = None,
    ) -> list[int]:
        """Store N tips (keys float [N, dim], L2-normalised; scores R in environment units) in one partition.

        Returns the indices of those stored: not contents already stored or repeated earlier in the batch, nor the
        oldest of a batch larger than ``capacity``. Entries beyond ``capacity`` are evicted, oldest first.
        Raises TypeError for a non-str partition, ValueError for mismatched lengths, bad keys or non-finite scores.
        """
        self._check_partition(partition)
        keys = check_unit_rows(keys, self.dim, "keys")
        n = keys.shape[0]
        contents = list(contents)
        scores = [float(s) for s in scores]
        steps = [int(s) for s in steps]
        for name, seq in (("contents", contents), ("scores", scores), ("steps", steps)):
            if len(seq) != n:
                raise ValueError(f"{name} has length {len(seq)} but keys has {n} rows")
        for i, c in enumerate(contents):
            if not isinstance(c, str):
                raise ValueError(f"contents[{i}] must be str, got {type(c).__name__}")
        for i, s in enumerate(scores):
            if not math.isfinite(s):
                raise ValueError(f"scores[{i}] must be finite, got {s!r}")

        part = self._parts.get(partition)
        if part is None:
            part = self._parts[partition] = Partition(self.dim)
        keep: list[int] = []
        seen = set(part.contents)
        for i, c in enumerate(contents):
            if c in seen:
                self._counters["duplicates"] += 1
                continue
            seen.add(c)
            keep.append(i)
        # Entries that would be evicted by the same call never enter.
        keep = keep[-self.capacity:] if keep else keep
        if not keep:
            return []

        now = time.time()
        it = None if iteration is None else int(iteration)
        part.index.add(np.ascontiguousarray(keys[keep]))
        for i in keep:
            part.entries.append(TipEntry(contents[i], scores[i], steps[i], now, it))
            part.contents.add(contents[i])
        part.set_scores(np.concatenate([part.scores, [scores[i] for i in keep]]))
        self._counters["added"] += len(keep)
        self._evict(part)
        return keep

    def _evict(self, part: Partition) -> None:
        extra = len(part.entries) - self.capacity
        if extra <= 0:
            return
        # IndexFlat.remove_ids compacts the remaining rows in order, so row i stays entry i.
        removed = part.index.remove_ids(faiss.IDSelectorRange(0, extra))
        if removed != extra:
            raise RuntimeError(f"FAISS removed {removed} rows, expected {extra}")
        for e in part.entries[:extra]:
            part.contents.discard(e.content)
        del part.entries[:extra]
        part.set_scores(part.scores[extra:].copy())
        self._counters["evicted"] += extra

    def retrieve(self, partitions: list[str], queries: np.ndarray, with_similarity: bool = False
                 ) -> list[list[TipEntry]] | list[list[tuple[TipEntry, float]]]:
        """B lists of at most ``top_k`` entries (``(entry, cosine)`` with ``with_similarity``) of each query's
        partition with cosine > threshold; [] for an unknown partition. Queries: float [B, dim], L2-normalised.

        Order: rank_by "score", highest score first, ties by cosine; "similarity", highest cosine first, ties by
        score; then the older entry first. Raises ValueError (B mismatch, bad queries), TypeError (non-str key).
        """
        queries = check_unit_rows(queries, self.dim, "queries")
        partitions = list(partitions)
        if len(partitions) != queries.shape[0]:
            raise ValueError(f"got {len(partitions)} partitions for {queries.shape[0]} queries")
        groups: dict[str, list[int]] = {}
        for qi, p in enumerate(partitions):
            self._check_partition(p)
            groups.setdefault(p, []).append(qi)

        out: list[list] = [[] for _ in partitions]
        for p, qidx in groups.items():
            part = self._parts.get(p)
            if part is None or not part.entries:
                continue
            with one_blas_thread():
                top = self._top_rows(part, queries[qidx])
            for qi, (rows, cos) in zip(qidx, top):
                out[qi] = ([(part.entries[j], float(c)) for j, c in zip(rows, cos)] if with_similarity
                           else [part.entries[j] for j in rows])
        return out

    def _top_rows(self, part: Partition, queries: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """For each of Q queries, (the row ids of its top ``top_k`` candidates in ``rank_by`` order (row index =
        age: smaller is older), their cosines)."""
        keys = stored_keys(part.index)
        if self.semantics == "authors":
            return self._authors_top_rows(part, keys, queries)
        if self.rank_by == "score":
            q, rows, cos = self._candidates_in_score_order(part, keys, queries)
        else:
            q, rows, cos = self._candidates_by_similarity(keys, queries)
        score = part.scores[rows]
        order = np.lexsort((rows, -cos, -score, q) if self.rank_by == "score" else (rows, -score, -cos, q))
        q, rows, cos = q[order], rows[order], cos[order]
        first = np.searchsorted(q, np.arange(len(queries)))
        keep = np.arange(len(q)) - first[q] < self.top_k
        q, rows, cos = q[keep], rows[keep], cos[keep]
        cuts = np.searchsorted(q, np.arange(1, len(queries)))
        return list(zip(np.split(rows, cuts), np.split(cos, cuts)))

    def _authors_top_rows(self, part: Partition, keys: np.ndarray, queries: np.ndarray
                          ) -> list[tuple[np.ndarray, np.ndarray]]:
        """``_top_rows`` as the authors' memory server ranks: cosine in float64 divided by both norms (a stored
        float32 key's norm is not exactly 1, so a cosine of 0.5 in float32 can pass) > threshold, then score rounded
        to 0.1 descending, the older entry first among equal ones (a stable sort of entries in insertion order)."""
        k64, q64 = keys.astype(np.float64), queries.astype(np.float64)
        sims = (q64 @ k64.T) / np.outer(np.linalg.norm(q64, axis=1), np.linalg.norm(k64, axis=1))
        rounded = np.round(part.scores, 1)
        out = []
        for row in sims:
            rows = np.nonzero(row > self.threshold)[0]
            rows = rows[np.argsort(-rounded[rows], kind="stable")][: self.top_k]
            out.append((rows, row[rows]))
        return out

    def _candidates_by_similarity(self, keys: np.ndarray, queries: np.ndarray):
        """(query, row, cosine) of the candidates that can be in a query's top k by similarity: one matrix product
        with every key, then only those at or above the query's k-th best cosine."""
        sims = np.clip(queries @ keys.T, -1.0, 1.0)  # [Q, N]
        candidate = sims > float32_below(self.threshold)
        n, k = sims.shape[1], self.top_k
        if n > k:
            primary = np.where(candidate, sims, -np.inf)
            kth = np.partition(primary, n - k, axis=1)[:, n - k]
            candidate &= primary >= kth[:, None]
        q, rows = np.nonzero(candidate)
        return q, rows, sims[q, rows]

    def _candidates_in_score_order(self, part: Partition, keys: np.ndarray, queries: np.ndarray):
        """(query, row, cosine) of the candidates among entries scanned in score order, in chunks (``first_chunk``,
        then doubling), until each query has k candidates, the k-th scoring above every unscanned entry."""
        order, scores, k = part.by_score, part.scores, self.top_k
        radius = float32_below(self.threshold)
        found = np.zeros(len(queries), dtype=np.int64)
        kth_score = np.full(len(queries), -np.inf)
        pending = np.arange(len(queries))
        out: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        start, size = 0, self.first_chunk
        while len(pending) and start < len(order):
            cols = order[start:start + size]
            sims = np.clip(queries[pending] @ keys[cols].T, -1.0, 1.0)
            candidate = sims > radius
            q, c = np.nonzero(candidate)
            out.append((pending[q], cols[c], sims[q, c]))
            before = found[pending]
            found[pending] += candidate.sum(axis=1)
            start, size = start + size, 2 * size
            reached = (before < k) & (found[pending] >= k)  # the k-th candidate is in this chunk: its score
            if reached.any():
                position = np.argmax(np.cumsum(candidate[reached], axis=1) >= (k - before[reached])[:, None], axis=1)
                kth_score[pending[reached]] = scores[cols[position]]
            if start < len(order):
                pending = pending[kth_score[pending] <= scores[order[start]]]
        if not out:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
        return tuple(np.concatenate(parts) for parts in zip(*out))

    def __len__(self) -> int:
        return sum(len(p.entries) for p in self._parts.values())

    def sizes(self) -> dict[str, int]:
        """Entries per partition."""
        return {k: len(p.entries) for k, p in self._parts.items()}

    def entries(self, partition: str) -> list[TipEntry]:
        """The entries of one partition, oldest first ([] if unknown)."""
        part = self._parts.get(partition)
        return list(part.entries) if part else []

    def stats(self) -> dict[str, float]:
        """num_partitions, num_entries, max_partition_size, and cumulative added / duplicates / evicted counts."""
        sizes = self.sizes()
        return {
            "num_partitions": len(sizes),
            "num_entries": sum(sizes.values()),
            "max_partition_size": max(sizes.values(), default=0),
            **self._counters,
        }

    def state_dict(self) -> dict[str, Any]:
        """Plain objects for a Lightning checkpoint; keys as CPU float32 ``torch.Tensor`` [n, dim], since Lightning 2.6
        resumes with ``torch.load(weights_only=True)``, which refuses numpy arrays."""
        import torch

        return {
            "format": STATE_FORMAT,
            "embedder_name": self.embedder_name,
            "dim": self.dim,
            "counters": dict(self._counters),
            "partitions": {
                name: {
                    "keys": torch.from_numpy(self._keys(part).copy()),
                    "entries": [asdict(e) for e in part.entries],
                }
                for name, part in self._parts.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the contents with ``state``, keeping this instance's settings (an over-``capacity`` partition
        keeps its newest entries). Raises ValueError for a wrong format or another embedder name / dim."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a tip-memory state (format {state.get('format')!r}, expected {STATE_FORMAT!r})")
        stored = (state["embedder_name"], int(state["dim"]))
        if stored != (self.embedder_name, self.dim):
            raise ValueError(f"tip memory embedder mismatch: stored with embedder {stored[0]!r} (dim {stored[1]}), "
                             f"but the current embedder is {self.embedder_name!r} (dim {self.dim}); keys from "
                             "different embedders are not comparable")
        parts: dict[str, Partition] = {}
        for name, p in state["partitions"].items():
            keys = np.asarray(p["keys"], dtype=np.float32).reshape(-1, self.dim)
            entries = [TipEntry(**e) for e in p["entries"]]
            parts[name] = self._build_partition(name, keys, entries)
        self._parts = parts
        self._counters = {k: int(state.get("counters", {}).get(k, 0)) for k in self._counters}

    def _build_partition(self, name: str, keys: np.ndarray, entries: list[TipEntry]) -> Partition:
        if keys.shape != (len(entries), self.dim):
            raise ValueError(
                f"partition {name!r}: keys have shape {keys.shape}, expected ({len(entries)}, {self.dim})"
            )
        if len(entries) > self.capacity:
            keys, entries = keys[-self.capacity:], entries[-self.capacity:]
        part = Partition(self.dim)
        if len(entries):
            part.index.add(np.ascontiguousarray(keys, dtype=np.float32))
        part.entries = list(entries)
        part.contents = {e.content for e in entries}
        part.set_scores([e.score for e in entries])
        return part

    def _keys(self, part: Partition) -> np.ndarray:
        n = part.index.ntotal
        return part.index.reconstruct_n(0, n) if n else np.zeros((0, self.dim), np.float32)

    @staticmethod
    def _check_partition(p: Any) -> None:
        # str only: int keys would silently become str after a JSON round trip and stop matching.
        if not isinstance(p, str):
            raise TypeError(f"partition keys must be str, got {type(p).__name__} {p!r}")
