"""The LightningModule's update through a real Lightning Trainer: every trained parameter moves, and the update is
the same whatever the micro-batching (the mini-batch's global token count, SPEC §2.3)."""
from __future__ import annotations

import copy
from functools import partial

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from src.models.empo2_module import EMPO2Module

ALGORITHM = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.3, "clip_ratio_c": 10.0, "loss_agg_mode": "token-mean",
             "mask_modes": ["off_policy"], "kl_coef": 0.0, "temperature": 1.0}


def _module(tiny_model_dir, model_cache_dir, optimizer, **algorithm) -> EMPO2Module:
    torch.manual_seed(0)
    return EMPO2Module(policy={"name_or_path": tiny_model_dir, "cache_dir": str(model_cache_dir), "dtype": "float32"},
                       algorithm={**ALGORITHM, **algorithm}, optimizer=optimizer, gradient_clip_val=None)


def _samples(module: EMPO2Module) -> list[dict]:
    """Four steps with advantages ±1 whose old log-probs are the policy's own (ratio 1 at the first update)."""
    policy = module.policy
    prompts = [policy.encode([{"role": "user", "content": f"step {k} of the task"}]) for k in range(4)]
    responses = [[100, 200, 300], [400, 500], [600, 700, 800, 900], [1000]]
    with torch.no_grad():
        old = policy.log_probs(prompts, responses)["log_probs"]
    return [{"prompt_ids": p, "old_prompt_ids": p, "rollout_prompt_ids": p, "response_ids": r,
             "old_log_probs": old[i, : len(r)].clone(), "advantage": [1.0, -1.0, 0.5, -0.5][i]}
            for i, (p, r) in enumerate(zip(prompts, responses))]


def _micro_batches(samples: list[dict], sizes: list[int], mode: str = "on_policy") -> list[dict]:
    tokens = float(sum(len(s["response_ids"]) for s in samples))
    out, start = [], 0
    for k, n in enumerate(sizes):
        out.append({"samples": samples[start:start + n], "loss_scale": 1.0, "global_token_count": tokens,
                    "global_seq_count": float(len(samples)), "last_micro": k == len(sizes) - 1, "mode": mode,
                    "metrics": {}, "iteration": 0, "rollout_global_step": 0})
        start += n
    return out


def _fit(module: EMPO2Module, batches: list[dict]) -> None:
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))


def test_every_trained_parameter_moves(tiny_model_dir, model_cache_dir):
    module = _module(tiny_model_dir, model_cache_dir, partial(torch.optim.AdamW, lr=1e-3))
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}
    _fit(module, _micro_batches(_samples(module), [4]))
    after = dict(module.policy.named_parameters())
    unchanged = [n for n, p in before.items() if torch.equal(p, after[n].detach())]
    assert not unchanged, f"parameters that did not move: {unchanged}"


@pytest.mark.parametrize("mode", ["on_policy", "off_policy"])
def test_update_is_invariant_to_micro_batching(tiny_model_dir, model_cache_dir, mode):
    """One micro-batch of 4 or micro-batches of 1+3 / 2+2 give the same SGD step (loss uses the global count)."""
    sgd = partial(torch.optim.SGD, lr=1.0)
    reference = _module(tiny_model_dir, model_cache_dir, sgd, lowprob_log_threshold=-11.0)
    samples = _samples(reference)
    deltas = []
    for sizes in ([4], [1, 3], [2, 2]):
        module = copy.deepcopy(reference)
        start = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
        _fit(module, _micro_batches(copy.deepcopy(samples), sizes, mode))
        deltas.append({n: p.detach() - start[n] for n, p in module.policy.named_parameters()})
    assert any(d.abs().max() > 0 for d in deltas[0].values())
    for other in deltas[1:]:
        for name, d in deltas[0].items():
            torch.testing.assert_close(other[name], d, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("mode", ["on_policy", "off_policy"])
@pytest.mark.parametrize("mask_modes", [["off_policy"], []])
def test_low_prob_masking_runs_only_in_mask_modes(tiny_model_dir, model_cache_dir, mode, mask_modes):
    """With log δ = 0 every token is "low-probability" (log p < 0): where masking runs, no policy-gradient term is
    left and SGD does not move; elsewhere it does. So masking in every mode, or in none, fails a case."""
    module = _module(tiny_model_dir, model_cache_dir, partial(torch.optim.SGD, lr=1.0), mask_modes=mask_modes,
                     lowprob_log_threshold=0.0)
    start = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    _fit(module, _micro_batches(_samples(module), [4], mode))
    moved = any(not torch.equal(p.detach(), start[n]) for n, p in module.policy.named_parameters())
    assert moved == (mode not in mask_modes)
