"""The precision of each rollout phase (src/models/rollout_engine.py): the choice follows the measured speed-ups,
an explicit setting is honoured inside the Trainer's autocast, a bf16 prefill hands fp32 keys/values to the
decoding steps, and bf16 decoding steps run a copy of the live weights (rollout_engine.InferenceCopy), never under
FSDP."""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from src.models import rollout_engine as rp
from src.models.rollout_engine import EngineSettings, InferenceCopy, RolloutEngine
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


def test_auto_is_chosen_once_per_process_and_logged(monkeypatch, caplog):
    monkeypatch.setattr(rp, "_CHOSEN", {})  # nothing chosen yet (tests/conftest.py pins the CPU's choice)
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
    policy.engine = copy.copy(policy.engine)  # settings of its own; the inference copy is shared
    policy.engine.settings = EngineSettings(precision)
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


def test_bf16_decoding_steps_run_a_copy_of_the_live_weights(tiny_policy: Policy):
    policy = copy.deepcopy(tiny_policy)  # weights of its own: this test changes them
    count = len(list(policy.parameters()))
    _, fp32 = _generate(policy, "fp32", outer_bf16=False)
    _, bf16 = _generate(policy, "bf16-decode", outer_bf16=True)
    # the prefill ran in fp32 (the first token's log-prob is fp32's), the steps on bf16 weights (later ones differ)
    assert [lp[0] for lp in bf16.log_probs] == pytest.approx([lp[0] for lp in fp32.log_probs], abs=1e-6)
    gap = max(abs(a - b) for x, y in zip(bf16.log_probs, fp32.log_probs) for a, b in zip(x[1:], y[1:]))
    assert gap > 1e-4
    assert {p.dtype for p in policy.model.parameters()} == {torch.float32}  # the live weights stay fp32 masters
    assert len(list(policy.parameters())) == count and all("inference" not in k for k in policy.state_dict())
    # a change no version counter sees (a fused optimizer step, a .data write) reaches the next rollout
    with torch.no_grad():
        for p in policy.model.parameters():
            p.data.mul_(1.5)
    calls = {"live": 0, "copy": 0}
    hooks = [m.register_forward_hook(lambda *_, k=k: calls.__setitem__(k, calls[k] + 1))
             for k, m in (("live", policy.model), ("copy", policy.engine.copy.model))]
    _, after = _generate(policy, "bf16-decode", outer_bf16=True)
    for hook in hooks:
        hook.remove()
    assert calls == {"live": 1, "copy": max(len(r) for r in after.response_ids) - 1}  # prefill; every step
    _, fresh = _generate(copy.deepcopy(policy), "bf16-decode", outer_bf16=True)  # a copy built from these weights
    assert after.response_ids == fresh.response_ids and after.log_probs == fresh.log_probs
    assert after.log_probs != bf16.log_probs


def test_the_copy_casts_what_differs_and_keeps_buffers_ties_and_shared_weights(tiny_policy: Policy):
    model = copy.deepcopy(tiny_policy.model)
    norm = model.model.norm.weight
    norm.data = norm.data.bfloat16()  # already bf16 (as a frozen LoRA base would be): shared, not copied
    inference = InferenceCopy()
    out = inference.refreshed(model)
    assert out is not model and not out.training and out.model.norm.weight is norm
    assert all(p.dtype == torch.bfloat16 and (p is norm or not p.requires_grad) for p in out.parameters())
    assert torch.equal(out.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight.bfloat16())
    assert [b.dtype for b in out.buffers()] == [b.dtype for b in model.buffers()]  # rotary frequencies stay fp32
    assert (out.lm_head.weight is out.model.embed_tokens.weight) == (model.lm_head.weight is
                                                                     model.model.embed_tokens.weight)
    assert inference.refreshed(model) is out  # built once, refreshed in place
    assert inference.refreshed(tiny_policy.model) is not out  # another model: its own copy
    assert InferenceCopy().refreshed(model.to(torch.bfloat16)) is model  # all bf16 already: no copy


def test_fsdp_keeps_decoding_steps_off_the_copy(monkeypatch):
    from omegaconf import OmegaConf

    monkeypatch.setitem(rp._CHOSEN, "cpu", ("bf16", "as if this CPU measured bf16 faster in both phases"))
    fsdp = {"_target_": "lightning.pytorch.strategies.ModelParallelStrategy"}
    for strategy, expected in ((fsdp, "bf16-prefill"), ("fsdp", "bf16-prefill"), ("ddp", "bf16")):
        cfg = OmegaConf.create({"trainer": {"accelerator": "cpu", "strategy": strategy},
                                "model": {"policy": {"rollout_precision": "auto"}}})
        assert rp.resolve_rollout_precision(cfg) == expected == cfg.model.policy.rollout_precision
    with pytest.raises(ValueError, match="rollout_precision=bf16-decode with trainer.strategy=FSDP"):
        RolloutEngine(EngineSettings("bf16-decode")).precision("cpu", synced=True)
    assert RolloutEngine(EngineSettings("auto")).precision("cpu", synced=True) == "bf16-prefill"  # auto falls back


def test_the_copy_follows_a_replaced_parameter_and_the_adapter_state(tiny_model_dir, model_cache_dir):
    from src.models.policy import build_policy

    lora = {"enabled": True, "r": 4, "alpha": 8, "target_modules": "all-linear"}
    model = build_policy(name_or_path=tiny_model_dir, cache_dir=str(model_cache_dir), lora=lora).model
    inference = InferenceCopy()

    def flags(m):
        return {layer.disable_adapters for layer in m.modules() if hasattr(layer, "merged_adapters")}

    first = inference.refreshed(model)
    with model.disable_adapter():
        assert flags(inference.refreshed(model)) == {True}  # the copy runs without adapters too
    assert flags(inference.refreshed(model)) == {False}
    up = model.base_model.model.model.layers[0].mlp.up_proj.lora_A["default"]
    up.weight = torch.nn.Parameter(torch.full_like(up.weight, 0.5))  # another object of the same shape
    copied = inference.refreshed(model).base_model.model.model.layers[0].mlp.up_proj.lora_A["default"].weight
    assert first is not inference.model and torch.equal(copied, torch.full_like(copied, 0.5))
