"""The storage of one tip-memory partition and the small numeric helpers its reads use (``TipMemory``)."""
from __future__ import annotations

import faiss
import numpy as np
from threadpoolctl import ThreadpoolController

from src.memory.tip_entry import TipEntry


class Partition:
    """Row i of ``index`` is ``entries[i]`` with stored score ``scores[i]``; rows are in insertion order."""

    __slots__ = ("index", "entries", "contents", "scores", "_by_score")

    def __init__(self, dim: int) -> None:
        self.index = faiss.IndexFlatIP(dim)
        self.entries: list[TipEntry] = []
        self.contents: set[str] = set()
        self.scores = np.zeros(0, dtype=np.float64)
        self._by_score: np.ndarray | None = None

    def set_scores(self, scores: np.ndarray) -> None:
        self.scores, self._by_score = np.asarray(scores, dtype=np.float64), None

    @property
    def by_score(self) -> np.ndarray:
        """int64 [N]: the rows in ranking order of their stored scores (highest first, older first among equal
        scores); computed once after each write."""
        if self._by_score is None:
            self._by_score = np.lexsort((np.arange(len(self.scores)), -self.scores))
        return self._by_score


_BLAS: ThreadpoolController | None = None


def one_blas_thread():
    """Context in which numpy's BLAS runs on one thread: a read's products are small (16 queries x 1,000 keys), and
    waiting for a descheduled second thread costs more than it saves."""
    global _BLAS
    if _BLAS is None:
        _BLAS = ThreadpoolController()
    return _BLAS.limit(limits=1, user_api="blas")


def stored_keys(index: faiss.IndexFlat) -> np.ndarray:
    """The index's vectors as a float32 [ntotal, d] view of its storage (no copy; valid until the index changes)."""
    return faiss.rev_swig_ptr(index.get_xb(), index.ntotal * index.d).reshape(index.ntotal, index.d)


def float32_below(x: float) -> np.float32:
    """The largest float32 r <= x: for any float32 s, s > x exactly when s > r (so float32 arrays can be
    compared with a float64 threshold without an upcast)."""
    r = np.float32(x)
    return np.nextafter(r, np.float32(-np.inf)) if float(r) > x else r
