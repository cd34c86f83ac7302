"""The ``data`` group's settings (``DataConfig``, the one place their defaults and rules are written) and how
episodes are run (``RolloutConfig``: what the rollout runner ``src/data/rollout.py`` and the step prompt
``src/data/step_prompt.py`` both read, kept apart so that neither of them imports the other)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Mapping

from src.data.prompts import TIPS_HEADER
from src.memory.settings import MemoryConfig
from src.utils.settings import Settings, follows, int_at_least, is_int, number

HISTORY_ACTIONS = ("raw", "executed")


@dataclass
class ValConfig(Settings):
    """In-training validation (``data.val``; null: none): no memory, the evaluation temperature."""

    PREFIX: ClassVar[str] = "data.val"
    split: str = "test"
    num_tasks: int = 2
    episodes_per_task: int = 1
    temperature: float = 0.4

    def problems(self) -> list[str]:
        problems = []
        if (number(self.temperature) or 0) <= 0:
            problems.append(f"data.val.temperature={self.temperature!r}: validation samples its actions; expected a "
                            "number > 0 (0.4 in the paper)")
        for key in ("num_tasks", "episodes_per_task"):
            problems += int_at_least(f"data.val.{key}", getattr(self, key), 1, " (or data.val=null: no validation)")
        return problems


@dataclass
class DataConfig(Settings):
    """The ``data`` group: how many episodes an iteration plays and how its samples are cut (``RolloutDataModule``
    documents each setting), and how a step's prompt is rendered and sampled (the fields ``RolloutConfig`` reads).

    Raises (on construction):
        ValueError: one line per bad value, naming the key, the value and what is expected.
    """

    PREFIX: ClassVar[str] = "data"
    tasks_per_iteration: int = 2  # all ranks together (16 in the paper)
    group_size: int = 4  # episodes per task instance, N (8 in the paper)
    train_split: str = "train"
    ppo_epochs: int = 1
    num_mini_batches: int | None = None  # a fixed number of optimizer steps per PPO epoch (the CPU experiments)
    mini_batch_rows: int | None = None  # or one step per this many rows over all ranks (the paper configs)
    micro_batch_size: int = 4  # samples (steps) per forward/backward
    micro_batch_tokens: int | None = None  # or: prefix trees of at most this many tokens per forward/backward
    temperature: float = 1.0  # rollout temperature
    max_response_tokens: int = 32  # per action (32 ScienceWorld, 512 WebShop)
    history_length: int = 3  # past steps shown in the prompt
    history_obs_chars: int | None = None  # cut each past observation to its last N characters (None: whole)
    history_action: str = "raw"  # raw (the model's output) | executed (what the environment ran)
    tips_header: str | None = None  # the line above retrieved tips; None: ours, which says they may be wrong
    max_steps: int | None = follows("env.max_steps", None)  # shown to the agent as its budget
    num_env_workers: int | None = None  # default: as many as concurrent episodes
    pool_timeout_s: float = 300.0
    seed: int = follows("seed", 0)
    val: ValConfig | None = field(default_factory=ValConfig)

    def problems(self) -> list[str]:
        from src.data.minibatches import mini_batch_count

        problems = []
        for key in ("tasks_per_iteration", "ppo_epochs", "micro_batch_size", "max_response_tokens"):
            problems += int_at_least(f"data.{key}", getattr(self, key), 1)
        if self.micro_batch_tokens is not None:
            problems += int_at_least("data.micro_batch_tokens", self.micro_batch_tokens, 1)
        try:  # the mini-batch rule, where it is applied
            mini_batch_count(0, self.num_mini_batches, self.mini_batch_rows)
        except ValueError as err:
            problems.append(str(err))
        if not is_int(self.group_size) or self.group_size < 2:
            problems.append(f"data.group_size={self.group_size!r}: GRPO's advantage compares the episodes of one task, "
                            "so a group of fewer than 2 has no learning signal (every advantage is 0); expected an int "
                            ">= 2 (8 in the paper)")
        if self.max_steps is not None and (not is_int(self.max_steps) or self.max_steps < 1):
            problems.append(f"data.max_steps={self.max_steps!r}: the step budget the prompt shows; expected an int "
                            ">= 1 or null")
        problems += int_at_least("data.history_length", self.history_length, 0, " (past steps shown in the prompt)")
        if self.history_action not in HISTORY_ACTIONS:
            problems.append(f"data.history_action={self.history_action!r}: expected one of {HISTORY_ACTIONS}")
        if (number(self.pool_timeout_s) or 0) <= 0:
            problems.append(f"data.pool_timeout_s={self.pool_timeout_s!r}: the seconds an environment worker may take "
                            "for one call before it is restarted; expected a number > 0")
        problems += int_at_least("data.num_env_workers", self.num_env_workers, 1, " or null (as many as needed)")
        problems += int_at_least("data.history_obs_chars", self.history_obs_chars, 1, " or null (whole observations)")
        if (number(self.temperature) or 0) <= 0:
            problems.append(f"data.temperature={self.temperature!r}: the rollout sampling temperature; expected a "
                            "number > 0 (1.0 in the paper)")
        return problems


@dataclass
class RolloutConfig:
    """How episodes are run. ``use_tips``: retrieve tips into the rollout prompts; ``strip_tips_for_update``: also
    render the tip-free update prompt (off-policy mode); ``history_length``: past steps shown in the prompt;
    ``history_action``: what the history shows as each past step's action, ``raw`` (the model's output, as the
    authors record it with action correction: ``record_original_action``) or ``executed`` (the action the
    environment ran, e.g. the corrected one). ``keep_reflection_prefix``: store each finished episode's last prompt
    keys/values on the episode (``Episode.reflection_prefix``) so the reflection that continues that prompt does
    not recompute it. ``sample_seed``: draw each episode's tokens from its own streams (``row_seeds(sample_seed,
    episode id, step)``), so an episode is the same whichever rank runs it and whatever else is in its batch; None
    samples from torch's global generator. ``share_prompt_prefix``: compute the prompt prefix the episodes of a task
    share (system prompt and task text; at the first step the whole prompt) once per rollout
    (``Policy.generate(shared=...)``). ``tips_header``: the line above the retrieved tips."""

    temperature: float = DataConfig.temperature
    max_response_tokens: int = DataConfig.max_response_tokens
    history_length: int = DataConfig.history_length
    history_obs_chars: int | None = DataConfig.history_obs_chars
    use_tips: bool = False
    strip_tips_for_update: bool = False
    strip_current_tips: bool = True  # False: the authors' stripping, past steps' tips only (strip_tips)
    tips_scope: str = MemoryConfig.tips_scope
    do_sample: bool = True
    history_action: str = DataConfig.history_action
    keep_reflection_prefix: bool = False  # keep each episode's last prompt keys/values for its tip (write_tips)
    sample_seed: int | None = None
    share_prompt_prefix: bool = True
    tips_header: str = TIPS_HEADER

    @classmethod
    def from_data(cls, data: Mapping[str, Any] | DataConfig, **overrides: Any) -> RolloutConfig:
        """The rollout settings of the ``data`` group (temperature, token and history limits, ``tips_header`` with
        null for ``TIPS_HEADER``), then ``overrides``: how training, validation, evaluation and the warm start all
        render and sample a step.

        Raises:
            ValueError: a bad ``data`` setting (``DataConfig``).
        """
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in DataConfig.from_dict(data).to_dict().items() if k in known}
        if values.get("tips_header") is None:
            values.pop("tips_header", None)
        return cls(**{**values, **overrides})
