"""The shapes the training data takes between the data layer that makes it and the model layer that trains on it,
kept here so that the model layer never imports the data layer's machinery. In verl a step sample and a micro-batch
are one ``DataProto``; here token ids stay unpadded lists until the policy packs them for a forward pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class StepSample:
    """One step of a valid episode, with its episode's GRPO advantage (prompts as in ``StepRecord``).

    ``old_prompt_ids``: the prompt π_old is taken under (``iteration.make_samples``). Log-probs are nats, ``[T_i]``;
    ``old_log_probs`` / ``ref_log_probs`` are set by ``score_samples``. ``key``: ``(episode id, step index)``, the
    mini-batches are drawn over these, so they hold the same samples whatever the number of ranks (None: the
    sample's place in this rank's list).
    """

    rollout_prompt_ids: list[int]
    update_prompt_ids: list[int]
    old_prompt_ids: list[int]
    response_ids: list[int]
    rollout_log_probs: list[float]
    advantage: float
    old_log_probs: Tensor | None = None
    ref_log_probs: Tensor | None = None
    key: tuple[int, int] | None = None

    @property
    def num_tokens(self) -> int:
        """Update prompt + response tokens (what one forward pass of the update costs)."""
        return len(self.update_prompt_ids) + len(self.response_ids)

    @classmethod
    def padding(cls, eos_token_id: int) -> StepSample:
        """A one-token throw-away sample: lets a rank with no data of its own join the other ranks' forward and
        backward passes under DDP/FSDP (its loss is scaled by 0 or its outputs discarded)."""
        ids = [eos_token_id]
        return cls(rollout_prompt_ids=ids, update_prompt_ids=ids, old_prompt_ids=ids, response_ids=ids,
                   rollout_log_probs=[0.0], advantage=0.0, old_log_probs=torch.zeros(1), ref_log_probs=torch.zeros(1))


def prompt_order(sample: StepSample) -> tuple[list[int], int]:
    """Sort key that puts samples with long common prompt prefixes next to each other (the update prompt's ids in
    lexicographic order; the sample's key breaks ties, so the order never depends on the input order): a batch's
    common prefix is then computed once (``Policy.log_probs(share_prefix=True)``)."""
    return sample.update_prompt_ids, sample.key if sample.key is not None else ()


@dataclass
class MicroBatch:
    """One forward/backward of the update. ``loss_scale``: 0.0 for a padding micro-batch (DDP/FSDP alignment, not
    data). ``batch_num_tokens`` / ``global_batch_size``: the mini-batch's loss denominators over all ranks (at least
    1). ``metrics``: the iteration's rollout metrics on its first micro-batch. ``has_data``: False when no rank has a
    sample (the optimizer leaves the policy as it is). ``num_micro``: verl's gradient-accumulation steps, which the
    authors' semantics divide each micro-batch's loss by. ``tree``: computed as one prefix tree
    (``Policy.log_probs(tree=True)``).
    """

    samples: list[StepSample]
    loss_scale: float
    batch_num_tokens: float
    global_batch_size: float
    mode: str
    iteration: int
    rollout_global_step: int
    ppo_epoch: int
    mini_batch: int
    last_micro: bool
    metrics: dict[str, Any] = field(default_factory=dict)
    num_samples: int = 0
    has_data: bool = True
    num_micro: int = 1
    tree: bool = False


@dataclass
class SFTExample:
    """One demonstrated step as a supervised sample.

    ``prompt_ids``: the prompt the rollout runner renders at this state; ``response_ids``: the reply's ids + EOS.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    task: dict[str, Any]
    step: int
