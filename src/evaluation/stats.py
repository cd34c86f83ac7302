"""Statistics of an evaluation: pooled mean and standard error, the adaptation gain, a weights fingerprint."""
from __future__ import annotations

import math
from typing import Any, Sequence


def mean_stderr(values: Sequence[float]) -> dict[str, float | int | None]:
    """Mean and standard error of the mean of per-episode values, pooled over all episodes of all seeds.

    ``stderr = s / sqrt(n)`` with ``s`` the Bessel-corrected sample standard deviation; units are those of the
    values (ScienceWorld points, WebShop [0, 1], success 0/1).

    Returns:
        ``{"mean", "stderr", "n"}``; ``mean`` is None for n = 0 and ``stderr`` None for n < 2 (undefined).
    """
    import torch
    from torchmetrics.aggregation import CatMetric

    metric = CatMetric().set_dtype(torch.float64)
    if len(values):
        metric.update(torch.as_tensor(list(values), dtype=torch.float64))
    x = metric.compute() if len(values) else torch.zeros(0, dtype=torch.float64)
    x = x.reshape(-1)
    n = int(x.numel())
    mean = float(x.mean()) if n else None
    stderr = float(x.std(correction=1) / math.sqrt(n)) if n >= 2 else None
    return {"mean": mean, "stderr": stderr, "n": n}


def best_relative_gain(trial_scores: Sequence[float]) -> float | None:
    """Best relative gain of trials 1..K over trial 0: ``(max_k s_k − s_0) / |s_0|``
    (docs/evaluation.md#the-adaptation-protocol). For ``s_0 = 0``: 0.0 when the best is 0 too, else None (undefined).

    Raises:
        ValueError: fewer than two trial scores.
    """
    if len(trial_scores) < 2:
        raise ValueError(f"need trial 0 and at least one later trial, got {len(trial_scores)} score(s)")
    base, best = float(trial_scores[0]), max(float(s) for s in trial_scores[1:])
    if base == 0.0:
        return 0.0 if best == 0.0 else None
    return (best - base) / abs(base)


def weights_sha256(module) -> str:
    """SHA-256 over every tensor of ``module.state_dict()`` (names, dtypes, shapes and raw bytes, in order)."""
    from src.models.checkpoint_state import frozen_weights_sha256

    return frozen_weights_sha256(module, set())[0]


def episode_summary(episodes) -> dict[str, Any]:
    """Score and success rate (mean, s.e., n) over the finished episodes, mean episode length and invalid-action
    rate, and the episode counts."""
    from src.data.rollout import episode_metrics

    done = [e for e in episodes if not e.failed]
    metrics = episode_metrics(episodes)
    return {
        "score": mean_stderr([e.score for e in done]),
        "success_rate": mean_stderr([float(e.success) for e in done]),
        "episode_length": metrics.get("episode_length"),
        "invalid_action_rate": metrics.get("invalid_action_rate"),
        "episodes": len(episodes),
        "failed_episodes": len(episodes) - len(done),
    }
