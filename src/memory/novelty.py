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
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from src.memory.embedder import check_unit_rows
from src.memory.settings import NoveltyConfig

_FORMAT = "empo2.novelty.v2"
_OLD_FORMAT = "empo2.novelty.v1"  # distinct states without counts (each counts as one visit)


class NoveltyMemory:
    """Per-task store of visited states giving r_int = coef / (N + 1).

    Args:
        settings: ``memory.novelty`` (``NoveltyConfig``, or its keys as keyword arguments): ``threshold``, the cosine
            at or above which two states count as the same (inclusive); ``coef``, the reward for a brand-new state
            in environment units (``Environment.novelty_coef``); ``capacity``, max stored states per task, the oldest
            leave first (with their counts), None = unbounded; ``count``, ``visits`` or ``distinct`` (above).

    Raises:
        ValueError: an argument out of range, naming it.
    """

    def __init__(self, dim: int, settings: NoveltyConfig | None = None, **values) -> None:
        if int(dim) < 1:
            raise ValueError(f"dim must be >= 1, got {dim!r}")
        settings = settings or NoveltyConfig.from_dict(values)
        self.dim = int(dim)
        self.threshold, self.coef, self.capacity, self.count = (settings.threshold, float(settings.coef),
                                                                settings.capacity, settings.count)
        self._states: dict[str, np.ndarray] = {}  # key -> float32 [n, dim]
        self._counts: dict[str, np.ndarray] = {}  # key -> int64 [n] visits per stored state

    def rewards(self, task_keys: list[str], embeddings: np.ndarray) -> np.ndarray:
        """Intrinsic rewards for the N states reached in one environment step, then record the visits.

        Args:
            embeddings: float [N, dim], L2-normalised.

        Returns:
            float64 [N] rewards r_int = coef / (N_i + 1), N_i from the store before this call.

        Raises:
            ValueError: length/shape mismatch, non-finite or non-normalised embeddings.
            TypeError: a task key is not a str.
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
            e = emb[idx]
            stored, counts = self._states.get(key), self._counts.get(key)
            if stored is None:
                familiar = np.zeros(len(idx), np.int64)
            else:
                similar = self._cosine(stored, e) >= self.threshold  # [n_stored, n_batch]
                weights = counts if self.count == "visits" else np.ones_like(counts)
                familiar = weights @ similar
            out[idx] = self.coef / (familiar + 1.0)
            self._visit(key, e)
        return out

    def _visit(self, key: str, e: np.ndarray) -> None:
        """Add one visit per row of ``e`` (one task key), in a canonical row order."""
        stored = self._states.get(key, np.zeros((0, self.dim), np.float32))
        counts = self._counts.get(key, np.zeros(0, np.int64))
        for row in np.lexsort(e.T[::-1]):  # sorted by embedding: the store does not depend on episode order
            sims = self._cosine(stored, e[row : row + 1])[:, 0]
            nearest = int(np.argmax(sims)) if len(sims) else -1
            if nearest >= 0 and sims[nearest] >= self.threshold:
                counts[nearest] += 1
            else:
                stored = np.concatenate([stored, e[row : row + 1]])
                counts = np.concatenate([counts, np.ones(1, np.int64)])
        if self.capacity is not None and len(stored) > self.capacity:
            stored, counts = stored[-self.capacity:], counts[-self.capacity:]
        self._states[key], self._counts[key] = np.ascontiguousarray(stored), counts.copy()

    @staticmethod
    def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        # Normalised within 1e-3, float32: a dot product can leave [-1, 1] by rounding; a cosine cannot.
        return np.clip(a @ b.T, -1.0, 1.0)

    def __len__(self) -> int:
        return sum(len(s) for s in self._states.values())

    def sizes(self) -> dict[str, int]:
        """Stored states per task key."""
        return {k: len(s) for k, s in self._states.items()}

    def visits(self) -> dict[str, list[int]]:
        """Visit count of each stored state per task key, oldest stored state first."""
        return {k: c.tolist() for k, c in self._counts.items()}

    def state_dict(self) -> dict[str, Any]:
        """Plain objects for a Lightning checkpoint; states as CPU float32 ``torch.Tensor`` [n, dim] and counts as
        int64 [n], because Lightning resumes with ``torch.load(weights_only=True)``, which refuses numpy arrays."""
        import torch

        return {
            "format": _FORMAT,
            "dim": self.dim,
            "states": {k: torch.from_numpy(s.copy()) for k, s in self._states.items()},
            "counts": {k: torch.from_numpy(c.copy()) for k, c in self._counts.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the stored states and counts (this instance's threshold / coef / capacity / count are kept); a v1
        state (no counts) loads with one visit per stored state.

        Raises:
            ValueError: wrong format or a dim different from this memory's.
        """
        if state.get("format") not in (_FORMAT, _OLD_FORMAT):
            raise ValueError(f"not a novelty-memory state (format {state.get('format')!r}, expected {_FORMAT!r})")
        if int(state["dim"]) != self.dim:
            raise ValueError(f"novelty state has dim {state['dim']}, this memory has dim {self.dim}")
        states, counts = {}, {}
        for k, s in state["states"].items():
            s = np.ascontiguousarray(np.asarray(s, dtype=np.float32).reshape(-1, self.dim))
            c = np.asarray(state.get("counts", {}).get(k, np.ones(len(s))), dtype=np.int64).reshape(-1)
            if len(c) != len(s):
                raise ValueError(f"novelty state {k!r} has {len(s)} states but {len(c)} counts")
            if self.capacity is not None:
                s, c = s[-self.capacity:], c[-self.capacity:]
            states[k], counts[k] = s, c.copy()
        self._states, self._counts = states, counts
