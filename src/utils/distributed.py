"""The few collectives the rollout pipeline needs; each is the identity without torch.distributed."""
from __future__ import annotations

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


def gather_lists(items: list) -> list:
    """Concatenate a picklable list over all ranks, in rank order (every rank gets the whole list)."""
    if not is_distributed():
        return items
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, items)
    return [item for rank_items in gathered for item in rank_items]
