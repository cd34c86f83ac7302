"""The LightningModule's update through a real Lightning Trainer: every trained parameter moves, and the update is
the same whatever the micro-batching (the mini-batch's global token count, docs/design.md#why-it-is-shaped-this-way)."""
from __future__ import annotations

import copy
import dataclasses
from functools import partial
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.loggers import Logger
import torch
from torch.utils.data import DataLoader

from src.data.minibatches import micro_batches
from src.data.rollout import inference
from src.models.old_log_probs import score_samples
from src.data.samples import MicroBatch, StepSample
from src.models.algorithm_config import AlgorithmConfig
from src.models.empo2_module import EMPO2Module, _pad_rows
from src.models.memory_estimate import count_parameters
from src.models.policy import build_policy

ALGORITHM = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.3, "clip_ratio_c": 10.0, "loss_agg_mode": "token-mean",
             "mask_modes": ["off_policy"], "kl_coef": 0.0, "temperature": 1.0}


def _module(tiny_model_dir, model_cache_dir, optimizer, **algorithm) -> EMPO2Module:
    torch.manual_seed(0)
    return EMPO2Module(policy={"name_or_path": tiny_model_dir, "cache_dir": str(model_cache_dir), "dtype": "float32"},
                       algorithm={**ALGORITHM, **algorithm}, optimizer=optimizer, gradient_clip_val=None)


def _samples(module: EMPO2Module) -> list[StepSample]:
    """Four steps with advantages ±1 whose old log-probs are the policy's own (ratio 1 at the first update)."""
    policy = module.policy
    prompts = [policy.encode([{"role": "user", "content": f"step {k} of the task"}]) for k in range(4)]
    responses = [[100, 200, 300], [400, 500], [600, 700, 800, 900], [1000]]
    with torch.no_grad():
        old = policy.log_probs(prompts, responses)["log_probs"]
    return [StepSample(rollout_prompt_ids=p, update_prompt_ids=p, old_prompt_ids=p, response_ids=r,
                       rollout_log_probs=old[i, : len(r)].tolist(), advantage=[1.0, -1.0, 0.5, -0.5][i],
                       old_log_probs=old[i, : len(r)].clone())
            for i, (p, r) in enumerate(zip(prompts, responses))]


def _micro_batches(samples: list[StepSample], micro_batch_size: int, mode: str = "on_policy",
                   iteration: int = 0, eos: int = 0, micro_batch_tokens: int | None = None) -> list[MicroBatch]:
    """One mini-batch of ``samples`` cut into micro-batches by the iteration's own ``micro_batches``."""
    info = {"iteration": iteration, "mode": mode, "rollout_global_step": iteration}
    return list(micro_batches(samples, info, {}, seed=0, iteration=iteration, ppo_epochs=1,
                              micro_batch_size=micro_batch_size, padding=lambda: StepSample.padding(eos),
                              micro_batch_tokens=micro_batch_tokens))


def _score(module, samples: list[StepSample]) -> None:
    """π_old (and the reference's log-probs) as the iteration scores them: eval mode, no grad."""
    with inference(module.policy):
        score_samples(samples, module.policy, module.ref_policy, module.algorithm)


def _fit(module: EMPO2Module, batches: list[MicroBatch]) -> None:
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))


def test_every_trained_parameter_moves(tiny_model_dir, model_cache_dir):
    module = _module(tiny_model_dir, model_cache_dir, partial(torch.optim.AdamW, lr=1e-3))
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}
    _fit(module, _micro_batches(_samples(module), 4))
    after = dict(module.policy.named_parameters())
    unchanged = [n for n, p in before.items() if torch.equal(p, after[n].detach())]
    assert not unchanged, f"parameters that did not move: {unchanged}"


@pytest.mark.parametrize("mode", ["on_policy", "off_policy"])
def test_update_is_invariant_to_micro_batching(tiny_model_dir, model_cache_dir, mode):
    """One micro-batch of 4 or micro-batches of 2+2 / 1+1+1+1 give the same SGD step (loss uses the global count)."""
    sgd = partial(torch.optim.SGD, lr=1.0)
    reference = _module(tiny_model_dir, model_cache_dir, sgd, lowprob_log_threshold=-11.0)
    samples = _samples(reference)
    deltas = []
    for size in (4, 2, 1):
        module = copy.deepcopy(reference)
        start = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
        batches = _micro_batches(copy.deepcopy(samples), size, mode)
        assert len(batches) == 4 // size
        _fit(module, batches)
        deltas.append({n: p.detach() - start[n] for n, p in module.policy.named_parameters()})
    assert any(d.abs().max() > 0 for d in deltas[0].values())
    for other in deltas[1:]:
        for name, d in deltas[0].items():
            torch.testing.assert_close(other[name], d, atol=1e-6, rtol=1e-4)


def _task_samples(module: EMPO2Module) -> list[StepSample]:
    """Steps of two tasks, interleaved, as a rollout collects them: a long system prompt, each task's text, each
    step's own history; advantages ±1; old log-probs the policy's own."""
    policy = module.policy
    system = "You are an agent in a text world. Reply with one action. " * 4
    prompts = [policy.encode([{"role": "system", "content": system},
                              {"role": "user", "content": f"Task: {task}. History: {'look ' * k}. What next?"}])
               for k in range(4) for task in ("boil water in the kitchen", "find the red key")]
    responses = [[100 + k, 200, 300][: 1 + k % 3] for k in range(len(prompts))]
    with torch.no_grad():
        old = policy.log_probs(prompts, responses)["log_probs"]
    return [StepSample(rollout_prompt_ids=p, update_prompt_ids=p, old_prompt_ids=p, response_ids=r,
                       rollout_log_probs=old[i, : len(r)].tolist(), advantage=1.0 if i % 3 else -1.0,
                       old_log_probs=old[i, : len(r)].clone() * 1.01, key=(i, 0))
            for i, (p, r) in enumerate(zip(prompts, responses))]


def test_micro_batches_hold_the_steps_of_one_task(tiny_model_dir, model_cache_dir):
    """Within a mini-batch the samples go in prompt order, so a micro-batch holds steps of one task and its rows share
    the system prompt and the task text (the update computes them once)."""
    module = _module(tiny_model_dir, model_cache_dir, partial(torch.optim.SGD, lr=1.0))
    samples = _task_samples(module)
    task = {s.key: s.key[0] % 2 for s in samples}
    batches = _micro_batches(samples, 4)
    assert len(batches) == 2 and all(len({task[s.key] for s in b.samples}) == 1 for b in batches)
    policy = module.policy
    across = policy.shared_prefix_length([samples[0].update_prompt_ids, samples[1].update_prompt_ids])  # system only
    assert all(policy.shared_prefix_length([s.update_prompt_ids for s in b.samples]) > across + 5 for b in batches)


def test_the_update_on_a_shared_prefix_gives_the_unshared_loss_entropy_and_gradients(tiny_model_dir,
                                                                                      model_cache_dir):
    """EMPO2Module._loss with the micro-batch's common prompt prefix computed once (the default) against every row
    computed whole: the same loss, metrics (entropy, clip fraction, approx KL) and gradient of every parameter, up
    to float rounding."""
    module = _module(tiny_model_dir, model_cache_dir, partial(torch.optim.SGD, lr=1.0))
    batch = _micro_batches(_task_samples(module), 4)[0]
    assert module.policy.shared_prefix_length([s.update_prompt_ids for s in batch.samples]) > 70
    results = []
    for share in (False, True):
        module.share_prompt_prefix = share
        module.policy.zero_grad()
        loss, metrics, tokens, _ = module._loss(batch)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in module.policy.named_parameters() if p.grad is not None}
        results.append((loss.detach(), metrics, tokens, grads))
    (loss, metrics, tokens, grads), (loss_s, metrics_s, tokens_s, grads_s) = results
    assert tokens == tokens_s and metrics.keys() == metrics_s.keys()
    torch.testing.assert_close(loss_s, loss, atol=1e-6, rtol=1e-5)
    for key, value in metrics.items():
        assert metrics_s[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert len(grads) == len(list(module.policy.parameters())) and grads.keys() == grads_s.keys()
    for name, g in grads.items():
        torch.testing.assert_close(grads_s[name], g, atol=1e-5, rtol=1e-4, msg=name)


def _paper_module(tiny_model_dir, experiment: str = "webshop_paper", *overrides: str) -> tuple[EMPO2Module, dict]:
    """The paper experiment's model group (Qwen2.5-7B's settings: weights loaded in bf16, lr 1e-6) instantiated
    like src/train.py does, with the tiny model's weights."""
    import hydra
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    root = Path(__file__).resolve().parents[1]
    with initialize_config_dir(config_dir=str(root / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"experiment={experiment}",
                                                      f"model.policy.name_or_path={tiny_model_dir}", *overrides])
    assert cfg.model.policy.dtype == "bfloat16" and cfg.model.optimizer.lr == 1e-6
    from src.warm_start import warm_start_model_config

    model_cfg, warm_start = warm_start_model_config(cfg)  # as src/train.py; the paper runs have no warm start
    assert warm_start is None
    torch.manual_seed(0)
    return hydra.utils.instantiate(model_cfg, algorithm=OmegaConf.to_container(cfg.algorithm, resolve=True)), cfg


def test_paper_path_trains_fp32_master_weights_under_bf16_mixed(tiny_model_dir):
    """3 AdamW steps at lr 1e-6 under bf16-mixed change >= 99% of the trained entries (a bf16 parameter keeps
    ~2% of such updates), the trained parameters are float32 and the frozen KL reference stays bf16."""
    module, cfg = _paper_module(tiny_model_dir)
    assert module.ref_policy is not None  # webshop_paper has a KL term
    samples = _samples(module)
    for s in samples:
        s.ref_log_probs = s.old_log_probs.clone()
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}
    batches = [b for _ in range(3) for b in _micro_batches(copy.deepcopy(samples), 4)]
    trainer = L.Trainer(accelerator="cpu", precision=cfg.trainer.precision, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    assert trainer.precision == "bf16-mixed"
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    assert module.global_step == 3
    after = dict(module.policy.named_parameters())
    changed = sum(int((after[n].detach() != p).sum()) for n, p in before.items())
    total = sum(p.numel() for p in before.values())
    assert changed / total >= 0.99, f"only {changed / total:.1%} of trained entries changed"
    assert {after[n].dtype for n in before} == {torch.float32}
    assert {p.dtype for p in module.ref_policy.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in module.ref_policy.parameters())


def test_lora_adapters_are_fp32_on_a_bf16_base(tiny_model_dir):
    module, _ = _paper_module(tiny_model_dir, "scienceworld_paper", "model.policy.lora.enabled=true",
                              "model.policy.lora.r=4")
    dtypes = {(p.requires_grad, p.dtype) for p in module.policy.parameters()}
    assert dtypes == {(True, torch.float32), (False, torch.bfloat16)}
    assert module.ref_policy is None


def test_low_precision_master_weights_warn_and_bf16_true_is_refused(tiny_model_dir, model_cache_dir, caplog):
    """Insisting on bf16 trainable parameters is possible (with a warning); a precision plugin that casts fp32
    master weights to bf16 behind the config's back (bf16-true) stops the run before the first update."""
    import logging

    with caplog.at_level(logging.WARNING, logger="src.models.precision"):
        policy = build_policy(name_or_path=tiny_model_dir, cache_dir=str(model_cache_dir), dtype="float32",
                              master_dtype="bfloat16")
    assert {p.dtype for p in policy.parameters()} == {torch.bfloat16}
    assert "model.policy.master_dtype=bfloat16" in caplog.text and "master_dtype=float32" in caplog.text
    with pytest.raises(ValueError, match="'float8'"):
        build_policy(name_or_path=tiny_model_dir, cache_dir=str(model_cache_dir), master_dtype="float8")
    module = _module(tiny_model_dir, model_cache_dir, partial(torch.optim.AdamW, lr=1e-6))
    trainer = L.Trainer(accelerator="cpu", precision="bf16-true", max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(RuntimeError, match="master weights.*bf16-true"):
        trainer.fit(module, train_dataloaders=DataLoader(_micro_batches(_samples(module), 4), batch_size=None))


@pytest.mark.parametrize("mode", ["on_policy", "off_policy"])
@pytest.mark.parametrize("mask_modes", [["off_policy"], []])
def test_low_prob_masking_runs_only_in_mask_modes(tiny_model_dir, model_cache_dir, mode, mask_modes):
    """With log δ = 0 every token is "low-probability" (log p < 0): where masking runs, no policy-gradient term is
    left and SGD does not move; elsewhere it does. So masking in every mode, or in none, fails a case."""
    module = _module(tiny_model_dir, model_cache_dir, partial(torch.optim.SGD, lr=1.0), mask_modes=mask_modes,
                     lowprob_log_threshold=0.0)
    start = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    _fit(module, _micro_batches(_samples(module), 4, mode))
    moved = any(not torch.equal(p.detach(), start[n]) for n, p in module.policy.named_parameters())
    assert moved == (mode not in mask_modes)


def _loss_and_grads(module: EMPO2Module, batch: MicroBatch):
    module.policy.zero_grad(set_to_none=True)
    loss, metrics, _, _ = module._loss(batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.policy.named_parameters() if p.grad is not None}
    return loss.detach(), grads, metrics


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_is_with_equal_log_probs_leaves_the_update_unchanged_bit_for_bit(tiny_model_dir, model_cache_dir,
                                                                                  level):
    """Sampling and scoring log-probs identical (as with recompute_old_log_probs=false): every weight is exactly 1,
    so the loss and every gradient are the same, bit for bit, with the correction on and off."""
    module = _module(tiny_model_dir, model_cache_dir, partial(torch.optim.SGD, lr=1.0))
    batch = _micro_batches(_samples(module), 4)[0]
    loss_off, grads_off, metrics = _loss_and_grads(module, batch)
    assert metrics["rollout_is_weight_mean"] == (1.0, 10.0) and metrics["rollout_log_prob_diff_max"] == (0.0, 10.0)
    module.algorithm = AlgorithmConfig.from_dict({**ALGORITHM, "rollout_is": level, "rollout_is_cap": 1.0})
    loss_on, grads_on, _ = _loss_and_grads(module, batch)
    assert torch.equal(loss_on, loss_off)
    assert grads_on.keys() == grads_off.keys() and grads_on
    assert all(torch.equal(grads_on[n], g) for n, g in grads_off.items())


def test_rollout_is_weights_a_mismatched_step_and_logs_the_mismatch(tiny_model_dir, model_cache_dir):
    """Sample 0's rollout log-probs 0.3 nats above π_old (weight e^-0.3 on its 3 tokens); sample 1's π_old is taken
    under another prompt (tips stripped), so it is not compared. Logged over the 8 compared tokens: mean |Δ| =
    3 · 0.3 / 8, weight mean (3 e^-0.3 + 5) / 8. The correction changes the update only when it is on."""
    import math

    module = _module(tiny_model_dir, model_cache_dir, partial(torch.optim.SGD, lr=1.0))
    samples = _samples(module)
    samples[0].rollout_log_probs = [x + 0.3 for x in samples[0].rollout_log_probs]
    samples[1].old_prompt_ids = samples[1].old_prompt_ids[1:]
    samples[1].rollout_log_probs = [x - 5.0 for x in samples[1].rollout_log_probs]
    batch = _micro_batches(samples, 4)[0]
    _, grads_off, _ = _loss_and_grads(module, batch)
    module.algorithm = AlgorithmConfig.from_dict({**ALGORITHM, "rollout_is": "token"})
    _, grads_on, _ = _loss_and_grads(module, batch)
    assert any(not torch.equal(grads_on[n], g) for n, g in grads_off.items())
    logger = _fit_logged(module, [batch])
    [diff] = logger.series("train/rollout_log_prob_diff")
    assert diff == pytest.approx(3 * 0.3 / 8, abs=1e-6)
    assert logger.series("train/rollout_log_prob_diff_max") == [pytest.approx(0.3, abs=1e-6)]
    assert logger.series("train/rollout_is_weight_mean") == [pytest.approx((3 * math.exp(-0.3) + 5) / 8, abs=1e-6)]
    assert logger.series("train/rollout_is_weight_max") == [1.0]


@pytest.mark.parametrize("setting, match", [({"rollout_is": "tis"}, "algorithm.rollout_is='tis'"),
                                            ({"rollout_is_cap": 0.5}, "algorithm.rollout_is_cap=0.5")])
def test_bad_rollout_is_settings_are_refused(setting, match):
    with pytest.raises(ValueError, match=match):
        AlgorithmConfig.from_dict(setting)


def test_a_mini_batch_without_samples_leaves_the_policy_alone(tiny_model_dir, model_cache_dir):
    """A mini-batch with no sample on any rank (all advantages 0 under skip_zero_advantage) is padding only; the
    optimizer step it ends must not move the weights (AdamW's momentum and weight decay would) but still counts."""
    adamw = partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    reference = _module(tiny_model_dir, model_cache_dir, adamw)
    samples = _samples(reference)
    empty = _micro_batches([], 4, iteration=1, eos=reference.policy.tokenizer.eos_token_id)
    assert [(b.loss_scale, b.has_data) for b in empty] == [(0.0, False)]
    trained = {}
    for name, extra in (("one step", []), ("then an empty mini-batch", empty)):
        module = copy.deepcopy(reference)
        _fit(module, _micro_batches(copy.deepcopy(samples), 4) + extra)
        trained[name] = (module.trainer.global_step, {n: p.detach().clone() for n, p in module.policy.named_parameters()})
    (steps_a, params_a), (steps_b, params_b) = trained.values()
    assert (steps_a, steps_b) == (1, 2)
    moved = [n for n in params_a if not torch.equal(params_a[n], params_b[n])]
    assert not moved, f"parameters moved by an update without data: {moved[:5]}"


class _MetricsLogger(Logger):
    """Keeps every logged (step, metrics) pair in memory."""

    def __init__(self):
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "in_memory"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def series(self, key: str) -> list[float]:
        return [m[key] for _, m in self.rows if key in m]


def _poison_gradient(module: EMPO2Module, steps: set[int]) -> None:
    """One NaN entry in one gradient during the optimizer steps ``steps`` (0-based global steps)."""
    param = next(p for p in module.policy.parameters() if p.requires_grad)

    def hook(grad):
        if module.global_step not in steps:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad

    param.register_hook(hook)


def _fit_logged(module: EMPO2Module, batches: list[MicroBatch]) -> _MetricsLogger:
    logger = _MetricsLogger()
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=logger, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    return logger


def test_a_non_finite_gradient_skips_the_step(tiny_model_dir, model_cache_dir, caplog):
    """One NaN entry in one gradient (verl #1197): the step is skipped (weights and AdamW state as before it, the
    step still counts), logged as train/nonfinite_grad_steps and warned about; the next finite step trains."""
    import logging

    adamw = partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    reference = _module(tiny_model_dir, model_cache_dir, adamw)
    samples = _samples(reference)

    def steps(n):
        return [b for _ in range(n) for b in _micro_batches(copy.deepcopy(samples), 4)]

    clean = copy.deepcopy(reference)
    _fit(clean, steps(1))
    poisoned = copy.deepcopy(reference)
    _poison_gradient(poisoned, {1})
    with caplog.at_level(logging.WARNING, logger="src.models.empo2_module"):
        logger = _fit_logged(poisoned, steps(2))
    assert poisoned.global_step == 2
    after = dict(poisoned.policy.named_parameters())
    nonfinite = [n for n, p in after.items() if not torch.isfinite(p).all()]
    assert not nonfinite, f"{len(nonfinite)} of {len(after)} parameters hold NaN/inf after one NaN gradient entry"
    moved = [n for n, p in clean.policy.named_parameters() if not torch.equal(p, after[n])]
    assert not moved, f"parameters moved by the skipped step: {moved[:5]}"
    states = [m.trainer.optimizers[0].state_dict()["state"] for m in (clean, poisoned)]
    assert states[0].keys() == states[1].keys()
    for k in states[0]:
        for name, value in states[0][k].items():
            assert torch.equal(value, states[1][k][name]), (k, name)
    assert logger.series("train/nonfinite_grad_steps") == [0.0, 1.0]
    assert logger.series("train/update_skipped") == [0.0, 1.0]
    assert "not finite" in caplog.text and "iteration 0" in caplog.text and "global step 1" in caplog.text
    # the streak ends with the next finite step, which trains
    again = copy.deepcopy(reference)
    _poison_gradient(again, {1})
    logger = _fit_logged(again, steps(3))
    assert logger.series("train/nonfinite_grad_steps") == [0.0, 1.0, 0.0]
    assert any(not torch.equal(p, after[n]) for n, p in again.policy.named_parameters())


def test_consecutive_non_finite_gradients_stop_the_run(tiny_model_dir, model_cache_dir):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "configs"), version_base="1.3"):
        for algorithm in ("empo2", "grpo"):
            assert compose(config_name="train", overrides=[f"algorithm={algorithm}"]).algorithm.max_nonfinite_steps == 3
    module = _module(tiny_model_dir, model_cache_dir, partial(torch.optim.AdamW, lr=1e-3), max_nonfinite_steps=2)
    samples = _samples(module)
    _poison_gradient(module, {1, 2})
    with pytest.raises(RuntimeError, match=r"2 consecutive optimizer steps.*iteration 0.*max_nonfinite_steps=2"):
        _fit(module, [b for _ in range(4) for b in _micro_batches(copy.deepcopy(samples), 4)])
    assert module.global_step == 3
    assert all(torch.isfinite(p).all() for p in module.policy.parameters())


def test_a_checkpoint_is_never_written_from_non_finite_weights(tiny_model_dir, model_cache_dir, tmp_path):
    module = _module(tiny_model_dir, model_cache_dir, partial(torch.optim.AdamW, lr=1e-3))
    _fit(module, _micro_batches(_samples(module), 4))
    module.trainer.save_checkpoint(tmp_path / "finite.ckpt")
    name, param = next((n, p) for n, p in module.policy.named_parameters() if p.requires_grad)
    with torch.no_grad():
        param.view(-1)[3] = float("inf")
    with pytest.raises(RuntimeError, match=rf"Refusing to save a checkpoint.*iteration 0.*{name}"):
        module.trainer.save_checkpoint(tmp_path / "broken.ckpt")
    assert not (tmp_path / "broken.ckpt").exists()


def test_the_first_ratio_is_exactly_one_despite_dropout_settings(tiny_model_dir, model_cache_dir, tmp_path, caplog):
    """A checkpoint whose config sets attention_dropout=0.1 and a LoRA dropout of 0.1 (TRL PR #3234): π_old is
    scored in eval mode and the update runs in train mode, so any active dropout makes the first ratio differ
    from 1. The policy is built without dropout, and says what it zeroed."""
    import json
    import logging
    import shutil

    model_dir = tmp_path / "tiny-with-dropout"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    lora = {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.1, "target_modules": "all-linear"}
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="src.models.policy"):
        module = EMPO2Module(policy={"name_or_path": str(model_dir), "cache_dir": str(model_cache_dir),
                                     "dtype": "float32", "lora": lora},
                             algorithm=ALGORITHM, optimizer=partial(torch.optim.SGD, lr=1e-3), gradient_clip_val=None)
    assert "attention_dropout=0.1" in caplog.text and "model.policy.lora.dropout=0.1" in caplog.text
    with torch.no_grad():  # the LoRA branch is 0 while lora_B is at its zero init, whatever its dropout
        for name, p in module.policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    samples = _samples(module)
    _score(module, samples)
    module.policy.train()  # the mode inference() restores, in which the update runs
    logger = _fit_logged(module, _micro_batches(samples, 4))
    assert logger.series("train/ratio_max") == [1.0]
    assert logger.series("train/ratio_mean") == [1.0]


@pytest.fixture
def sft_adapter(tiny_model_dir, model_cache_dir, tmp_path):
    """A PEFT LoRA adapter directory on the tiny model (the "SFT model": lora_B away from its zero init, a stored
    dropout of 0.1) and the log-prob function of the model it defines, with the raw base's for comparison."""
    from peft import LoraConfig, get_peft_model

    from src.models.policy import Policy

    base = build_policy(name_or_path=tiny_model_dir, cache_dir=str(model_cache_dir), dtype="float32").eval()
    torch.manual_seed(1)
    adapted = get_peft_model(copy.deepcopy(base.model), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                                                    target_modules="all-linear", task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    adapted.save_pretrained(tmp_path / "adapter")
    base.tokenizer.save_pretrained(tmp_path / "adapter")  # as SFT scripts do
    sft = Policy(adapted.eval(), base.tokenizer)
    prompts = [base.encode([{"role": "user", "content": f"step {k} of the task"}]) for k in range(4)]
    responses = [[100, 200, 300], [400, 500], [600, 700, 800, 900], [1000]]

    def log_probs(policy, **kwargs):
        with torch.no_grad():
            return policy.log_probs(prompts, responses, **kwargs)["log_probs"]

    return {"dir": str(tmp_path / "adapter"), "base_dir": tiny_model_dir, "log_probs": log_probs, "sft": log_probs(sft),
            "base": log_probs(base)}


@pytest.mark.parametrize("lora", [True, False])
def test_a_lora_adapter_passed_as_the_policy_is_trained_and_is_the_reference(sft_adapter, model_cache_dir, lora):
    """model.policy.name_or_path = a PEFT adapter directory (TRL #1340): with LoRA the loaded adapter itself is
    trained, without LoRA the adapted (merged) model is; either way policy and KL reference start as the adapted
    model, not as the raw base."""
    lora_cfg = {"enabled": lora, "r": 4, "alpha": 8, "target_modules": "all-linear"}
    module = EMPO2Module(policy={"name_or_path": sft_adapter["dir"], "cache_dir": str(model_cache_dir),
                                 "dtype": "float32", "lora": lora_cfg},
                         algorithm={**ALGORITHM, "kl_coef": 0.1}, optimizer=partial(torch.optim.SGD, lr=1.0),
                         gradient_clip_val=None)
    log_probs, sft = sft_adapter["log_probs"], sft_adapter["sft"]
    gap = (sft - sft_adapter["base"]).abs().max()
    assert gap > 0.1  # the adapter changes the model
    torch.testing.assert_close(log_probs(module.policy.eval()), sft, atol=1e-5, rtol=0,
                               msg=lambda m: f"the policy is not the adapted model:\n{m}")
    trainable = [n for n, p in module.policy.named_parameters() if p.requires_grad]
    assert trainable and all(("lora_" in n) == lora for n in trainable)
    # the start-up memory check counts the base model and the adapter it trains
    counts = count_parameters(sft_adapter["dir"], lora_cfg)
    assert counts.total == count_parameters(sft_adapter["base_dir"]).total
    assert counts.adapters == (sum(p.numel() for p in module.policy.parameters() if p.requires_grad) if lora else 0)
    samples = _samples(module)
    _score(module, samples)
    ref = _pad_rows([s.ref_log_probs for s in samples], sft.shape[1])
    torch.testing.assert_close(ref, sft, atol=1e-5, rtol=0,
                               msg=lambda m: f"the reference is not the adapted model:\n{m}")
    _fit(module, _micro_batches(samples, 4))
    assert (log_probs(module.policy.eval()) - sft).abs().max() > 1e-4  # the policy trained ...
    _score(module, samples)
    torch.testing.assert_close(_pad_rows([s.ref_log_probs for s in samples], sft.shape[1]), ref, atol=0, rtol=0)


def test_the_iteration_log_line_counts_skipped_steps_apart(tiny_model_dir, model_cache_dir, caplog):
    """IterationLog (src/callbacks/iteration_log.py): of an iteration's two optimizer steps, one skipped (a NaN
    gradient entry) is reported as skipped, not as a step that trained; the line carries the rollout's score."""
    import dataclasses
    import logging

    from src.callbacks.iteration_log import IterationLog

    module = _module(tiny_model_dir, model_cache_dir, partial(torch.optim.AdamW, lr=1e-3))
    samples = _samples(module)
    _poison_gradient(module, {1})
    batches = [b for _ in range(2) for b in _micro_batches(copy.deepcopy(samples), 4)]
    batches[0] = dataclasses.replace(batches[0], metrics={"rollout/score": 0.25, "rollout/return": 0.5,
                                                          "rollout/success_rate": 0.0})
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[IterationLog()])
    with caplog.at_level(logging.INFO, logger="src.callbacks.iteration_log"):
        trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    line = next(r.getMessage() for r in caplog.records if r.name == "src.callbacks.iteration_log")
    assert line.startswith("iteration 0 (on_policy): score 0.25, return 0.5, success 0.00; 1 optimizer step(s)")
    assert "1 skipped (train/update_skipped" in line


@pytest.mark.parametrize("weight_decay,entropy_coef", [(0.0, 0.0), (0.01, 0.0), (0.01, 0.01)])
def test_a_mini_batch_without_advantage_leaves_the_policy_alone(tiny_model_dir, model_cache_dir, weight_decay,
                                                                entropy_coef):
    """Issue 59: an iteration whose advantages are all 0, kept under the default skip_zero_advantage=false, has no
    gradient signal; after a real update AdamW's momentum (and weight decay) would still move every weight. The step
    is skipped (weights and optimizer state bit-identical, logged as train/update_skipped 1) unless another term has a
    gradient (entropy_coef > 0), when it trains as before."""
    adamw = partial(torch.optim.AdamW, lr=1e-3, weight_decay=weight_decay)
    reference = _module(tiny_model_dir, model_cache_dir, adamw, entropy_coef=entropy_coef)
    samples = _samples(reference)
    flat = [dataclasses.replace(s, advantage=0.0) for s in copy.deepcopy(samples)]
    one = copy.deepcopy(reference)
    _fit(one, _micro_batches(copy.deepcopy(samples), 4))
    two = copy.deepcopy(reference)
    logger = _fit_logged(two, _micro_batches(copy.deepcopy(samples), 4) + _micro_batches(flat, 2, iteration=1))
    assert two.global_step == 2
    moved = [n for n, p in one.policy.named_parameters() if not torch.equal(p, dict(two.policy.named_parameters())[n])]
    if entropy_coef > 0:
        assert moved and logger.series("train/update_skipped") == [0.0, 0.0]
        return
    assert not moved, f"{len(moved)} parameters moved by an update without advantage: {moved[:5]}"
    states = [m.trainer.optimizers[0].state_dict()["state"] for m in (one, two)]
    assert states[0].keys() == states[1].keys()
    for k in states[0]:
        for name, value in states[0][k].items():
            assert torch.equal(value, states[1][k][name]), (k, name)
    assert logger.series("train/update_skipped") == [0.0, 1.0]
    assert logger.series("train/grad_norm")[1] == 0.0


def test_a_mini_batch_of_prefix_trees_gives_the_unshared_loss_and_gradients(tiny_model_dir, model_cache_dir):
    """data.micro_batch_tokens: the mini-batch cut into prefix trees under a token budget (issue 60) against every
    row computed whole in micro-batches of 2: the same mini-batch loss and gradient of every parameter (fp32), with
    fewer tokens computed."""
    from src.models.prefix_tree import tree_size

    module = _module(tiny_model_dir, model_cache_dir, partial(torch.optim.SGD, lr=1.0))
    module.share_prompt_prefix = False
    samples = _task_samples(module)
    budget = tree_size([s.update_prompt_ids + s.response_ids for s in samples]) * 2 // 3  # 2 or 3 trees
    results = []
    for cut in ({"micro_batch_size": 2}, {"micro_batch_size": 2, "micro_batch_tokens": budget}):
        batches = _micro_batches(samples, **cut)
        module.policy.zero_grad()
        total, computed = 0.0, 0
        for batch in batches:
            loss, _, _, tokens = module._loss(batch)
            loss.backward()
            total, computed = total + float(loss.detach()), computed + tokens
        grads = {n: p.grad.clone() for n, p in module.policy.named_parameters() if p.grad is not None}
        results.append((total, computed, len(batches), grads))
    (loss, computed, n_plain, grads), (loss_t, computed_t, n_tree, grads_t) = results
    assert n_plain == 4 and 1 < n_tree < n_plain and computed_t < 0.6 * computed
    assert loss_t == pytest.approx(loss, rel=1e-5)
    assert grads.keys() == grads_t.keys() and len(grads) == len(list(module.policy.parameters()))
    for name, g in grads.items():
        assert float((grads_t[name] - g).norm() / g.norm().clamp(min=1e-12)) <= 1e-5, name
