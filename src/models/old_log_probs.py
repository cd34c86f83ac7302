"""π_old (and the KL reference's log-probs) of an iteration's samples, before the update
(docs/method.md#one-iteration, step 6), for ``src/data/iteration.py``."""
from __future__ import annotations

import math

import torch

from src.data.samples import StepSample, prompt_order
from src.models.algorithm_config import AlgorithmConfig
from src.models.policy import Policy
from src.utils.distributed import all_reduce


def scoring_chunks(samples: list[StepSample], policy: Policy, chunk_size: int = 8) -> list[list[StepSample]]:
    """``score_samples``' chunks, in prompt order (a chunk's common prefix is computed once). Under FSDP every rank gets
    the same number: a rank short of samples scores a throw-away padding sample."""
    samples = sorted(samples, key=prompt_order)
    n_chunks = math.ceil(len(samples) / chunk_size)
    if policy.synced:  # sharded weights: every rank runs the same number of forward passes
        n_chunks = int(all_reduce([float(n_chunks)], op="max")[0])
    return [samples[k * chunk_size:(k + 1) * chunk_size] or [StepSample.padding(policy.tokenizer.eos_token_id)]
            for k in range(n_chunks)]


def response_log_probs(policy: Policy, samples: list[StepSample], prompt: str, temperature: float,
                       **kwargs) -> list[torch.Tensor]:
    """Each sample's response log-probs (float32 ``[T_i]`` on the CPU, nats) under its ``prompt`` attribute
    (``old_prompt_ids`` or ``update_prompt_ids``), one forward pass."""
    out = policy.log_probs([getattr(s, prompt) for s in samples], [s.response_ids for s in samples],
                           temperature=temperature, share_prefix=not policy.synced, **kwargs)
    return [out["log_probs"][i, : len(s.response_ids)].float().cpu() for i, s in enumerate(samples)]


@torch.no_grad()
def score_samples(samples: list[StepSample], policy: Policy, reference: Policy | None, algorithm: AlgorithmConfig,
                  chunk_size: int = 8) -> None:
    """Set ``old_log_probs`` (and ``ref_log_probs`` when ``algorithm.kl_coef > 0``) of each sample, in place: over the
    behaviour prompt (``old_prompt_ids``), so the first update's ratio is exactly 1, or, with
    ``algorithm.recompute_old_log_probs: false`` and not under FSDP, the rollout's where that is the rollout prompt.
    The KL reference is ``reference``, or ``policy`` with its LoRA adapters off."""
    reuse = not algorithm.recompute_old_log_probs and not policy.synced
    for chunk in scoring_chunks(samples, policy, chunk_size):
        need = []
        for s in chunk:
            if reuse and s.old_prompt_ids is s.rollout_prompt_ids:
                s.old_log_probs = torch.tensor(s.rollout_log_probs, dtype=torch.float32)
            else:
                need.append(s)
        if need:
            for s, lp in zip(need, response_log_probs(policy, need, "old_prompt_ids", algorithm.temperature)):
                s.old_log_probs = lp
        if algorithm.kl_coef > 0:
            ref = reference or policy
            for s, lp in zip(chunk, response_log_probs(ref, chunk, "update_prompt_ids", algorithm.temperature,
                                                       disable_adapters=reference is None)):
                s.ref_log_probs = lp
