"""The imitation warm start's settings (``model.warm_start``, ``configs/warm_start/imitation.yaml``): fine-tune the
policy on demonstrations of the training tasks before RL (``src/warm_start.py``, docs/usage.md#imitation-warm-start)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from src.utils.settings import Settings, follows, int_at_least, number


@dataclass
class WarmStartConfig(Settings):
    """Each setting's default and rule. Built on first use, cached under ``cache_dir`` (one entry per base model x
    settings x examples) and reused; ``model.warm_start=null`` starts RL from the base model instead."""

    PREFIX: ClassVar[str] = "model.warm_start"
    # WebShop: the first N training goals; ScienceWorld: the first N training variations per task, may exceed
    # env.num_train_variations; null: all of them
    num_tasks: int | None = None
    epochs: int = 1
    lr: float = 2.0e-4
    batch_size: int = 8  # examples (demonstrated steps) per optimizer step
    weight_decay: float = 0.0
    gradient_clip_val: float | None = 1.0
    # a batch's gradient is accumulated over chunks of at most this many padded tokens (memory; the same gradient):
    # 8 reflection prompts of ~1.5k tokens took 22 GB at once
    micro_batch_tokens: int | None = 4096
    seed: int = 0  # example order and held-out sampling: one warm start for every RL seed
    # a second phase that teaches the policy to write tips (src/data/reflections.py), from the actions-only warm
    # start, rehearsing a share of its examples: {max_tokens, continue_last_prompt, epochs, lr, rehearsal} and
    # optionally show_tips (docs/usage.md#imitation-warm-start); null: off
    reflections: dict[str, Any] | None = None
    eval: bool = True  # held-out score and success by the RL run's validation protocol (data.val)
    gold_dir: str = follows("${paths.data_dir}/scienceworld_gold", "data/scienceworld_gold")  # cached gold paths
    cache_dir: str = follows("${paths.data_dir}/models/warm_start", "data/models/warm_start")

    def problems(self) -> list[str]:
        problems = []
        for key, low in (("num_tasks", 1), ("epochs", 1), ("batch_size", 1), ("micro_batch_tokens", 1), ("seed", 0)):
            problems += int_at_least(f"model.warm_start.{key}", getattr(self, key), low)
        if (number(self.lr) or 0) <= 0:
            problems.append(f"model.warm_start.lr={self.lr!r}: expected a learning rate > 0")
        if number(self.weight_decay) is None or self.weight_decay < 0:
            problems.append(f"model.warm_start.weight_decay={self.weight_decay!r}: expected a number >= 0")
        return problems
