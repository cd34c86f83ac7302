"""Structured chat messages for one agent step, with or without tips (docs/method.md#one-iteration, step 2).

The with-tips and tips-removed prompts of a step come from the same call with ``tips`` given or not, never by
editing token sequences (docs/method.md#tip-stripping-for-the-off-policy-update). Tips sit inside
``<memory>…</memory>`` markers under a fixed header in the current user turn.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# The line above the retrieved tips (data.tips_header overrides it). Ours tells the policy the tips can be wrong;
# AUTHORS_TIPS_HEADER is the EMPO² authors' line (microsoft/agent-lightning v0.x, contrib/agentlightning/contrib/agent/
# empo2_agent.py), which the paper configs use.
TIPS_HEADER = "Tips from your memory of earlier attempts (they may be wrong; use your judgement):"
AUTHORS_TIPS_HEADER = "Here are some memories you collected in your previous exploration:"
TIP_INSTRUCTION = (
    "Thank you for playing. The episode is over. Write a single line (under 100 words) for your future self: "
    "summarise what you tried in this episode, what you learned about the task, and how far you are from "
    "finishing it. Reply with the line only."
)


@dataclass
class HistoryItem:
    """One past step: the observation the agent acted on, its action, and the tips it was shown then."""

    observation: str
    action: str
    tips: list[str] = field(default_factory=list)


def _tips_block(tips: list[str], header: str = TIPS_HEADER) -> str:
    lines = "\n".join(f"- {t}" for t in tips)
    return f"<memory>\n{header}\n{lines}\n</memory>"


def build_step_messages(system_prompt: str, instruction: str, history: list[HistoryItem], observation: str,
                        tips: list[str] | None = None, admissible_actions: list[str] | None = None, *,
                        history_length: int, tips_scope: str, step: int = 0,
                        max_steps: int | None = None, history_obs_chars: int | None = None,
                        admissible_shown: int | None = None, observation_chars: int | None = None,
                        tips_header: str = TIPS_HEADER) -> list[dict[str, str]]:
    """Messages for the policy at one step.

    Only the last ``history_length`` past steps are shown (short CPU prompts; the paper's 4k-token prompts fit the
    whole episode). ``admissible_shown``: show this many admissible actions, evenly spaced so every kind keeps
    examples (``fit_prompt`` sets it). ``tips_scope``: ``current`` or ``all_steps``, also each shown past step's tips
    (the authors' code); ``tips=None`` drops all. Raises ValueError for an unknown ``tips_scope``.
    """
    if tips_scope not in ("current", "all_steps"):
        raise ValueError(f"tips_scope must be 'current' or 'all_steps', got {tips_scope!r}")
    with_tips = tips is not None
    parts = [f"Task:\n{instruction}"]
    shown = history[-history_length:] if history_length > 0 else []
    if shown:
        first = len(history) - len(shown) + 1
        lines = [f"Your last {len(shown)} steps (of {len(history)} so far):"]
        for k, item in enumerate(shown, start=first):
            past = item.observation
            if history_obs_chars is not None and len(past) > history_obs_chars:
                past = past[:history_obs_chars].rstrip() + " ..."
            lines.append(f"[Step {k}] Observation: {past}")
            if with_tips and tips_scope == "all_steps" and item.tips:
                lines.append(_tips_block(item.tips, tips_header))
            lines.append(f"[Step {k}] Action: {item.action}")
        parts.append("\n".join(lines))
    budget = f" (step {step + 1} of {max_steps})" if max_steps else ""
    if observation_chars is not None and len(observation) > observation_chars:
        observation = observation[:observation_chars].rstrip() + " ... [cut to fit the prompt]"
    parts.append(f"Current observation{budget}:\n{observation}")
    if with_tips and tips:
        parts.append(_tips_block(tips, tips_header))
    if admissible_actions:
        parts.append(_admissible_block(admissible_actions, admissible_shown))
    parts.append("What is your next action?")
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": "\n\n".join(parts)}]


def _admissible_block(actions: list[str], shown: int | None) -> str:
    if shown is None or shown >= len(actions):
        return "Admissible actions: " + ", ".join(actions)
    if shown <= 0:
        return f"Admissible actions: {len(actions)} (not listed: the prompt is full)"
    picks = [actions[k * len(actions) // shown] for k in range(shown)]
    return f"Admissible actions ({shown} of {len(actions)} shown): " + ", ".join(picks)


SHORTENED = "[...]"


def _steps_lines(history: list[HistoryItem]) -> list[str]:
    return [f"[Step {k}] Observation: {item.observation}\n[Step {k}] Action: {item.action}"
            for k, item in enumerate(history, start=1)]


def _ending_lines(final_observation: str, final_score: float, max_score: float) -> list[str]:
    return [f"Final observation: {final_observation}", f"Final score: {final_score:g} out of {max_score:g}.",
            TIP_INSTRUCTION]


def build_tip_messages(system_prompt: str, instruction: str, history: list[HistoryItem], final_observation: str,
                       final_score: float, max_score: float) -> list[dict[str, str]]:
    """Messages asking the policy for its one-line reflection on a finished episode (docs/method.md#memory, "Entries").

    Every step of the trajectory is shown (observation and action); ``fit_tip_history`` shortens the oldest
    observations (marked ``[...]``) to fit a token budget, never dropping a step.
    """
    lines = [f"Task: {instruction}", f"Your trajectory ({len(history)} steps):", *_steps_lines(history),
             *_ending_lines(final_observation, final_score, max_score)]
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": "\n".join(lines)}]


def build_reflection_turn(earlier: list[HistoryItem], num_steps: int, final_observation: str, final_score: float,
                          max_score: float) -> str:
    """The user turn asking for the reflection when it continues the episode's last rollout prompt and action
    (docs/method.md#memory): that prompt already shows the task, the last steps and the current observation, so this
    turn adds the ``earlier`` steps it did not show (steps 1..len(earlier) of ``num_steps``), the final observation and
    score, and the tip instruction. Together they show the whole trajectory."""
    lines = ["The episode is over."]
    if earlier:
        lines += [f"Your first {len(earlier)} steps (of {num_steps}), not shown above:", *_steps_lines(earlier)]
    return "\n".join(lines + _ending_lines(final_observation, final_score, max_score))


def fit_tip_history(history: list[HistoryItem], render, tokenizer,
                    budget: int) -> tuple[list[HistoryItem], list[int], int]:
    """(history, its prompt ids from ``render``, observations shortened): the trajectory shortened until the
    reflection prompt has at most ``budget`` ids, where possible. Observations are cut from their end (at token
    boundaries, marked ``[...]``), oldest step first, each down to nothing before the next; actions, task, final
    observation and score stay. Still over budget, the prompt is returned as it is (the caller cuts).
    """
    ids = render(history)
    if len(ids) <= budget or not history:
        return history, ids, 0
    obs_ids = tokenizer([h.observation for h in history], add_special_tokens=False)["input_ids"]
    keep = [len(x) for x in obs_ids]
    shortened = history
    while len(ids) > budget and any(keep):
        excess = len(ids) - budget  # re-measured each round: the [...] markers cost a few tokens
        for k in range(len(keep)):
            take = min(keep[k], excess)
            keep[k], excess = keep[k] - take, excess - take
            if excess == 0:
                break
        shortened = [h if n == len(o) else
                     HistoryItem(f"{tokenizer.decode(o[:n]).rstrip()} {SHORTENED}".lstrip(), h.action, h.tips)
                     for h, o, n in zip(history, obs_ids, keep)]
        ids = render(shortened)
    return shortened, ids, sum(n < len(o) for o, n in zip(obs_ids, keep))
