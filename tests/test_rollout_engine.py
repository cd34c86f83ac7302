"""The rollout engine (src/models/rollout_engine.py) against the path it replaced (tests/hf_reference.py:
``transformers``' ``generate`` with a log-prob recorder and per-row seeded streams), on the tiny policy in fp32, with
both decoding loops (the dynamic cache, and preallocated keys/values, ``model.policy.cuda_graphs``, which runs
eagerly on a CPU): the same tokens and log-probs for the same seeds, while rows whose reply ended leave the batch; a
row's result does not depend on its companions; a weight change is seen by the next call."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from hf_reference import hf_generate
from src.models.policy import Policy
from src.models.rollout_engine import RolloutEngine

LOOPS = {"dynamic": None, "static": "eager"}


def _with_loop(policy: Policy, loop: str) -> Policy:
    variant = copy.copy(policy)
    variant.engine = RolloutEngine(replace(policy.engine.settings, static=LOOPS[loop]))
    return variant


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("mode", ["seeded", "global-generator", "greedy"])
def test_the_engine_draws_what_the_replaced_path_drew(stopping_policy: Policy, engine_prompts, mode, loop):
    """Same prompts (different lengths), same seeds: identical tokens, log-probs within 1e-5, the same EOS cut; in
    seeded mode finished rows left the batch early (replies of several lengths), without seeds every row stayed, so
    torch's global generator drew as before."""
    prompts = engine_prompts(stopping_policy)
    kwargs = {"seeded": dict(seeds=[11, 12, 13, 14, 15]), "global-generator": {}, "greedy": dict(do_sample=False)}[mode]
    torch.manual_seed(3)
    ref_ids, ref_lps = hf_generate(stopping_policy, prompts, 12, 0.8, **kwargs)
    torch.manual_seed(3)
    gen = _with_loop(stopping_policy, loop).generate(prompts, max_new_tokens=12, temperature=0.8, **kwargs)
    assert gen.response_ids == ref_ids
    for got, expected in zip(gen.log_probs, ref_lps):
        assert got == pytest.approx(expected, abs=1e-5)
    assert gen.truncated == [r[-1] not in stopping_policy.eos_token_ids for r in ref_ids]
    if mode == "seeded":
        assert len({len(r) for r in ref_ids}) > 1 and min(len(r) for r in ref_ids) < 12  # rows ended mid-batch


@pytest.mark.parametrize("loop", LOOPS)
def test_a_row_draws_the_same_alone_or_in_any_batch(stopping_policy: Policy, engine_prompts, loop):
    policy = _with_loop(stopping_policy, loop)
    prompts = engine_prompts(policy)
    seeds = [21, 22, 23, 24, 25]
    batch = policy.generate(prompts, max_new_tokens=10, seeds=seeds)
    for i in (0, 3):
        alone = policy.generate([prompts[i]], max_new_tokens=10, seeds=[seeds[i]])
        assert alone.response_ids[0] == batch.response_ids[i]
        assert alone.log_probs[0] == pytest.approx(batch.log_probs[i], abs=1e-5)
    shuffled = policy.generate(prompts[::-1], max_new_tokens=10, seeds=seeds[::-1])
    assert shuffled.response_ids[::-1] == batch.response_ids


@pytest.mark.parametrize("loop", LOOPS)
def test_a_weight_change_is_seen_by_the_next_rollout(tiny_policy: Policy, engine_prompts, loop):
    """The engine reads the live weights: after a change (an optimizer step would do the same) the same seeds give
    other log-probs, and restoring the weights gives the first rollout back."""
    policy = _with_loop(tiny_policy, loop)
    prompts = engine_prompts(policy)[:2]
    before = policy.generate(prompts, max_new_tokens=6, seeds=[1, 2])
    weight = policy.model.get_output_embeddings().weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.mul_(1.5)
    try:
        after = policy.generate(prompts, max_new_tokens=6, seeds=[1, 2])
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert after.log_probs[0][0] != pytest.approx(before.log_probs[0][0], abs=1e-3)
    again = policy.generate(prompts, max_new_tokens=6, seeds=[1, 2])
    assert again.response_ids == before.response_ids and again.log_probs == before.log_probs
