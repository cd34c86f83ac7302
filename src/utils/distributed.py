"""The few collectives the rollout pipeline needs: all ranks must call them, in the same order; each is the identity
without torch.distributed."""
from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Sum (``op="sum"``) or max (``op="max"``) a few numbers over ranks."""
    if not is_distributed():
        return values
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (every rank gets the whole list)."""
    if not is_distributed():
        return [obj]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def gather_lists(items: list) -> list:
    """Concatenate a picklable list over all ranks, in rank order (every rank gets the whole list)."""
    return [item for rank_items in gather_objects(items) for item in rank_items]


def duration_or_count(key: str) -> str:
    """How a rank-local number combines over ranks: a duration (``*_s``) is the slowest rank's, a count the sum."""
    return "max" if key.endswith("_s") else "sum"


def combine_over_ranks(metrics: dict[str, float], how: Callable[[str], str] = duration_or_count) -> dict[str, float]:
    """Each rank's numbers combined into the whole batch's, key by key: ``how(key)`` is ``sum`` (counts), ``max``
    (durations, maxima) or ``same`` (already the same on every rank: rank 0's). A key missing on some ranks
    combines the ranks that have it."""
    per_rank = gather_objects(dict(metrics))
    out = {}
    for key in dict.fromkeys(k for d in per_rank for k in d):
        values = [float(d[key]) for d in per_rank if key in d]
        op = how(key)
        out[key] = sum(values) if op == "sum" else max(values) if op == "max" else values[0]
    return out


def check_same_on_every_rank(what: dict[str, bytes]) -> None:
    """Refuse state that must be identical on every rank but is not (compared by SHA-256).

    Raises:
        RuntimeError: naming each piece that differs and the ranks whose copy differs from rank 0's.
    """
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in what.items()}
    per_rank = gather_objects(digests)
    differ = {name: [r for r, d in enumerate(per_rank) if d.get(name) != per_rank[0].get(name)]
              for name in digests}
    differ = {name: ranks for name, ranks in differ.items() if ranks}
    if differ:
        pieces = "; ".join(f"{name} on rank(s) {ranks} differs from rank 0" for name, ranks in differ.items())
        raise RuntimeError("state that every rank must hold identically differs between ranks (a checkpoint, written "
                           f"by rank 0, would not hold the other ranks' state): {pieces}")
