"""Random streams for exact resume: per-iteration seeds and checkpointable global RNG states.

Every random draw of a training iteration comes from a stream seeded by ``(seed, iteration, ...)``, so a resumed run
draws what the uninterrupted run drew. An episode's tokens come from its own streams (``row_seeds``), so 1 process
and N DDP/FSDP ranks play the same episodes. The global generators are also checkpointed, for anything else.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

# Stream ids: one independent random stream per purpose and iteration.
MODE, TASKS, PERMUTATION, SAMPLING, VALIDATION, REFLECTION = range(6)


def stream_seed(seed: int, iteration: int, stream: int, rank: int = 0) -> int:
    """A 63-bit seed for ``(seed, iteration, stream, rank)`` (NumPy ``SeedSequence`` hashing; all must be >= 0)."""
    return int(np.random.SeedSequence([seed, iteration, stream, rank]).generate_state(1, np.uint64)[0] >> 1)


def row_seeds(base: int, episode_ids: list[int], step: int) -> list[int]:
    """One 63-bit seed per episode for one batched generation: ``(base, episode id, step)`` hashed. ``base``: a
    ``stream_seed`` of the iteration, the same on every rank; ``step``: the environment step (0 for a reflection)."""
    return [int(np.random.SeedSequence([base, int(e), step]).generate_state(1, np.uint64)[0] >> 1)
            for e in episode_ids]


def seed_torch(seed: int, iteration: int, stream: int, rank: int = 0) -> None:
    """Seed torch's global generators (CPU and every CUDA device), which Hugging Face ``generate`` samples from."""
    torch.manual_seed(stream_seed(seed, iteration, stream, rank))


def global_rng_state() -> dict[str, Any]:
    """The Python, NumPy, torch and CUDA generator states, as objects ``torch.load(weights_only=True)`` accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_global_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``global_rng_state`` returned (a CUDA state only where CUDA is in use)."""
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
