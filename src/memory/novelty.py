"""Count-based intrinsic novelty reward over state embeddings (SPEC §2.6).

Per task key, a set of distinct state embeddings. For a state e: n = number of stored states with
cosine(e, s) >= threshold; if n == 0, e is stored; the reward is r_int = coef / (n + 1).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

_FORMAT = "empo2.novelty.v1"
_NORM_TOL = 1e-3


class NoveltyMemory:
    """Per-task store of distinct states giving r_int = coef / (n + 1).

    Args:
        dim: embedding dimension.
        threshold: cosine at or above which two states count as the same (inclusive), default 0.9.
        coef: reward for a brand-new state, in environment units (SPEC: 1.0 for ScienceWorld points, 0.01 for
            WebShop's [0,1] scores).
        capacity: optional max states per task; the oldest leave first. None = unbounded.

    Raises:
        ValueError: an argument out of range, naming it.
    """

    def __init__(self, dim: int, threshold: float = 0.9, coef: float = 1.0, capacity: int | None = None) -> None:
        if int(dim) < 1:
            raise ValueError(f"dim must be >= 1, got {dim!r}")
        if not -1.0 <= float(threshold) <= 1.0:
            raise ValueError(f"threshold is a cosine and must be in [-1, 1], got {threshold!r}")
        if not math.isfinite(float(coef)):
            raise ValueError(f"coef must be finite, got {coef!r}")
        if capacity is not None and int(capacity) < 1:
            raise ValueError(f"capacity must be >= 1 or None, got {capacity!r}")
        self.dim = int(dim)
        self.threshold = float(threshold)
        self.coef = float(coef)
        self.capacity = None if capacity is None else int(capacity)
        self._states: dict[str, np.ndarray] = {}

    def rewards(self, task_keys: list[str], embeddings: np.ndarray) -> np.ndarray:
        """Intrinsic rewards for N states, storing the new ones.

        The batch is processed in order, as if one state at a time: a state stored earlier in the batch counts
        for the later ones (two identical new states → coef, then coef / 2).

        Args:
            task_keys: N task keys (str).
            embeddings: float [N, dim], L2-normalised.

        Returns:
            float64 [N] rewards r_int = coef / (n + 1).

        Raises:
            ValueError: length/shape mismatch, non-finite or non-normalised embeddings.
            TypeError: a task key is not a str.
        """
        emb = np.asarray(embeddings, dtype=np.float32)
        task_keys = list(task_keys)
        if emb.ndim != 2 or emb.shape[1] != self.dim:
            raise ValueError(f"embeddings must have shape [N, {self.dim}], got {emb.shape}")
        if len(task_keys) != emb.shape[0]:
            raise ValueError(f"got {len(task_keys)} task keys for {emb.shape[0]} embeddings")
        if not np.isfinite(emb).all():
            raise ValueError("embeddings contain non-finite values")
        if emb.shape[0]:
            norms = np.linalg.norm(emb, axis=1)
            if (np.abs(norms - 1.0) > _NORM_TOL).any():
                i = int(np.argmax(np.abs(norms - 1.0)))
                raise ValueError(f"embeddings must be L2-normalised; row {i} has norm {norms[i]:.6f}")

        groups: dict[str, list[int]] = {}
        for i, k in enumerate(task_keys):
            if not isinstance(k, str):
                raise TypeError(f"task keys must be str, got {type(k).__name__} {k!r}")
            groups.setdefault(k, []).append(i)

        out = np.zeros(len(task_keys), dtype=np.float64)
        for key, idx in groups.items():
            e = emb[idx]
            stored = self._states.get(key)
            # Similar-enough counts against the store before this batch, one matmul for the whole group.
            base = (stored @ e.T >= self.threshold).sum(0) if stored is not None else np.zeros(len(idx), np.int64)
            within = e @ e.T >= self.threshold
            new: list[int] = []
            for j, i in enumerate(idx):
                n = int(base[j]) + (int(within[j, new].sum()) if new else 0)
                if n == 0:
                    new.append(j)
                out[i] = self.coef / (n + 1)
            if new:
                added = e[new]
                stored = added if stored is None else np.concatenate([stored, added])
                if self.capacity is not None and len(stored) > self.capacity:
                    stored = stored[-self.capacity:]
                self._states[key] = np.ascontiguousarray(stored)
        return out

    def __len__(self) -> int:
        return sum(len(s) for s in self._states.values())

    def sizes(self) -> dict[str, int]:
        """Stored states per task key."""
        return {k: len(s) for k, s in self._states.items()}

    def state_dict(self) -> dict[str, Any]:
        """Plain objects for a Lightning checkpoint; states as CPU float32 ``torch.Tensor`` [n, dim] because
        Lightning resumes with ``torch.load(weights_only=True)``, which refuses numpy arrays."""
        import torch

        return {
            "format": _FORMAT,
            "dim": self.dim,
            "states": {k: torch.from_numpy(s.copy()) for k, s in self._states.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the stored states (this instance's threshold / coef / capacity are kept).

        Raises:
            ValueError: wrong format or a dim different from this memory's.
        """
        if state.get("format") != _FORMAT:
            raise ValueError(f"not a novelty-memory state (format {state.get('format')!r}, expected {_FORMAT!r})")
        if int(state["dim"]) != self.dim:
            raise ValueError(f"novelty state has dim {state['dim']}, this memory has dim {self.dim}")
        states = {}
        for k, s in state["states"].items():
            s = np.ascontiguousarray(np.asarray(s, dtype=np.float32).reshape(-1, self.dim))
            if self.capacity is not None:
                s = s[-self.capacity:]
            states[k] = s
        self._states = states
