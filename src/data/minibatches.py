"""An iteration's samples as the update consumes them (docs/method.md#one-iteration, step 7): ``ppo_epochs`` passes,
each split into mini-batches (one optimizer step each), each cut into micro-batches of at most ``micro_batch_size``
samples (one forward/backward each).

Padding and rank alignment happen here only: every rank yields the same number of micro-batches (zero-weight padding
where it has fewer samples), because DDP/FSDP need the same number of backward passes everywhere.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import numpy as np
import torch

from src.data.samples import MicroBatch, StepSample, prompt_order
from src.models.core_algos import loss_denominators
from src.models.prefix_tree import group_rows
from src.utils.distributed import all_reduce, gather_lists, rank_and_world
from src.utils.rng import PERMUTATION


def denominators(samples: list[StepSample]) -> tuple[int, int]:
    """This rank's share of a mini-batch's ``batch_num_tokens`` / ``global_batch_size``, counted as the loss
    counts them (``loss_denominators``: response tokens, and rows with at least one)."""
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.long)
    width = int(lengths.max()) if len(samples) else 0
    return loss_denominators(torch.arange(width) < lengths[:, None])


def mini_batch_count(rows: int, num_mini_batches: int | None = None, mini_batch_rows: int | None = None) -> int:
    """Optimizer steps per PPO epoch for an iteration of ``rows`` training rows (agent steps, all ranks together).

    ``mini_batch_rows`` R (the field's ``ppo_mini_batch_size`` counted in rows, as verl counts it after multiplying
    by the group size: rows per optimizer step over all ranks): ⌈rows / R⌉ steps, so the number of updates follows
    the rollout's length (128 episodes of 30 steps at R = 128: 30 steps). ``num_mini_batches``: that fixed number of
    steps whatever the rows. Neither: 1. At least 1 (an iteration without rows still takes its skipped step, so every
    rank agrees on the count). Raises ValueError: both are set, or one is not a positive integer.
    """
    for name, value in (("num_mini_batches", num_mini_batches), ("mini_batch_rows", mini_batch_rows)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"data.{name}={value!r}: expected an int >= 1")
    if num_mini_batches is not None and mini_batch_rows is not None:
        raise ValueError(f"data.num_mini_batches={num_mini_batches!r} and data.mini_batch_rows={mini_batch_rows!r} "
                         "are both set: one rule per run, a fixed number of optimizer steps per iteration or one "
                         "step per mini_batch_rows rows; set the other to null (e.g. data.num_mini_batches=null)")
    if mini_batch_rows is not None:
        return max(1, math.ceil(rows / mini_batch_rows))
    return num_mini_batches or 1


def micro_batches(samples: list[StepSample], info: dict[str, Any], metrics: dict[str, float], *, seed: int,
                  iteration: int, ppo_epochs: int, micro_batch_size: int, padding: Callable[[], StepSample],
                  num_mini_batches: int | None = None, mini_batch_rows: int | None = None,
                  micro_batch_tokens: int | None = None) -> Iterator[MicroBatch]:
    """Yield ``ppo_epochs`` passes of ``mini_batch_count`` mini-batches, each as micro-batches (a collective).

    The mini-batches are drawn (from ``(seed, iteration)``) over all ranks' samples, ordered by ``StepSample.key``,
    each rank training on its own samples of each: a mini-batch holds the same samples whether 1 process or N ranks
    run the iteration. With ``mini_batch_rows`` R the N rows are split into ⌈N/R⌉ mini-batches of near-equal size
    (⌊N/k⌋ or ⌈N/k⌉ rows, never more than R): every row is trained on, none is dropped, and each mini-batch's loss
    is divided by its own token (or row) count, so a smaller mini-batch is not a smaller step. ``padding``: a
    throw-away sample, for a rank without any sample of its own. ``micro_batch_tokens``: micro-batches are prefix
    trees of at most that many tokens (``group_rows``) instead of ``micro_batch_size`` samples.
    """
    rng = np.random.default_rng([seed, iteration, PERMUTATION])
    rank = rank_and_world()[0]
    keys = [s.key if s.key is not None else (rank, i) for i, s in enumerate(samples)]
    position = {key: i for i, key in enumerate(sorted(gather_lists(keys)))}
    place = [position[key] for key in keys]  # this rank's samples' places among all ranks' samples
    n_mini = mini_batch_count(len(position), num_mini_batches, mini_batch_rows)
    first = True
    for epoch in range(ppo_epochs):
        order = rng.permutation(len(position))
        for mb, idx in enumerate(np.array_split(order, n_mini)):
            chosen = set(idx.tolist())
            # Prompts in token order: steps of one task (same system prompt and task text) share micro-batches,
            # whose common prefix the update computes once; the gradient is the same (the mini-batch's loss is a
            # sum over its micro-batches, with the mini-batch's global counts).
            minibatch = sorted((s for s, p in zip(samples, place) if p in chosen), key=prompt_order)
            g_tokens, g_seqs = all_reduce([float(n) for n in denominators(minibatch)])
            trees = (group_rows([s.update_prompt_ids + s.response_ids for s in minibatch], micro_batch_tokens)
                     if micro_batch_tokens is not None else None)
            n_micro = len(trees) if trees is not None else math.ceil(len(minibatch) / micro_batch_size)
            n_micro = int(all_reduce([float(max(1, n_micro))], op="max")[0])
            # a rank with fewer trees pads with zero-weight micro-batches; rows split near-equally over the count
            chunks = (trees + [[]] * (n_micro - len(trees)) if trees is not None
                      else [c.tolist() for c in np.array_split(np.arange(len(minibatch)), n_micro)])
            for k, chunk in enumerate(chunks):
                micro = [minibatch[i] for i in chunk]
                yield MicroBatch(
                    **info, samples=micro or [samples[0] if samples else padding()],
                    loss_scale=1.0 if micro else 0.0, batch_num_tokens=max(g_tokens, 1.0),
                    global_batch_size=max(g_seqs, 1.0), ppo_epoch=epoch, mini_batch=mb,
                    last_micro=k == len(chunks) - 1, metrics=metrics if first else {},
                    num_samples=len(samples), has_data=g_seqs > 0, num_micro=len(chunks),
                    tree=micro_batch_tokens is not None)
                first = False

