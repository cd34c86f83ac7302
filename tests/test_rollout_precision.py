"""The precision of each rollout phase (src/models/rollout_precision.py): the choice follows the measured speed-ups,
an explicit setting is honoured inside the Trainer's autocast, and a bf16 prefill hands fp32 keys/values to the
decoding steps."""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from src.models import rollout_precision as rp
from src.models.policy import Policy


@pytest.mark.parametrize("prefill, decode, expected", [(0.1, 0.5, "fp32"), (2.0, 0.5, "bf16-prefill"),
                                                       (0.8, 1.3, "bf16-decode"), (4.0, 1.5, "bf16"),
                                                       (1.2, 1.2, "fp32")])
def test_each_phase_is_bf16_only_where_it_measured_faster(prefill, decode, expected):
    choice, reason = rp.decide_rollout_precision("cpu", {"prefill": prefill, "decode": decode})
    assert choice == expected and f"{prefill:.2f}x" in reason
    assert rp.decide_rollout_precision("cuda")[0] == "trainer"
    with pytest.raises(ValueError, match="needs probe_phases"):
        rp.decide_rollout_precision("cpu")


def test_auto_is_chosen_once_per_process_tree_and_logged(monkeypatch, caplog):
    monkeypatch.delenv(rp.ENV_VAR, raising=False)
    calls = []
    monkeypatch.setattr(rp, "probe_phases", lambda: calls.append(1) or {"prefill": 3.0, "decode": 0.4})
    with caplog.at_level(logging.INFO, logger=rp.__name__):
        assert rp.rollout_precision("auto", "cpu") == "bf16-prefill"
        assert rp.rollout_precision("auto", "cpu") == "bf16-prefill"
    assert len(calls) == 1 and "Rollout precision: bf16-prefill" in caplog.text
    assert rp.rollout_precision("fp32", "cpu") == "fp32"  # an explicit value is kept
    with pytest.raises(ValueError, match=r"model.policy.rollout_precision='fp16': expected one of"):
        rp.rollout_precision("fp16", "cpu")


def _generate(policy: Policy, precision: str, outer_bf16: bool, **kwargs):
    policy.rollout_precision = precision
    prompts = [policy.encode([{"role": "user", "content": c}]) for c in ("hi", "tell me about the sea")]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=outer_bf16):  # as under trainer.precision=bf16-mixed
        return prompts, policy.generate(prompts, max_new_tokens=5, seeds=[1, 2], **kwargs)


def test_an_explicit_phase_precision_holds_inside_the_trainers_autocast(tiny_policy: Policy):
    policy = copy.copy(tiny_policy)
    _, plain = _generate(policy, "trainer", outer_bf16=False)
    _, fp32 = _generate(policy, "fp32", outer_bf16=True)
    assert fp32.response_ids == plain.response_ids and fp32.log_probs == plain.log_probs
    _, inherited = _generate(policy, "trainer", outer_bf16=True)
    gap = max(abs(a - b) for x, y in zip(inherited.log_probs, plain.log_probs) for a, b in zip(x, y))
    assert gap > 1e-4  # bf16 compute shows: the fp32 run above did not inherit it


def test_a_bf16_prefill_decodes_in_fp32_and_its_kept_prompt_continues(tiny_policy: Policy):
    policy = copy.copy(tiny_policy)
    prompts, fp32 = _generate(policy, "fp32", outer_bf16=False)
    prompts, mixed = _generate(policy, "bf16-prefill", outer_bf16=False, keep_prompt_kv=True)
    kept = mixed.prompt_kv(1)
    assert {t.dtype for layer in kept.layers for t in layer} == {torch.float32} and kept.length == len(prompts[1])
    first = [lp[0] for lp in mixed.log_probs]
    assert first == pytest.approx([lp[0] for lp in fp32.log_probs], abs=0.05)  # bf16 rounding of the prefill only
    longer = prompts[1] + mixed.response_ids[1] + policy.encode_next_turn("go on")
    continued = policy.generate([longer], max_new_tokens=3, seeds=[3], prefix_kv=[kept])
    assert len(continued.response_ids[0]) >= 1 and all(lp <= 0 for lp in continued.log_probs[0])
