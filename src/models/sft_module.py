"""Supervised fine-tuning of the policy on demonstrations (the imitation warm start's update): mean token
cross-entropy over the reply tokens only."""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from src.data.samples import SFTExample
from src.models.policy import Policy
from src.models.prefix_tree import group_rows
from src.utils.io import atomic_dir
from src.utils.timing import eta_text
from src.utils.console import CONSOLE

log = logging.getLogger(__name__)


def response_nll(policy: Policy, examples: list[SFTExample], share_prefix: bool = False, tree: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed negative log-likelihood, number of target tokens) of a batch; scalars. ``tree``: one forward over the
    examples' prefix tree (``Policy.log_probs``)."""
    out = policy.log_probs([e.prompt_ids for e in examples], [e.response_ids for e in examples],
                           share_prefix=share_prefix, tree=tree)
    return -out["log_probs"].sum(), out["response_mask"].sum()


def sft_loss(policy: Policy, examples: list[SFTExample]) -> torch.Tensor:
    """Mean token cross-entropy (nats) over the target tokens of a batch (prompt tokens carry no loss)."""
    nll, tokens = response_nll(policy, examples)
    return nll / tokens.clamp(min=1)


@torch.no_grad()
def mean_token_loss(policy: Policy, examples: list[SFTExample], batch_size: int = 8) -> float:
    """Mean token cross-entropy (nats) over all target tokens of ``examples``, in eval mode."""
    if not examples:
        raise ValueError("mean_token_loss: no examples given")
    was_training = policy.training
    policy.eval()
    try:
        nll, tokens = 0.0, 0.0
        for start in range(0, len(examples), batch_size):
            n, k = response_nll(policy, examples[start:start + batch_size])
            nll, tokens = nll + float(n), tokens + float(k)
    finally:
        policy.train(was_training)
    return nll / tokens


def micro_batches(batch: list[SFTExample], max_tokens: int | None, tree: bool = False) -> list[list[SFTExample]]:
    """``batch`` cut into consecutive chunks of at most ``max_tokens`` padded tokens (rows × the longest row), or with
    ``tree`` into prefix trees of at most ``max_tokens`` tokens (``group_rows``), at least one example each; ``None``:
    one chunk. Activation memory grows with a chunk's padded tokens (tree: its tokens)."""
    if max_tokens is None:
        return [batch]
    if tree:
        return [[batch[i] for i in group] for group in group_rows([e.prompt_ids + e.response_ids for e in batch],
                                                                   max_tokens)]
    chunks: list[list[SFTExample]] = []
    current: list[SFTExample] = []
    longest = 0
    for e in batch:
        n = len(e.prompt_ids) + len(e.response_ids)
        if current and (len(current) + 1) * max(longest, n) > max_tokens:
            chunks.append(current)
            current, longest = [], 0
        current.append(e)
        longest = max(longest, n)
    return chunks + [current] if current else chunks


class SFTModule(L.LightningModule):
    """Cross-entropy fine-tuning of a ``Policy`` on ``SFTExample`` batches, AdamW, one optimizer step per batch, its
    gradient accumulated over ``micro_batches``. Logs ``train/loss`` (nats per target token), ``train/target_tokens``,
    ``train/tokens_per_s`` (the previous batch's) and ``train/epoch_time_s`` (also in ``epoch_times``)."""

    def __init__(self, policy: Policy, lr: float = 1e-4, weight_decay: float = 0.0, share_prefix: bool = True,
                 gradient_clip_val: float | None = None, micro_batch_tokens: int | None = 4096, tree: bool = False):
        super().__init__()
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if micro_batch_tokens is not None and micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1 or None, got {micro_batch_tokens}")
        self.automatic_optimization = False  # a batch's gradient is accumulated over micro-batches
        self.policy = policy
        self.gradient_clip_val = gradient_clip_val
        self.micro_batch_tokens = micro_batch_tokens
        self.lr = lr
        self.weight_decay = weight_decay
        self.share_prefix = share_prefix
        # chunks as prefix trees, each shared token computed once (docs/design.md): not the default until the warm
        # start's own bench shows it pays (the update's does only for small trees: docs/performance.md)
        self.tree = tree
        self.epoch_times: list[float] = []
        self._epoch_start = 0.0
        self._last_batch: tuple[float, int] | None = None  # (start time, tokens) of the previous batch

    def training_step(self, batch: list[SFTExample], batch_idx: int) -> torch.Tensor:
        now, tokens_in = time.perf_counter(), sum(len(e.prompt_ids) + len(e.response_ids) for e in batch)
        if self._last_batch is not None:
            self.log("train/tokens_per_s", self._last_batch[1] / (now - self._last_batch[0]), on_step=True,
                     on_epoch=False, prog_bar=True, batch_size=len(batch))
        self._last_batch = (now, tokens_in)
        optimizer = self.optimizers()
        optimizer.zero_grad()
        total = float(sum(len(e.response_ids) for e in batch))
        nll_sum = 0.0
        for chunk in micro_batches(batch, self.micro_batch_tokens, self.tree):
            nll, _ = response_nll(self.policy, chunk, self.share_prefix, self.tree)
            self.manual_backward(nll / max(total, 1.0))  # the batch's mean token loss, summed over its chunks
            nll_sum += float(nll.detach())
        if self.gradient_clip_val:
            self.clip_gradients(optimizer, gradient_clip_val=self.gradient_clip_val, gradient_clip_algorithm="norm")
        optimizer.step()
        loss = torch.tensor(nll_sum / max(total, 1.0))
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True, batch_size=len(batch))
        self.log("train/target_tokens", total, on_step=True, on_epoch=False, batch_size=len(batch))
        return loss

    def on_train_epoch_start(self) -> None:
        self._epoch_start = time.perf_counter()

    def on_train_epoch_end(self) -> None:
        self.epoch_times.append(time.perf_counter() - self._epoch_start)
        self.log("train/epoch_time_s", self.epoch_times[-1])

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)


class ProgressLog(L.Callback):
    """A log line every ``every_s`` seconds of training (batch, loss, tokens/s, elapsed time, an estimate of the rest):
    the log file's copy of the progress bar."""

    def __init__(self, every_s: float = 30.0):
        self.every_s = every_s
        self._start = self._last = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        self._start = self._last = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        total = trainer.num_training_batches * trainer.max_epochs
        done = trainer.current_epoch * trainer.num_training_batches + batch_idx + 1
        if now - self._last < self.every_s and done != total:
            return
        self._last = now
        rate = trainer.callback_metrics.get("train/tokens_per_s")
        rate = f", {float(rate):.0f} tokens/s" if rate is not None else ""
        log.info("warm start: batch %d/%d (epoch %d/%d), loss %.3f%s, %s", done, total, trainer.current_epoch + 1,
                 trainer.max_epochs, float(outputs["loss"]), rate, eta_text(now - self._start, done, total),
                 extra=CONSOLE)


def save_policy(policy: Policy, out_dir: str | os.PathLike, info: dict[str, Any] | None = None) -> Path:
    """Write the policy's model and tokenizer to ``out_dir`` as a Hugging Face directory, atomically (replacing one), a
    PEFT model merged into its base first; ``info`` as ``sft_info.json``."""
    out_dir = Path(out_dir)
    model = policy.model
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
        policy.model = model
    with atomic_dir(out_dir, replace=True) as tmp:
        model.save_pretrained(tmp)
        policy.tokenizer.save_pretrained(tmp)
        if info is not None:
            (tmp / "sft_info.json").write_text(json.dumps(info, indent=1))
    return out_dir
