"""Decoding over preallocated keys/values (src/models/static_decode.py, ``model.policy.cuda_graphs``), beyond the
exactness, batch-independence and live-weight tests it shares with the dynamic loop (tests/test_rollout_engine.py
runs those for both loops), on the CPU where it runs eagerly: a kept prompt continued unchanged, a Qwen2 model the
same as under the dynamic loop, the counter stream the same for a tensor step, the bucket sizes a captured graph
gets, the models it refuses. The graph capture itself runs only on a CUDA device (the last test)."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from src.models.policy import Policy
from src.models.rollout_engine import EngineSettings, RolloutEngine
from src.models.sampling import counter_exponentials
from src.models.static_decode import _bucket, causal_lm


def _both(policy: Policy, *args, **kwargs):
    """(dynamic, static) generations of the same call, each with torch's global generator seeded alike."""
    out = []
    for static in (None, "eager"):
        variant = copy.copy(policy)
        variant.engine = RolloutEngine(replace(policy.engine.settings, static=static))
        torch.manual_seed(3)
        out.append(variant.generate(*args, **kwargs))
    return out


def test_a_kept_prompt_continues_the_same_under_static_decoding(tiny_policy: Policy, engine_prompts):
    """A reflection continues a rollout's kept prompt keys/values: the same reply as from the full prompt."""
    policy = copy.copy(tiny_policy)
    policy.engine = RolloutEngine(replace(tiny_policy.engine.settings, static="eager"))
    prompts = engine_prompts(policy)[:3]
    first = policy.generate(prompts, max_new_tokens=4, seeds=[1, 2, 3], keep_prompt_kv=True)
    longer = [p + r + policy.encode_next_turn("now reflect") for p, r in zip(prompts, first.response_ids)]
    kept = [first.prompt_kv(i) for i in range(3)]
    continued = policy.generate(longer, max_new_tokens=6, seeds=[4, 5, 6], prefix_kv=kept)
    fresh = policy.generate(longer, max_new_tokens=6, seeds=[4, 5, 6])
    assert continued.response_ids == fresh.response_ids
    for got, expected in zip(continued.log_probs, fresh.log_probs):
        assert got == pytest.approx(expected, abs=1e-4)


def test_the_counter_stream_draws_the_same_for_a_tensor_step():
    seeds = torch.tensor([0, 7, -3, 2 ** 40], dtype=torch.int64)
    for step in (0, 1, 255, 10 ** 6):
        by_int = counter_exponentials(seeds, step, 50)
        assert torch.equal(counter_exponentials(seeds, torch.tensor([step]), 50), by_int)


def test_graph_buckets_are_powers_of_two_and_exact_eagerly():
    assert [_bucket(n, True) for n in (1, 2, 3, 5, 8, 9, 64)] == [1, 2, 4, 8, 8, 16, 64]
    assert [_bucket(n, False) for n in (1, 3, 5, 9)] == [1, 3, 5, 9]


def test_a_qwen2_model_decodes_the_same_statically(tiny_model_dir, engine_prompts):
    """Qwen2 (the paper's family: biases in q/k/v, grouped keys/values) through the static step, random weights."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from src.models.hub import load_tokenizer

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=49152, rope_theta=1e6, max_position_embeddings=4096)
    policy = Policy(AutoModelForCausalLM.from_config(config), load_tokenizer(tiny_model_dir), max_response_tokens=8)
    policy.engine = RolloutEngine(EngineSettings("fp32"))
    dynamic, static = _both(policy, engine_prompts(policy), max_new_tokens=8, seeds=[1, 2, 3, 4, 5])
    assert static.response_ids == dynamic.response_ids
    for got, expected in zip(static.log_probs, dynamic.log_probs):
        assert got == pytest.approx(expected, abs=1e-5)


def test_another_architecture_attention_or_a_sliding_window_is_refused_by_name(tiny_model_dir):
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=100)
    with pytest.raises(ValueError, match="a Linear model; the static step runs .'llama', 'qwen2'. decoders only"):
        causal_lm(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="a mistral model"):
        causal_lm(AutoModelForCausalLM.from_config(MistralConfig(**small)))
    sliding = Qwen2Config(**small, use_sliding_window=True, sliding_window=16, max_window_layers=0)
    with pytest.raises(ValueError, match="this qwen2 model attends through a sliding window of 16 tokens"):
        causal_lm(AutoModelForCausalLM.from_config(sliding))
    eager = AutoModelForCausalLM.from_config(Qwen2Config(**small), attn_implementation="eager")
    with pytest.raises(ValueError, match="with attention 'eager': .*expected model.policy.attn_implementation=sdpa"):
        causal_lm(eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_graph_captured_steps_draw_what_eager_steps_draw(stopping_policy: Policy, engine_prompts):  # needs a GPU
    # a new Policy: copy.copy of a module shares its submodules, so assigning .model would move the shared fixture's
    policy = Policy(copy.deepcopy(stopping_policy.model).cuda(), stopping_policy.tokenizer, max_response_tokens=12)
    policy.eos_token_ids = stopping_policy.eos_token_ids
    prompts, seeds = engine_prompts(policy), [31, 32, 33, 34, 35]
    policy.engine = RolloutEngine(EngineSettings(static="eager"))
    eager = policy.generate(prompts, max_new_tokens=12, seeds=seeds)
    policy.engine = RolloutEngine(EngineSettings(static="graphs"))
    graphed = policy.generate(prompts, max_new_tokens=12, seeds=seeds)
    assert graphed.response_ids == eager.response_ids
    for got, expected in zip(graphed.log_probs, eager.log_probs):
        assert got == pytest.approx(expected, abs=1e-4)
