"""The LightningModule: the policy and the hybrid EMPO²/GRPO update (docs/method.md#one-iteration, step 8), in the
paper's terms: log π_θ(a|s) → low-probability mask → PPO-clip + dual clip (× rollout importance weight) (+ KL) →
aggregation with the mini-batch's global token count → backward; optimizer step after the mini-batch's last
micro-batch. Optimization is manual because a mini-batch is a variable number of micro-batches."""
from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any

import lightning as L
import torch

from src.models.algorithm_config import AlgorithmConfig
from src.models.checkpoint_state import (BASE_KEY, RUN_CONFIG_KEY, VALIDATION_KEY, base_record,
                                         check_adapter_checkpoint, check_finite, keep_trainable, lora_enabled)
from src.models.core_algos import (UPDATE_MODES, aggregate_loss, authors_low_prob_mask, compute_kl_loss,
                                   compute_policy_loss, low_prob_token_mask, rollout_is_weights)
from src.models.policy import PolicyConfig, build_policy, reference_is_a_copy
from src.models.precision import check_trainable_dtype, fsdp_mixed_precision, torch_dtype
from src.models.update_metrics import MiniBatchMetrics
from src.utils.distributed import all_reduce, combine_over_ranks
from src.utils.logging import log_validation_episodes
from src.utils.timing import peak_rss_gib

if TYPE_CHECKING:
    from src.data.samples import MicroBatch, StepSample

log = logging.getLogger(__name__)

PROGRESS_BAR_KEYS = ("rollout/return", "rollout/score", "rollout/success_rate", "train/pg_loss", "train/grad_norm")


def _pad_rows(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r[:width]
    return out


class EMPO2Module(L.LightningModule):
    """Holds the policy (and a frozen reference when needed) and applies the hybrid loss; ``algorithm=grpo`` (memory
    off) runs GRPO: every iteration on-policy, the clipped policy gradient alone. ``gradient_clip_val``: max global
    grad norm (manual optimization clips here, not in the Trainer)."""

    def __init__(self, policy: dict[str, Any], algorithm: dict[str, Any], optimizer, gradient_clip_val: float | None):
        super().__init__()
        # the optimizer is a callable (Hydra partial): checkpoints must stay loadable with weights_only=True
        self.save_hyperparameters(logger=False, ignore=["optimizer"])
        self.optimizer_factory = optimizer
        self.automatic_optimization = False
        self.algorithm = AlgorithmConfig.from_dict(algorithm)
        self.policy = build_policy(**policy)
        self.ref_policy = None
        if self.algorithm.kl_coef > 0 and reference_is_a_copy(policy):
            # the model as loaded: an adapter directory is merged into its base (lora off)
            self.ref_policy = build_policy(**{**policy, "gradient_checkpointing": False, "trainable": False,
                                              "lora": None})
        self._step_stats = MiniBatchMetrics()
        self._train_tokens = self._tokens_computed = 0
        self._train_time = 0.0
        self._signal_tokens = 0  # this rank's response tokens with a non-zero advantage in the current mini-batch
        self._nonfinite_streak = 0  # consecutive optimizer steps skipped for a NaN/inf gradient norm
        self._iteration = 0  # iteration of the last micro-batch trained on (named by errors)
        self._val_iteration: int | None = None  # iteration of the last validation
        self._validation: dict[str, Any] | None = None  # its metrics, saved with each checkpoint
        self._base: dict[str, Any] | None = None  # the LoRA base model's record (adapter-only checkpoints)
        self.run_config: dict[str, Any] | None = None  # the resolved training config, saved with each checkpoint
        self.share_prompt_prefix = True  # Policy.log_probs(share_prefix=True) in the update

    def configure_model(self) -> None:
        """FSDP2 (``trainer=fsdp``): shard each decoder layer and the root (``precision.fsdp_mixed_precision``). Sharded
        parameters are gathered inside each module's forward, so every rank must run the same forward passes: the policy
        switches to synchronised generation."""
        from lightning.pytorch.strategies import ModelParallelStrategy
        self.policy.engine.agree()  # first, with several ranks (any strategy): all run rank 0's rollout precision
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
        expected = torch_dtype(PolicyConfig.from_dict(self.hparams.policy).master_dtype)
        summary = check_trainable_dtype(self.policy, expected, self.trainer.precision)
        if self.ref_policy is not None:
            summary += f"; frozen reference in {next(self.ref_policy.parameters()).dtype}"
        mp = getattr(self, "_fsdp_mp_policy", None)
        if mp is not None:
            summary += f"; FSDP2 compute {mp.param_dtype or 'unchanged'}, gradient reduction {mp.reduce_dtype}"
        log.info("Precision: %s", summary)

    def on_train_start(self) -> None:
        """The configured optimizer hyper-parameters over the ones a resumed checkpoint restored (Lightning restores the
        saved param groups, so a resume with another learning rate would train at the old one: Lightning #4044);
        logged."""
        wanted = dict(getattr(self.optimizer_factory, "keywords", {}) or {})
        for opt in [o.optimizer if hasattr(o, "optimizer") else o for o in self.trainer.optimizers]:
            for group in opt.param_groups:
                for key, value in wanted.items():
                    if key in group and group[key] != value and not isinstance(value, (list, dict)):
                        log.info("Resumed optimizer: %s %s -> %s (model.optimizer.%s)", key, group[key], value, key)
                        group[key] = value

    def training_step(self, batch: MicroBatch, batch_idx: int) -> torch.Tensor:
        """One forward/backward of the hybrid loss on a micro-batch, aggregated over the mini-batch's global counts (the
        micro-batch losses add up to the mini-batch's loss), scaled by the world size (DDP/FSDP average gradients) and
        by ``batch.loss_scale`` (0 for a padding micro-batch). Returns the detached micro-batch loss."""
        tic = time.perf_counter()
        self._iteration = batch.iteration
        loss, metrics, num_tokens, computed = self._loss(batch)
        world = self.trainer.world_size if self._trainer is not None else 1
        self.manual_backward(loss * world * batch.loss_scale)
        if batch.loss_scale > 0:  # padding micro-batches (DDP/FSDP alignment) are not data
            self._step_stats.add(metrics, num_tokens)
            self._signal_tokens += sum(len(s.response_ids) for s in batch.samples if s.advantage != 0)
        self._train_tokens += sum(s.num_tokens for s in batch.samples)
        self._tokens_computed += computed
        if batch.last_micro:
            self._optimizer_step(batch)
        self._train_time += time.perf_counter() - tic
        if batch.metrics:
            self._log_rollout_metrics(batch)
        return loss.detach()

    def _loss(self, batch: MicroBatch) -> tuple[torch.Tensor, dict[str, float], float, int]:
        """(micro-batch loss, its metrics, its response-token count, the tokens its forward computed)."""
        algo, samples = self.algorithm, batch.samples
        out = self.policy.log_probs([s.update_prompt_ids for s in samples], [s.response_ids for s in samples],
                                    temperature=algo.temperature, with_entropy=True,
                                    share_prefix=self.share_prompt_prefix and not self.policy.synced,
                                    tree=batch.tree)
        log_prob, mask = out["log_probs"], out["response_mask"]
        width = log_prob.shape[1]
        old_log_prob = _pad_rows([s.old_log_probs for s in samples], width).to(log_prob.device)
        advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32, device=log_prob.device)
        keep, agg = self._mask_and_denominators(batch, log_prob, old_log_prob, mask)
        is_weights, is_metrics = self._rollout_is_weights(samples, old_log_prob, mask)
        loss, metrics = compute_policy_loss(
            old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=mask,
            clip_ratio_low=algo.clip_ratio_low, clip_ratio_high=algo.clip_ratio_high,
            clip_ratio_c=algo.clip_ratio_c, keep_mask=keep, token_weights=is_weights, **agg)
        metrics.update(is_metrics)
        if algo.kl_coef > 0:
            ref = _pad_rows([s.ref_log_probs for s in samples], width).to(log_prob.device)
            kl_loss, kl_metrics = compute_kl_loss(log_prob, ref, mask, kind=algo.kl_type, **agg)
            loss = loss + algo.kl_coef * kl_loss
            metrics.update(kl_metrics)
        entropy = aggregate_loss(out["entropy"], mask, **agg)
        if algo.entropy_coef > 0:
            loss = loss - algo.entropy_coef * entropy
        metrics["entropy"] = float(entropy.detach())
        return loss, metrics, float(mask.sum()), int(out["tokens_computed"])

    def _mask_and_denominators(self, batch: MicroBatch, log_prob: torch.Tensor, old_log_prob: torch.Tensor,
                               mask: torch.Tensor) -> tuple[torch.Tensor | None, dict[str, Any]]:
        """(keep-mask ``[B, T]`` or None, the loss aggregation's arguments). ``paper``: π_θ below the threshold in
        ``mask_modes``, the mini-batch's global counts. ``authors`` (docs/reproducing.md, differences 2-4): whole
        responses by π_old in every mode; a token mean per micro-batch over its kept tokens / (micro-batches × world
        size), verl 0.5.0's gradient accumulation."""
        algo = self.algorithm
        if algo.semantics == "paper":
            keep = (low_prob_token_mask(log_prob.detach(), mask, algo.lowprob_log_threshold, algo.mask_level)
                    if batch.mode in algo.mask_modes else None)
            return keep, dict(loss_agg_mode=algo.loss_agg_mode, batch_num_tokens=batch.batch_num_tokens,
                              global_batch_size=batch.global_batch_size)
        keep = authors_low_prob_mask(old_log_prob, mask, algo.lowprob_log_threshold) if algo.mask_modes else None
        kept = mask.bool() if keep is None else keep  # masked tokens leave the denominator
        scale = batch.num_micro * (self.trainer.world_size if self._trainer is not None else 1)
        return keep, dict(loss_agg_mode=algo.loss_agg_mode, batch_num_tokens=kept.sum().clamp(min=1) * scale,
                          global_batch_size=kept.any(dim=-1).sum().clamp(min=1) * scale)

    def _rollout_is_weights(self, samples: list[StepSample], old_log_prob: torch.Tensor,
                            mask: torch.Tensor) -> tuple[torch.Tensor | None, dict[str, tuple[float, float]]]:
        """(rollout importance weights ``[B, T]``, None when ``algorithm.rollout_is`` is ``none``; the mismatch metrics
        as ``{name: (value, weight)}``). Only samples whose π_old is taken under the rollout prompt are compared (an
        off-policy step scored ``without_tips`` differs by its tips, not by the sampler): the others get weight 1 and no
        metric."""
        algo = self.algorithm
        same = torch.tensor([s.old_prompt_ids == s.rollout_prompt_ids for s in samples], device=mask.device)
        compared = mask.bool() & same[:, None]
        rollout = _pad_rows([torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in samples],
                            mask.shape[1]).to(mask.device)
        level = "token" if algo.rollout_is == "none" else algo.rollout_is
        weights, metrics = rollout_is_weights(old_log_prob, rollout, compared, level, algo.rollout_is_cap)
        n = float(compared.sum())
        return (None if algo.rollout_is == "none" else weights), {k: (v, n) for k, v in metrics.items()}

    def _optimizer_step(self, batch: MicroBatch) -> None:
        """Clip and apply the mini-batch's gradients; skip the step (gradients None: AdamW leaves weights and state
        alone) when the mini-batch has no sample or no signal on any rank (``_has_signal``), or when their norm is NaN
        or inf (warned about). A skipped step still counts in ``global_step`` and is logged. Raises RuntimeError
        after ``algorithm.max_nonfinite_steps`` consecutive steps with a non-finite gradient norm."""
        opt = self.optimizers()
        has_data = batch.has_data and self._has_signal()
        if not has_data:
            # nothing to learn on any rank: AdamW would still move every weight (momentum and weight decay)
            opt.zero_grad(set_to_none=True)
        # the norm before clipping; plain and FSDP2 (DTensor) grads
        params = [p for p in self.policy.parameters() if p.grad is not None]
        clip = self.hparams.gradient_clip_val
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip else float("inf"))
        # the norm is global (all-reduced by DDP/FSDP), so every rank takes the same decision
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        finite = math.isfinite(grad_norm)
        if not finite:
            # one NaN entry makes every weight NaN after the step (clipping multiplies all gradients by max_norm / nan)
            opt.zero_grad(set_to_none=True)
            self._nonfinite_streak += 1
        elif has_data:  # a step without data says nothing about whether the gradients recovered
            self._nonfinite_streak = 0
        step = self.global_step
        opt.step()
        opt.zero_grad(set_to_none=True)
        self._log_update(batch, grad_norm, skipped=not finite or not has_data)
        if finite:
            return
        limit = self.algorithm.max_nonfinite_steps
        if self._nonfinite_streak >= limit:
            raise RuntimeError(
                f"The gradient norm was not finite ({grad_norm}) in {self._nonfinite_streak} consecutive optimizer "
                f"steps (iteration {batch.iteration}, global steps {step - self._nonfinite_streak + 1}..{step}), "
                f"the limit algorithm.max_nonfinite_steps={limit}. These steps were skipped, so the weights are "
                "still finite, but the run no longer trains. Usual causes: a learning rate too high for the "
                "precision, fp16/bf16 overflow, NaN rewards or advantages. Resume from the last checkpoint with a "
                "lower model.optimizer.lr, or raise algorithm.max_nonfinite_steps.")
        if self._trainer is None or self.trainer.is_global_zero:
            log.warning("Skipped optimizer step at global step %d (iteration %d): the gradient norm is not finite "
                        "(%s); weights and optimizer state are unchanged (%d consecutive, the run stops at "
                        "algorithm.max_nonfinite_steps=%d)", step, batch.iteration, grad_norm,
                        self._nonfinite_streak, limit)

    def _has_signal(self) -> bool:
        """Whether the mini-batch's loss has a gradient: a response token with a non-zero advantage on some rank (a
        collective), or a KL or entropy term. The same on every rank; resets this rank's count."""
        tokens, self._signal_tokens = self._signal_tokens, 0
        if self.algorithm.kl_coef > 0 or self.algorithm.entropy_coef > 0:
            return True
        return all_reduce([float(tokens)])[0] > 0

    def _log_rollout_metrics(self, batch: MicroBatch) -> None:
        """The iteration's rollout and memory metrics at the iteration's step; ``rollout/mode``: the mode's index in
        ``UPDATE_MODES``."""
        modes = {f"rollout/mode_{m}": float(m == batch.mode) for m in UPDATE_MODES}
        metrics = {**batch.metrics, **modes, "rollout/mode": float(UPDATE_MODES.index(batch.mode)),
                   "iteration": float(batch.iteration), "system/rollout_peak_rss_gib": peak_rss_gib(),
                   "rollout/global_step_at_rollout": float(batch.rollout_global_step)}
        self._log_metrics(metrics, step=batch.iteration)
        self.log_dict({k: metrics[k] for k in PROGRESS_BAR_KEYS if k in metrics}, logger=False, prog_bar=True,
                      on_step=True, on_epoch=False, batch_size=1)

    def _log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Straight to the loggers: ``self.log`` would re-log the last value at every micro-batch."""
        for logger in self.loggers:
            logger.log_metrics(metrics, step=step)

    def _log_update(self, batch: MicroBatch, grad_norm: float, skipped: bool) -> None:
        """The mini-batch's update metrics over all ranks (a collective under DDP/FSDP, ``MiniBatchMetrics``);
        throughput is all ranks' tokens over the slowest rank's time."""
        out = self._step_stats.pop(combine=combine_over_ranks)
        timing = combine_over_ranks({"tokens": float(self._train_tokens), "update_s": self._train_time,
                                     "computed": float(self._tokens_computed)},
                                    how=lambda k: "max" if k == "update_s" else "sum")
        tokens, update_s = timing["tokens"], timing["update_s"]
        out["train/grad_norm"], out["system/peak_rss_gib"] = grad_norm, peak_rss_gib()  # the update is the peak
        out["train/update_skipped"] = float(skipped)
        out["train/nonfinite_grad_steps"] = float(self._nonfinite_streak)
        out["train/lr"] = float(self.optimizers().param_groups[0]["lr"])
        if not skipped:  # a skipped step trained no token in ~no time: no throughput to speak of
            out["train/tokens_per_s"] = tokens / max(update_s, 1e-9)
        out["train/update_s"] = update_s
        out["train/tokens_computed"] = timing["computed"]  # beside the nominal tokens: what sharing saved
        out["train/iteration"] = float(batch.iteration)  # per-update metrics keep the global step; this maps it
        self._train_tokens, self._train_time, self._tokens_computed = 0, 0.0, 0
        self._log_metrics(out, step=self.global_step)
        self.log_dict({k: out[k] for k in PROGRESS_BAR_KEYS if k in out}, logger=False, prog_bar=True, on_step=True,
                      on_epoch=False, batch_size=1)
        # for the iteration's log line (src/callbacks/iteration_log.py)
        self.log("train/update_skipped", out["train/update_skipped"], logger=False, on_step=True, on_epoch=False,
                 batch_size=1)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse to write a checkpoint from non-finite weights (all ranks together); with LoRA keep only the adapters
        and record the base; keep the non-finite-gradient streak and the last validation's metrics. Raises
        RuntimeError (nothing written) when a policy parameter holds NaN or inf."""
        bad = check_finite(self.policy)
        total = int(all_reduce([float(len(bad))])[0])
        if total:
            raise RuntimeError(
                f"Refusing to save a checkpoint after iteration {self._iteration} (global step {self.global_step}): "
                f"{total} policy parameter tensor(s) hold NaN or inf values (on this rank: {', '.join(bad[:5])}"
                f"{', ...' if len(bad) > 5 else ''}). The earlier checkpoints are kept; resume from the last one "
                "(ckpt_path=<run dir>/checkpoints/last.ckpt), e.g. with a lower model.optimizer.lr.")
        checkpoint["nonfinite_grad_streak"] = self._nonfinite_streak
        if self.run_config is not None:
            checkpoint[RUN_CONFIG_KEY] = self.run_config
        checkpoint["iteration"] = self._iteration  # last iteration trained (Lightning's `epoch` depends on the hook)
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith("val/")}
        if metrics:
            self._validation = {"iteration": self._val_iteration, "metrics": metrics}
        checkpoint[VALIDATION_KEY] = self._validation
        strategy = type(self.trainer.strategy).__name__
        if lora_enabled(self.hparams.policy) and strategy not in ("ModelParallelStrategy", "FSDPStrategy"):
            stored = keep_trainable(checkpoint, self.policy)
            if self._base is None:  # the base is frozen: hashed once
                self._base = base_record(self.policy, dict(self.hparams.policy), stored)
            checkpoint[BASE_KEY] = self._base

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore the streak and the validation record; raises ValueError for adapters trained on another base."""
        self._nonfinite_streak = int(checkpoint.get("nonfinite_grad_streak", 0))
        self._validation = checkpoint.get(VALIDATION_KEY)
        if BASE_KEY in checkpoint:
            check_adapter_checkpoint(self.policy, checkpoint, self.hparams.policy["name_or_path"])
            self._base = checkpoint[BASE_KEY]
            self.strict_loading = False  # the frozen base weights are not in the checkpoint

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self._val_iteration = self.current_epoch

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Log the held-out metrics (already over all ranks' episodes) at the number of iterations trained
        (``batch["iteration"]``; ``warm_start/score`` is step 0), keep them as callback metrics for checkpoints, and
        write every held-out episode to the run's ``validation_episodes.csv``."""
        metrics = {f"val/{k}": v for k, v in batch["metrics"].items()}
        self.log_dict(metrics, on_step=False, on_epoch=True, batch_size=1, logger=False)
        if not self.trainer.sanity_checking:
            self._log_metrics(metrics, step=batch["iteration"])
            log_validation_episodes(self.trainer, batch["episode_rows"])

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        return self.optimizer_factory(params=params)
