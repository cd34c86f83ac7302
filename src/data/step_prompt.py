"""The prompt of one agent step: rendered, fitted to the token budget, and tip-stripped for the off-policy update.

Rollouts, validation, evaluation and the imitation warm start all call ``step_prompt``, so a demonstration's prompt
is token for token the prompt RL samples from.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from src.data.prompts import HistoryItem, build_step_messages
from src.data.rollout_config import RolloutConfig
from src.models.policy import Policy

log = logging.getLogger(__name__)

# What ``fit_prompt`` counts (summed over a rollout's prompts, logged as ``rollout/prompt_fit/<key>``).
PROMPT_CUT_KEYS = ("prompts_fitted", "admissible_actions_cut", "history_steps_cut", "tips_cut",
                   "observation_chars_cut")


@dataclass
class StepPrompt:
    """The prompts of one agent step (``step_prompt``): what the policy samples from and what the update trains
    under (the same list unless the tips are stripped), the tips shown and the past steps shown."""

    rollout_ids: list[int]
    update_ids: list[int]
    tips: list[str]
    history_shown: int


def step_prompt(policy: Policy, cfg: RolloutConfig, system_prompt: str, instruction: str,
                history: list[HistoryItem], observation: str, admissible_actions: list[str] | None, step: int,
                max_steps: int | None, tips: list[str] | None = None,
                cuts: dict[str, float] | None = None) -> StepPrompt:
    """The prompt ids of one agent step, fitted to ``policy.max_prompt_tokens`` (what is cut first:
    docs/usage.md#prompts). ``tips`` are shown only when ``cfg.use_tips``; the update prompt is tip-free when
    ``cfg.strip_tips_for_update``, else the same list.
    """
    common = dict(system_prompt=system_prompt, instruction=instruction, history=history, observation=observation,
                  admissible_actions=admissible_actions, history_length=cfg.history_length,
                  history_obs_chars=cfg.history_obs_chars, tips_scope=cfg.tips_scope, step=step,
                  max_steps=max_steps, tips_header=cfg.tips_header)
    step_tips, fitted = fit_prompt(policy, common, tips if cfg.use_tips else None, cuts)
    common.update(fitted)  # both prompts show the same fitted history, actions and observation
    ids = policy.encode(build_step_messages(tips=step_tips, **common))
    update_ids = ids
    if cfg.use_tips and cfg.strip_tips_for_update:
        update_ids = strip_tips(policy, common, None if cfg.strip_current_tips else step_tips)
    shown = min(common["history_length"], len(history)) if common["history_length"] > 0 else 0
    return StepPrompt(ids, update_ids, step_tips or [], shown)


def strip_tips(policy: Policy, common: dict, kept: list[str] | None = None) -> list[int]:
    """Tip stripping for the off-policy update (docs/method.md#tip-stripping-for-the-off-policy-update): the update
    prompt of a step whose rollout prompt showed tips is the same step rendered with ``tips=None``, from the same
    structured pieces (``common``, as fitted for the rollout prompt), never by editing token ids.

    ``kept``: the current step's tips, left in the prompt (``algorithm.semantics=authors``): the authors' code strips
    tip blocks by a token pattern that the current step's block, followed by the instruction, never matches, so only
    past steps' blocks (``tips_scope: all_steps``) leave their prompt (docs/reproducing.md, difference 1)."""
    if kept is None:
        return policy.encode(build_step_messages(tips=None, **common))
    return policy.encode(build_step_messages(tips=kept, **{**common, "tips_scope": "current"}))


def fit_prompt(policy: Policy, common: dict, tips: list[str] | None,
               cuts: dict[str, float] | None = None) -> tuple[list[str] | None, dict[str, int]]:
    """Fit a step prompt to ``policy.max_prompt_tokens`` before it is encoded, keeping what the agent needs most.

    The head (system prompt, task) always stays. Over budget, the prompt is shortened in this order, each only as
    far as needed: the admissible-action list, the oldest history steps, the lowest-ranked tips, then the current
    observation's end (a warning). Only a head longer than the budget is left to ``Policy.encode``'s left cut.

    Returns (the tips that fit, ``fitted``: the changed ``build_step_messages`` arguments); render with
    ``{**common, **fitted}``. ``cuts``, when given, accumulates the ``PROMPT_CUT_KEYS`` counts.
    """
    fitted: dict[str, int] = {}

    def fits(shown_tips: list[str] | None, **changes) -> bool:
        messages = build_step_messages(tips=shown_tips, **{**common, **fitted, **changes})
        return len(policy.encode(messages, truncate=False)) <= policy.max_prompt_tokens

    if fits(tips):
        return tips, fitted
    counts = {"prompts_fitted": 1}
    actions = common.get("admissible_actions") or []
    if actions:
        fitted["admissible_shown"] = _largest_fitting(lambda n: fits(tips, admissible_shown=n), len(actions) - 1)
        counts["admissible_actions_cut"] = len(actions) - fitted["admissible_shown"]
    shown = min(common["history_length"], len(common["history"])) if common["history_length"] > 0 else 0
    history_before = shown
    while shown > 0 and not fits(tips, history_length=shown):
        shown -= 1
    fitted["history_length"] = shown
    counts["history_steps_cut"] = history_before - shown
    tips_before = len(tips or [])
    while tips and not fits(tips):
        tips = tips[:-1]
    counts["tips_cut"] = tips_before - len(tips or [])
    if not fits(tips):
        observation = common["observation"]
        fitted["observation_chars"] = _largest_fitting(lambda c: fits(tips, observation_chars=c),
                                                       len(observation) - 1)
        counts["observation_chars_cut"] = len(observation) - fitted["observation_chars"]
        log.warning("prompt over %d tokens even without admissible actions, history and tips: the current "
                    "observation was cut by %d characters", policy.max_prompt_tokens,
                    counts["observation_chars_cut"])
    if cuts is not None:
        for key, value in counts.items():
            cuts[key] = cuts.get(key, 0.0) + float(value)
    return tips, fitted


def _largest_fitting(fits, high: int) -> int:
    """The largest n in 0..high with ``fits(n)`` (binary search; lengths grow with n); 0 when none fits."""
    low = 0
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low
