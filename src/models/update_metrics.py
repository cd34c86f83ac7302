"""A mini-batch's update metrics, added up over its micro-batches (logged as ``train/*`` at each optimizer step)."""
from __future__ import annotations

# Metrics aggregated with the mini-batch's global counts: their micro-batch values add up to the mini-batch value.
PARTIAL_SUMS = ("pg_loss", "kl_loss", "entropy")


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

    def pop(self, prefix: str = "train/") -> dict[str, float]:
        """The mini-batch's values (a mean with no weight is 0), keys prefixed; starts the next mini-batch empty."""
        s, self._stats = self._stats, {}
        return {f"{prefix}{k}": v[0] / max(v[1], 1e-9) if isinstance(v, tuple) else v for k, v in s.items()}
