"""Reflection examples for the imitation warm start: the policy is taught to write a tip, not only to act.

A small policy fine-tuned on actions only answers the reflection prompt with an action, so the memory holds nothing
to learn from (``rollout/tip_action_frac``). The warm start therefore also trains on trajectories of the *training*
tasks (``Environment.reflection_records``) under the memory's own reflection prompt, token for token, with a tip
written in hindsight from what the trajectory shows the agent (``Environment.hindsight_tip``), never the hidden goal.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any, Callable

from src.data.prompts import HistoryItem
from src.data.reflection_prompt import reflection_prompt_ids
from src.data.rollout_config import RolloutConfig
from src.data.samples import SFTExample
from src.data.step_prompt import step_prompt

log = logging.getLogger(__name__)

def reflection_records(env_cfg: dict[str, Any], num_tasks: int | None, gold_dir: str
                       ) -> tuple[list[dict], Callable[[dict[str, Any]], list[str]], str]:
    """(trajectories to reflect on, the tip writer for them, the environment's system prompt) on the *training*
    tasks ``demonstration_records`` takes its demonstrations from (``num_tasks`` as there): the environment's
    ``reflection_records`` and ``hindsight_tip``. Raises ValueError for an environment without them.
    """
    from src.data.demonstrations import training_tasks
    from src.envs.base import Environment

    env_cfg, env, tasks = training_tasks(env_cfg, num_tasks)
    try:
        records, write = env.reflection_records(tasks, env_cfg, str(gold_dir)), type(env).hindsight_tip
        if write is Environment.hindsight_tip:  # the base class's, which writes nothing
            raise NotImplementedError(f"{type(env).__name__} writes no hindsight tips (Environment.hindsight_tip; "
                                      "set model.warm_start.reflections=null)")
        system_prompt = env.system_prompt
    except NotImplementedError as err:
        raise ValueError(f"env._target_={env_cfg.get('_target_')!r}: {err}") from err
    finally:
        env.close()
    return records, write, system_prompt


def fit_tip(policy, sentences: list[str], max_tokens: int) -> str:
    """The sentences joined, as many as fit ``max_tokens`` tokens with EOS; the first one cut at a word boundary
    when it alone does not fit."""
    def n_tokens(text: str) -> int:
        return len(policy.tokenizer(text, add_special_tokens=False)["input_ids"]) + 1

    text = ""
    for s in sentences:
        joined = f"{text} {s}".strip()
        if n_tokens(joined) > max_tokens:
            break
        text = joined
    if not text:
        words = sentences[0].split()
        while words and n_tokens(" ".join(words)) > max_tokens:
            words.pop()
        text = " ".join(words)
    return text


def reflection_examples(policy, records: list[dict[str, Any]], system_prompt: str, cfg: RolloutConfig,
                        max_steps: int | None, write_tip: Callable[[dict[str, Any]], list[str]], max_tokens: int,
                        continue_last: bool = True) -> list[SFTExample]:
    """One example per record (``src.envs.base.replay``'s format): the memory's reflection prompt on the record's
    trajectory, rebuilt exactly as the rollout runner records it, → the tip's ids + EOS (at most ``max_tokens``).
    ``continue_last``: as ``memory.reuse_rollout_cache``.
    """
    from src.data.demonstrations import response_ids

    examples = []
    for record in records:
        history: list[HistoryItem] = []
        steps = []
        observation = record["initial_observation"]
        admissible = record.get("admissible_actions")
        responses = record.get("responses") or record["actions"]
        for t, action in enumerate(record["actions"]):
            prompt = step_prompt(policy, cfg, system_prompt, record["instruction"], history, observation,
                                 admissible[t] if admissible else None, t, max_steps)
            ids = record["response_ids"][t] if "response_ids" in record else response_ids(policy, responses[t])
            steps.append(SimpleNamespace(observation=observation, action=action, rollout_prompt_ids=prompt.rollout_ids,
                                         response_ids=ids, history_shown=prompt.history_shown))
            history.append(HistoryItem(observation, responses[t].strip() if cfg.history_action == "raw" else action))
            observation = record["observations"][t]
        if not steps:
            continue
        episode = SimpleNamespace(steps=steps, instruction=record["instruction"], final_observation=observation,
                                  score=float(record["score"]), max_score=float(record.get("max_score", 1.0)))
        ids, _, _ = reflection_prompt_ids(policy, system_prompt, episode, continue_last)
        tip = fit_tip(policy, write_tip(record), max_tokens)
        examples.append(SFTExample(ids, response_ids(policy, tip), record["task"], -1))
    return examples


def tipped_demonstrations(policy, demonstrations: list[dict[str, Any]], records: list[dict[str, Any]],
                          write_tip: Callable[[dict[str, Any]], list[str]], max_tokens: int) -> list[dict]:
    """The demonstrations again, each step's prompt showing the tips a memory would hold after the task's other
    trajectories: a policy never shown tips in its prompt does not know how to act next to them.

    For each demonstration, the records of the same task whose actions differ (the flawed expert's, the gold path
    with needless looks) give one memory entry each per step (``format_entry``: the record's tip, its action at
    that step or its last, its score), as the memory writes them. Returns copies with ``tips`` (one list per step),
    for ``build_examples`` with ``use_tips``; demonstrations without such a record are left out.
    """
    from src.memory.tip_entry import format_entry

    out = []
    for demo in demonstrations:
        others = [r for r in records if r["task"] == demo["task"] and r["actions"] != demo["actions"] and r["actions"]]
        if not others:
            continue
        tips = [fit_tip(policy, write_tip(r), max_tokens) for r in others]
        steps = [[format_entry(tip, r["actions"][min(t, len(r["actions"]) - 1)], r["score"], r.get("max_score", 1.0))
                  for tip, r in zip(tips, others)] for t in range(len(demo["actions"]))]
        out.append({**demo, "tips": steps})
    return out
