"""The prompt that asks the policy for its reflection on a finished episode (docs/method.md#memory, "Entries").

The memory's tip writing and the warm start's reflection examples both call ``reflection_prompt_ids``, so the
policy is taught to reflect under token for token the prompt it reflects under at run time.
"""
from __future__ import annotations

from typing import Any

from src.data.prompts import HistoryItem, build_reflection_turn, build_tip_messages, fit_tip_history


def reflection_prompt_ids(policy, system_prompt: str, episode: Any, continue_last: bool) -> tuple[list[int], bool, int]:
    """(prompt ids, whether they continue the last rollout prompt, observations shortened) of the reflection on
    ``episode``'s whole trajectory, at most ``policy.max_prompt_tokens`` ids (``fit_tip_history``, then the policy's
    counted cut). ``continue_last``: continue the last rollout prompt and response with a user turn, as the memory
    does when it kept their keys/values; a fresh prompt when the template cannot be continued by ids or it won't fit.
    """
    history = [HistoryItem(s.observation, s.action) for s in episode.steps]
    budget = policy.max_prompt_tokens
    if continue_last:
        continued = _continue_last_prompt(policy, episode, history, budget)
        if continued is not None:
            return continued[0], True, continued[1]

    def messages(h):
        return build_tip_messages(system_prompt, episode.instruction, h, episode.final_observation,
                                  episode.score, episode.max_score)

    history, ids, shortened = fit_tip_history(history, lambda h: policy.encode(messages(h), truncate=False),
                                              policy.tokenizer, budget)
    if len(ids) > budget:  # even without past observations: the policy's counted cut
        ids = policy.encode(messages(history))
    return ids, False, shortened


def _continue_last_prompt(policy, episode, history: list[HistoryItem], budget: int) -> tuple[list[int], int] | None:
    """``reflection_prompt_ids``' continuation of the last rollout prompt: (ids, shortened), or None when it cannot
    be used."""
    if policy.encode_next_turn("") is None:
        return None
    last = episode.steps[-1]
    response = last.response_ids
    if response and response[-1] in policy.eos_token_ids:
        response = response[:-1]  # the turn's own closing ids follow
    head = last.rollout_prompt_ids + response
    earlier = history[: len(history) - 1 - last.history_shown]

    def render(h):
        return head + policy.encode_next_turn(build_reflection_turn(h, len(history), episode.final_observation,
                                                                    episode.score, episode.max_score))

    earlier, ids, shortened = fit_tip_history(earlier, render, policy.tokenizer, budget)
    return (ids, shortened) if len(ids) <= budget else None
