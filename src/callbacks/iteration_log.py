"""One log line per training iteration (console and ``train.log``), so a run can be followed without the tracker
and an update that does nothing shows at once."""
from __future__ import annotations

import logging
import time

import lightning as L

from src.utils.console import CONSOLE

log = logging.getLogger(__name__)

MEMORY_KEYS = ("rollout/tip_write_s",)  # logged by the memory callback (MemoryCallback.on_train_batch_start)


class IterationLog(L.Callback):
    """Logs, at each iteration's end (rank 0): mode, rollout score / return / success, tips written and retrieved,
    optimizer steps and their gradient norms, the rollout's time (episodes, tips, old log-probs) and the update's
    (s)."""

    def __init__(self) -> None:
        self._rollout: dict[str, float] = {}
        self._mode, self._iteration, self._grad_norms, self._start, self._update_s = "?", 0, [], 0.0, 0.0
        self._skipped = 0  # optimizer steps of the iteration that were skipped

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if getattr(batch, "metrics", None):  # the iteration's first micro-batch carries its rollout metrics
            self._rollout, self._mode, self._iteration = batch.metrics, batch.mode, batch.iteration
            self._start = time.perf_counter()  # the update starts: the rollout has run when its first batch exists

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        metrics = trainer.callback_metrics
        if getattr(batch, "last_micro", False) and "train/grad_norm" in metrics:
            if float(metrics.get("train/update_skipped", 0.0)):
                self._skipped += 1
            else:
                self._grad_norms.append(float(metrics["train/grad_norm"]))
            self._update_s = time.perf_counter() - self._start  # to the last optimizer step (not validation or saving)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or not self._rollout:
            return
        r = {**self._rollout, **{k: float(v) for k, v in trainer.callback_metrics.items() if k in MEMORY_KEYS}}
        memory = ""
        if "rollout/tips_written" in r:
            memory = f"; {r['rollout/tips_written']:g} tips written"
            if "rollout/memory/hit_rate" in r:
                memory += (f", {r.get('rollout/memory/tips_per_query', 0.0):.1f} tips per prompt (hit rate "
                           f"{r['rollout/memory/hit_rate']:.2f})")
        norms = self._grad_norms
        if norms:
            span = f"{norms[0]:.3g}" if len(set(norms)) == 1 else f"{min(norms):.3g}..{max(norms):.3g}"
            update = f"{len(norms)} optimizer step(s), grad norm {span}"
        else:
            update = "no optimizer step"
        if self._skipped:  # no sample on any rank (e.g. every advantage 0) or a non-finite gradient
            update += f", {self._skipped} skipped (train/update_skipped: the weights did not move)"
        rollout_s = sum(r.get(f"rollout/{k}", 0.0) for k in ("rollout_s", "tip_write_s", "old_log_prob_s"))
        log.info("iteration %d (%s): score %.3g, return %.3g, success %.2f%s; %s; rollout %.1f s, update %.1f s",
                 self._iteration, self._mode, r.get("rollout/score", float("nan")),
                 r.get("rollout/return", float("nan")), r.get("rollout/success_rate", float("nan")), memory, update,
                 rollout_s, self._update_s, extra=CONSOLE)
        self._grad_norms, self._rollout, self._update_s, self._skipped = [], {}, 0.0, 0
