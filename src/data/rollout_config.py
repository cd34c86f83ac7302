"""How episodes are run: the settings the rollout runner (``src/data/rollout.py``) and the step prompt
(``src/data/step_prompt.py``) both read, kept apart so that neither of them imports the other."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from src.data.prompts import TIPS_HEADER

HISTORY_ACTIONS = ("raw", "executed")


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

    temperature: float = 1.0
    max_response_tokens: int = 32
    history_length: int = 5
    history_obs_chars: int | None = None
    use_tips: bool = False
    strip_tips_for_update: bool = False
    strip_current_tips: bool = True  # False: the authors' stripping, past steps' tips only (strip_tips)
    tips_scope: str = "current"
    do_sample: bool = True
    history_action: str = "raw"
    keep_reflection_prefix: bool = False  # keep each episode's last prompt keys/values for its tip (write_tips)
    sample_seed: int | None = None
    share_prompt_prefix: bool = True
    tips_header: str = TIPS_HEADER

    def __post_init__(self) -> None:
        if self.history_action not in HISTORY_ACTIONS:
            raise ValueError(f"data.history_action={self.history_action!r}: expected one of {HISTORY_ACTIONS}")

    @classmethod
    def from_data(cls, data: Mapping[str, Any], **overrides: Any) -> RolloutConfig:
        """The rollout settings of the ``data`` group (``configs/data/rollout.yaml``: temperature, token and history
        limits, ``tips_header`` with null for ``TIPS_HEADER``), other keys ignored, then ``overrides``: how training,
        validation, evaluation and the warm start all render and sample a step.

        Raises:
            ValueError: an unknown ``history_action``.
        """
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in dict(data).items() if k in known}
        if values.get("tips_header") is None:
            values.pop("tips_header", None)
        return cls(**{**values, **overrides})
