"""A mini-batch's update metrics, added up over its micro-batches (logged as ``train/*`` at each optimizer step)."""
from __future__ import annotations

# Metrics aggregated with the mini-batch's global counts: their micro-batch values add up to the mini-batch value.
PARTIAL_SUMS = ("pg_loss", "kl_loss", "entropy")
WEIGHT = "#weight"  # a weighted mean's weight, beside its weighted total while ranks combine


class MiniBatchMetrics:
    """Partial sums (:data:`PARTIAL_SUMS`) add up, ``*_max`` keep the largest value, the others are means weighted
    by the weight ``add`` is given (the micro-batch's response tokens) or by their own (a ``(value, weight)`` pair)."""

    def __init__(self) -> None:
        self._stats: dict[str, float | tuple[float, float]] = {}

    def add(self, metrics: dict[str, float | tuple[float, float]], weight: float) -> None:
        """Add one micro-batch's metrics."""
        s = self._stats
        for k, v in metrics.items():
            v, w = v if isinstance(v, tuple) else (v, weight)
            if k in PARTIAL_SUMS:
                s[k] = s.get(k, 0.0) + v
            elif k.endswith("_max"):
                s[k] = max(s.get(k, 0.0), v)
            else:
                total, weights = s.get(k, (0.0, 0.0))
                s[k] = (total + v * w, weights + w)

    def pop(self, prefix: str = "train/", combine=None) -> dict[str, float]:
        """The mini-batch's values, keys prefixed (a mean with no weight is 0); the next mini-batch starts empty.
        ``combine`` (``combine_over_ranks``) first sums or maxes every rank's numbers, so each value is the one a single
        process would compute over all ranks' samples."""
        s, self._stats = self._stats, {}
        flat: dict[str, float] = {}
        for k, v in s.items():
            if isinstance(v, tuple):
                flat[k], flat[k + WEIGHT] = v
            else:
                flat[k] = v
        if combine is not None:
            flat = combine(flat, how=lambda k: "max" if k.endswith("_max") else "sum")
        return {f"{prefix}{k}": v / max(flat.get(k + WEIGHT, 0.0), 1e-9) if k + WEIGHT in flat else v
                for k, v in flat.items() if not k.endswith(WEIGHT)}
