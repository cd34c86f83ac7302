"""The LightningModule: the policy and the hybrid EMPO²/GRPO update (SPEC §2.2–§2.5).

One training batch is one micro-batch of step samples from ``RolloutDataModule`` (update prompt ids, response
ids, old log-probs, advantage). The update reads top to bottom in the paper's terms:

    log π_θ(a|s)  →  low-probability mask (modes in ``mask_modes``)  →  PPO-clip + dual clip (+ KL)
    →  aggregation with the mini-batch's global token count  →  backward; optimizer step after the
    mini-batch's last micro-batch.

Optimization is manual because a mini-batch is a variable number of micro-batches (episode lengths vary).
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Any

import lightning as L
import torch

from src.data.rollout import padding_sample
from src.models.core_algos import (UPDATE_MODES, aggregate_loss, check_algorithm_config, compute_kl_loss,
                                   compute_policy_loss, low_prob_token_mask)
from src.models.policy import build_policy
from src.models.precision import check_trainable_dtype, fsdp_mixed_precision, torch_dtype
from src.utils.distributed import all_reduce

log = logging.getLogger(__name__)

# Metrics aggregated with the mini-batch's global counts: their micro-batch values add up to the mini-batch value.
PARTIAL_SUMS = ("pg_loss", "kl_loss", "entropy")
PROGRESS_BAR_KEYS = ("rollout/return", "rollout/score", "rollout/success_rate", "train/pg_loss")


def _pad_rows(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r[:width]
    return out


class EMPO2Module(L.LightningModule):
    """Holds the policy (and a frozen reference when needed) and applies the hybrid loss.

    Args:
        policy: kwargs of ``build_policy`` (``name_or_path``, ``cache_dir``, ``dtype``, ``lora``, ...).
        algorithm: ``clip_ratio_low/high``, ``clip_ratio_c``, ``loss_agg_mode``, ``mask_modes`` (modes that use
            low-probability masking), ``lowprob_log_threshold``, ``mask_level``, ``kl_coef``, ``kl_type``,
            ``entropy_coef``, ``temperature`` (rollout temperature; log-probs are taken at it).
        optimizer: a partial ``torch.optim`` constructor (Hydra ``_partial_``).
        gradient_clip_val: max global grad norm (manual optimization clips here, not in the Trainer).
    """

    def __init__(self, policy: dict[str, Any], algorithm: dict[str, Any], optimizer, gradient_clip_val: float | None = 1.0):
        super().__init__()
        # the optimizer is a callable (Hydra partial): checkpoints must stay loadable with weights_only=True
        self.save_hyperparameters(logger=False, ignore=["optimizer"])
        self.optimizer_factory = optimizer
        self.automatic_optimization = False
        check_algorithm_config(algorithm)
        self.algorithm = dict(algorithm)
        self.policy = build_policy(**policy)
        self.ref_policy = None
        lora = (policy.get("lora") or {}).get("enabled", False)
        if float(self.algorithm.get("kl_coef", 0.0)) > 0 and not lora:
            # Without LoRA the reference is a frozen copy; with LoRA it is the base model (adapters off).
            self.ref_policy = build_policy(**{**policy, "gradient_checkpointing": False, "trainable": False})
        self._step_stats: dict[str, float] = {}
        self._train_tokens = 0
        self._train_time = 0.0

    def configure_model(self) -> None:
        """FSDP2 (``trainer=fsdp``: Lightning's ``ModelParallelStrategy``): shard each decoder layer and the root.

        Under ``bf16-mixed`` the sharded parameters stay fp32 master weights, all-gathered in bf16 for compute,
        with gradients reduce-scattered in fp32 (``precision.fsdp_mixed_precision``). Sharded parameters are
        gathered inside each module's forward, so every rank must run the same number of forward passes: the
        policy is switched to synchronised generation (see ``run_episodes``).
        """
        from lightning.pytorch.strategies import ModelParallelStrategy

        if self._trainer is None or not isinstance(self.trainer.strategy, ModelParallelStrategy):
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        mp_policy = self._fsdp_mp_policy = fsdp_mixed_precision(self.trainer.precision)
        for policy in (self.policy, self.ref_policy):
            if policy is None:
                continue
            model = policy.model
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            for layer in base.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
            fully_shard(model, mesh=mesh, mp_policy=mp_policy)
            policy.synced = True

    def on_fit_start(self) -> None:
        """Refuse trainable parameters that are not master weights of ``master_dtype``; log the precision layout."""
        expected = torch_dtype(self.hparams.policy.get("master_dtype", "float32"))
        summary = check_trainable_dtype(self.policy, expected, self.trainer.precision)
        if self.ref_policy is not None:
            summary += f"; frozen reference in {next(self.ref_policy.parameters()).dtype}"
        mp = getattr(self, "_fsdp_mp_policy", None)
        if mp is not None:
            summary += f"; FSDP2 compute {mp.param_dtype or 'unchanged'}, gradient reduction {mp.reduce_dtype}"
        log.info("Precision: %s", summary)

    # ------------------------------------------------------------------ rollout-time helpers
    @contextlib.contextmanager
    def rollout_context(self):
        """Eval mode, no grad, the Trainer's precision context (autocast under bf16-mixed)."""
        was_training = self.policy.training
        self.policy.eval()
        ctx = self.trainer.precision_plugin.forward_context() if self._trainer is not None else contextlib.nullcontext()
        try:
            with torch.no_grad(), ctx:
                yield
        finally:
            self.policy.train(was_training)

    @torch.no_grad()
    def score_samples(self, samples: list[dict], mode: str, micro_batch_size: int = 8) -> None:
        """Attach ``old_log_probs`` (and ``ref_log_probs`` when KL is on) to each sample, in place.

        Old log-probs are recomputed by a forward pass over the behaviour prompt (with tips, or without under
        ``offpolicy_old_logprob: without_tips``), so the first update's ratio is exactly 1 where nothing
        changed. With ``algorithm.recompute_old_log_probs: false`` the sampling log-probs are used wherever the
        behaviour prompt is the rollout prompt (they agree to ~1e-4 in fp32, see tests/test_rollout.py).
        """
        temperature = float(self.algorithm.get("temperature", 1.0))
        kl = float(self.algorithm.get("kl_coef", 0.0)) > 0
        # The sampling log-probs are π_old itself when the behaviour prompt is the rollout prompt; recomputing
        # costs a forward pass (a third of a CPU iteration) for numerically tiny differences, so it is optional.
        # The off-policy `without_tips` variant always needs the forward pass (a different prompt).
        # Under FSDP every rank must run the same forward passes, so nothing is reused there.
        reuse = not self.algorithm.get("recompute_old_log_probs", True) and not self.policy.synced
        n_chunks = math.ceil(len(samples) / micro_batch_size)
        if self.policy.synced:  # sharded weights: every rank runs the same number of forward passes
            n_chunks = int(all_reduce([float(n_chunks)], op="max")[0])
        for k in range(n_chunks):
            # a rank with fewer samples scores a throw-away copy, to join the other ranks' forward passes
            chunk = (samples[k * micro_batch_size:(k + 1) * micro_batch_size]
                     or [padding_sample(self.policy.tokenizer.eos_token_id)])
            responses = [s["response_ids"] for s in chunk]
            need = []
            for s in chunk:
                if reuse and s["old_prompt_ids"] is s["rollout_prompt_ids"]:
                    s["old_log_probs"] = torch.tensor(s["sample_log_probs"], dtype=torch.float32)
                else:
                    need.append(s)
            if need:
                out = self.policy.log_probs([s["old_prompt_ids"] for s in need], [s["response_ids"] for s in need],
                                            temperature=temperature)
                for i, s in enumerate(need):
                    s["old_log_probs"] = out["log_probs"][i, : len(s["response_ids"])].float().cpu()
            if not kl:
                continue
            if self.ref_policy is not None:
                ref = self.ref_policy.log_probs([s["prompt_ids"] for s in chunk], responses, temperature=temperature)
            else:
                ref = self.policy.log_probs([s["prompt_ids"] for s in chunk], responses, temperature=temperature,
                                            disable_adapters=True)
            for i, s in enumerate(chunk):
                s["ref_log_probs"] = ref["log_probs"][i, : len(s["response_ids"])].float().cpu()

    # ------------------------------------------------------------------ training
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        tic = time.perf_counter()
        algo = self.algorithm
        samples = batch["samples"]
        prompts = [s["prompt_ids"] for s in samples]
        responses = [s["response_ids"] for s in samples]
        out = self.policy.log_probs(prompts, responses, temperature=float(algo.get("temperature", 1.0)), with_entropy=True)
        log_probs, mask = out["log_probs"], out["response_mask"]
        width = log_probs.shape[1]
        old_log_probs = _pad_rows([s["old_log_probs"] for s in samples], width).to(log_probs.device)
        advantages = torch.tensor([s["advantage"] for s in samples], dtype=torch.float32, device=log_probs.device)
        keep = None
        if batch["mode"] in algo.get("mask_modes", []):
            keep = low_prob_token_mask(log_probs.detach(), mask, float(algo.get("lowprob_log_threshold", -5.0)),
                                       algo.get("mask_level", "token"))
        agg = dict(loss_agg_mode=algo.get("loss_agg_mode", "token-mean"),
                   global_token_count=batch["global_token_count"], global_seq_count=batch["global_seq_count"])
        loss, metrics = compute_policy_loss(
            log_probs, old_log_probs, advantages, mask, clip_ratio_low=float(algo.get("clip_ratio_low", 0.2)),
            clip_ratio_high=float(algo.get("clip_ratio_high", 0.3)), clip_ratio_c=float(algo.get("clip_ratio_c", 10.0)),
            keep_mask=keep, **agg)
        kl_coef = float(algo.get("kl_coef", 0.0))
        if kl_coef > 0:
            ref = _pad_rows([s["ref_log_probs"] for s in samples], width).to(log_probs.device)
            kl_loss, kl_metrics = compute_kl_loss(log_probs, ref, mask, kind=algo.get("kl_type", "low_var_kl"), **agg)
            loss = loss + kl_coef * kl_loss
            metrics.update(kl_metrics)
        entropy_coef = float(algo.get("entropy_coef", 0.0))
        entropy = aggregate_loss(out["entropy"], mask, **agg)
        if entropy_coef > 0:
            loss = loss - entropy_coef * entropy
        metrics["entropy"] = float(entropy.detach())
        # The loss is a partial sum over this rank's share of the global batch; DDP/FSDP average gradients
        # over ranks, so scale back up to get the global token-mean (SPEC §2.3).
        world = self.trainer.world_size if self._trainer is not None else 1
        self.manual_backward(loss * world * batch["loss_scale"])
        if batch["loss_scale"] > 0:  # padding micro-batches (DDP/FSDP alignment) are not data
            self._accumulate(metrics, float(mask.sum()))
        self._train_tokens += int(sum(len(p) + len(r) for p, r in zip(prompts, responses)))
        if batch["last_micro"]:
            opt = self.optimizers()
            # total norm before clipping (what the loss asked for); works for plain and FSDP2 (DTensor) grads
            params = [p for p in self.policy.parameters() if p.grad is not None]
            clip = self.hparams.gradient_clip_val
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip else float("inf"))
            grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            self._log_update(batch, grad_norm)
        self._train_time += time.perf_counter() - tic
        if batch["metrics"]:
            modes = {f"rollout/mode_{m}": float(m == batch["mode"]) for m in UPDATE_MODES}
            metrics = {**batch["metrics"], **modes, "iteration": float(batch["iteration"]),
                       "rollout/global_step_at_rollout": float(batch["rollout_global_step"])}
            self._log_metrics(metrics, step=batch["rollout_global_step"])
            self.log_dict({k: metrics[k] for k in PROGRESS_BAR_KEYS if k in metrics}, logger=False, prog_bar=True,
                          on_step=True, on_epoch=False, batch_size=1)
        return loss.detach()

    def _log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """One point per iteration (rollout) or per optimizer step (update), straight to the loggers.

        ``self.log`` would re-log the last value at every micro-batch; these metrics have their own cadence.
        """
        for logger in self.loggers:
            logger.log_metrics(metrics, step=step)

    def _accumulate(self, metrics: dict[str, float], weight: float) -> None:
        s = self._step_stats
        s["_w"] = s.get("_w", 0.0) + weight
        for k, v in metrics.items():
            if k in PARTIAL_SUMS:
                s[k] = s.get(k, 0.0) + v  # partial sums of the mini-batch aggregate
            elif k == "ratio_max":
                s[k] = max(s.get(k, 0.0), v)
            else:
                s[k] = s.get(k, 0.0) + v * weight

    def _log_update(self, batch: dict[str, Any], grad_norm: float) -> None:
        s, self._step_stats = self._step_stats, {}
        w = max(s.pop("_w", 0.0), 1e-9)
        out = {}
        for k, v in s.items():
            out[f"train/{k}"] = v if k in PARTIAL_SUMS or k == "ratio_max" else v / w
        out["train/grad_norm"] = grad_norm
        out["train/lr"] = float(self.optimizers().param_groups[0]["lr"])
        out["train/tokens_per_s"] = self._train_tokens / max(self._train_time, 1e-9)
        out["train/update_s"] = self._train_time
        self._train_tokens, self._train_time = 0, 0.0
        self._log_metrics(out, step=self.global_step)
        self.log_dict({k: out[k] for k in PROGRESS_BAR_KEYS if k in out}, logger=False, prog_bar=True, on_step=True,
                      on_epoch=False, batch_size=1)

    # ------------------------------------------------------------------ validation
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        # already summarised over all ranks' episodes by `evaluate`
        self.log_dict({f"val/{k}": v for k, v in batch["metrics"].items()}, on_step=False, on_epoch=True,
                      batch_size=1)

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        return self.optimizer_factory(params=params)
