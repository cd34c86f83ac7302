"""Count-based intrinsic novelty reward over state embeddings (paper §4.2; docs/method.md#count-based-novelty-bonus).

Per task key, a store of representative states, each with a visit count. A visit to state e goes to the
nearest stored state with cosine(e, s) >= threshold, or creates a new stored state with count 1. The reward of
a visit is r_int = coef / (N + 1), where N measures familiarity with e before this environment step:

- ``count="visits"`` (default): N = the visits to all stored states similar to e (Σ counts): coef, coef/2,
  coef/3 … as in count-based exploration, so the intrinsic return of an episode that loops stays bounded.
- ``count="distinct"``: N = the number of distinct stored states similar to e (the other reading of the
  paper's "number of similar past states"). A revisited state keeps paying coef/2 for ever.

All states of one call (one environment step of all episodes) are scored against the store as it was before
the call, then added in a canonical order (sorted by embedding), so nothing depends on the episodes' order.

A task's states live in a ``faiss.IndexFlatIP``, read with one exact float32 product with its own storage, which
decides both rewards and visits (2-20x faster than ``range_search``;
docs/performance.md#tip-retrieval-and-the-novelty-store).
"""
from __future__ import annotations

import contextlib
from typing import Any

import faiss
import numpy as np

from src.memory.embedder import check_unit_rows
from src.memory.settings import NoveltyConfig
from src.memory.tip_partition import one_blas_thread, stored_keys

PARALLEL_STATES = 50_000  # a task's stored states from which the similarity product uses every BLAS thread

_FORMAT = "empo2.novelty.v2"
_OLD_FORMAT = "empo2.novelty.v1"  # distinct states without counts (each counts as one visit)


class _TaskStates:
    """One task's stored states, oldest first: index rows ``start:`` with ``counts`` visits each. Evicted rows stay
    below ``start`` until they number a quarter of the live ones, then leave in one compaction, so a full store does
    not move all its rows at every step."""

    __slots__ = ("index", "start", "counts")

    def __init__(self, dim: int, keys: np.ndarray, counts: np.ndarray) -> None:
        self.index, self.start, self.counts = faiss.IndexFlatIP(dim), 0, np.zeros(0, np.int64)
        self.add(keys, counts)

    def keys(self) -> np.ndarray:
        """float32 [n, dim] view of the live states (valid until the store changes)."""
        return stored_keys(self.index)[self.start:]

    def add(self, keys: np.ndarray, counts: np.ndarray) -> None:
        self.index.add(np.ascontiguousarray(keys, dtype=np.float32))
        self.counts = np.concatenate([self.counts, np.asarray(counts, np.int64)])

    def keep_newest(self, capacity: int | None) -> None:
        extra = 0 if capacity is None else len(self.counts) - capacity
        if extra <= 0:
            return
        self.start, self.counts = self.start + extra, self.counts[extra:].copy()
        if 4 * self.start >= len(self.counts):
            removed = self.index.remove_ids(faiss.IDSelectorRange(0, self.start))  # keeps the rest in order
            if removed != self.start:
                raise RuntimeError(f"FAISS removed {removed} rows, expected {self.start}")
            self.start = 0


class NoveltyMemory:
    """Per-task store of visited states giving r_int = coef / (N + 1).

    ``settings``: ``memory.novelty`` (or its keys as keyword arguments); ``coef`` is in environment units, and at
    ``capacity`` the oldest states leave with their counts. Raises ValueError for an argument out of range.
    """

    def __init__(self, dim: int, settings: NoveltyConfig | None = None, **values) -> None:
        if int(dim) < 1:
            raise ValueError(f"dim must be >= 1, got {dim!r}")
        settings = settings or NoveltyConfig.from_dict(values)
        self.dim = int(dim)
        self.threshold, self.coef, self.capacity, self.count = (settings.threshold, float(settings.coef),
                                                                settings.capacity, settings.count)
        self._tasks: dict[str, _TaskStates] = {}

    def rewards(self, task_keys: list[str], embeddings: np.ndarray) -> np.ndarray:
        """float64 [N] rewards r_int = coef / (N_i + 1) for the N states (float [N, dim], L2-normalised) reached in
        one environment step, N_i from the store before this call; then record the visits. Raises ValueError for
        mismatched or non-normalised embeddings, TypeError for a non-str task key.
        """
        emb = check_unit_rows(embeddings, self.dim)
        if len(task_keys) != emb.shape[0]:
            raise ValueError(f"got {len(task_keys)} task keys for {emb.shape[0]} embeddings")
        groups: dict[str, list[int]] = {}
        for i, k in enumerate(task_keys):
            if not isinstance(k, str):
                raise TypeError(f"task keys must be str, got {type(k).__name__} {k!r}")
            groups.setdefault(k, []).append(i)
        out = np.zeros(len(task_keys), dtype=np.float64)
        for key, idx in groups.items():
            e, store = emb[idx], self._tasks.get(key)
            stored, cols, sims = self._similar(store, e)
            weights = store.counts[stored] if store is not None and self.count == "visits" else None
            out[idx] = self.coef / (np.bincount(cols, weights, minlength=len(idx)) + 1.0)
            self._visit(key, e, stored, cols, sims)
        return out

    def _similar(self, store: _TaskStates | None, e: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The pairs (stored state, row of ``e``) with cosine >= threshold, and their cosines (float32), ordered
        by stored state, then row."""
        if store is None:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
        # one BLAS thread for a small store (a 2-core machine under load: a second thread cost ~10 ms at 1,000
        # states, saved none); every thread for a large one (100,000 states: 0.054 -> 0.034 s on 2 cores)
        with one_blas_thread() if len(store.counts) < PARALLEL_STATES else contextlib.nullcontext():
            sims = self._cosine(store.keys(), e)  # [n_stored, n_rows]
        stored, cols = np.nonzero(sims >= self.threshold)
        return stored, cols, sims[stored, cols]

    def _visit(self, key: str, e: np.ndarray, stored: np.ndarray, cols: np.ndarray, sims: np.ndarray) -> None:
        """Add one visit per row of ``e`` (one task key), in a canonical row order, given the pairs (``stored``
        state, row ``cols``) of the store before the call with cosine ``sims`` >= threshold."""
        store = self._tasks.get(key)
        n = 0 if store is None else len(store.counts)
        best = np.full(len(e), -np.inf, np.float32)  # per row: the nearest similar stored state (the oldest of ties)
        nearest = np.full(len(e), -1, np.int64)
        first = np.lexsort((stored, -sims, cols))
        rows, at = np.unique(cols[first], return_index=True)
        best[rows], nearest[rows] = sims[first[at]], stored[first[at]]
        among_new = self._cosine(e, e)  # [i, j]: cosine of row j with row i, once row i is a new stored state
        new: list[int] = []  # rows stored by this call, in order; stored state n + i is row new[i]
        visits = np.zeros(n + len(e), np.int64)
        for row in np.lexsort(e.T[::-1]):  # sorted by embedding: the store does not depend on episode order
            if new:
                sims_new = among_new[new, row]
                i = int(np.argmax(sims_new))
                if sims_new[i] > best[row]:  # a tie goes to the older state
                    best[row], nearest[row] = sims_new[i], n + i
            if best[row] >= self.threshold:
                visits[nearest[row]] += 1
            else:
                new.append(int(row))
                visits[n + len(new) - 1] = 1
        if store is None:
            store = self._tasks[key] = _TaskStates(self.dim, e[new], visits[n: n + len(new)])
        else:
            store.counts += visits[:n]
            store.add(e[new], visits[n: n + len(new)])
        store.keep_newest(self.capacity)

    @staticmethod
    def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        # Normalised within 1e-3, float32: a dot product can leave [-1, 1] by rounding; a cosine cannot.
        return np.clip(a @ b.T, -1.0, 1.0)

    def __len__(self) -> int:
        return sum(len(s.counts) for s in self._tasks.values())

    def sizes(self) -> dict[str, int]:
        """Stored states per task key."""
        return {k: len(s.counts) for k, s in self._tasks.items()}

    def visits(self) -> dict[str, list[int]]:
        """Visit count of each stored state per task key, oldest stored state first."""
        return {k: s.counts.tolist() for k, s in self._tasks.items()}

    def state_dict(self) -> dict[str, Any]:
        """Plain objects for a Lightning checkpoint; states as CPU float32 ``torch.Tensor`` [n, dim] and counts as
        int64 [n], because Lightning resumes with ``torch.load(weights_only=True)``, which refuses numpy arrays."""
        import torch

        return {
            "format": _FORMAT,
            "dim": self.dim,
            "states": {k: torch.from_numpy(s.keys().copy()) for k, s in self._tasks.items()},
            "counts": {k: torch.from_numpy(s.counts.copy()) for k, s in self._tasks.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the stored states and counts (this instance's threshold / coef / capacity / count are kept); a v1
        state (no counts) loads with one visit per stored state. Raises ValueError: wrong format or another dim.
        """
        if state.get("format") not in (_FORMAT, _OLD_FORMAT):
            raise ValueError(f"not a novelty-memory state (format {state.get('format')!r}, expected {_FORMAT!r})")
        if int(state["dim"]) != self.dim:
            raise ValueError(f"novelty state has dim {state['dim']}, this memory has dim {self.dim}")
        tasks = {}
        for k, s in state["states"].items():
            s = np.ascontiguousarray(np.asarray(s, dtype=np.float32).reshape(-1, self.dim))
            c = np.asarray(state.get("counts", {}).get(k, np.ones(len(s))), dtype=np.int64).reshape(-1)
            if len(c) != len(s):
                raise ValueError(f"novelty state {k!r} has {len(s)} states but {len(c)} counts")
            if self.capacity is not None:
                s, c = s[-self.capacity:], c[-self.capacity:]
            tasks[k] = _TaskStates(self.dim, s, c)
        self._tasks = tasks
