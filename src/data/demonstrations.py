"""Demonstrations for the imitation warm start, as supervised examples in the RL agent's own format.

The environment supplies demonstration records (``Environment.demonstrations``): the states an agent passes
through and the reply that led on from each. Every step of a record becomes one ``SFTExample``: the prompt the
rollout runner's own ``step_prompt`` renders for that state, the reply's token ids + EOS as the target.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch

from src.data.prompts import HistoryItem
from src.data.rollout_config import RolloutConfig
from src.data.samples import SFTExample
from src.data.step_prompt import step_prompt
from src.models.policy import Policy

log = logging.getLogger(__name__)

def training_tasks(env_cfg: dict[str, Any], num_tasks: int | None) -> tuple[dict[str, Any], Any, list[dict]]:
    """(the env config, the environment it builds, its *training* tasks the warm start uses), as the environment
    says (``Environment.warm_start_config`` / ``warm_start_tasks``). The caller closes the environment."""
    import hydra

    from src.envs.base import environment_class

    env_cfg = environment_class(env_cfg).warm_start_config(env_cfg, num_tasks)
    env = hydra.utils.instantiate(env_cfg)
    return env_cfg, env, env.warm_start_tasks(num_tasks)  # never a held-out task


def demonstration_records(env_cfg: dict[str, Any], num_tasks: int | None, gold_dir: str | os.PathLike
                          ) -> tuple[list[dict], str]:
    """(successful demonstration records of *training* tasks of the environment ``env_cfg`` builds, its system
    prompt): ``Environment.demonstrations`` of ``training_tasks``, cached under ``gold_dir`` where the environment
    caches them. Unsuccessful demonstrations are dropped with a warning. Raises ValueError for an environment
    without demonstrations, or none that succeeds.
    """
    env_cfg, env, tasks = training_tasks(env_cfg, num_tasks)
    try:
        records = env.demonstrations(tasks, env_cfg, str(gold_dir))
        system_prompt = env.system_prompt
    except NotImplementedError as err:
        raise ValueError(f"env._target_={env_cfg.get('_target_')!r}: {err}") from err
    finally:
        env.close()
    good = [r for r in records if r["success"]]
    for r in records:
        if not r["success"]:
            log.warning("skipping the demonstration of %s: score %s without success (within the step cap)",
                        r["task"], r["score"])
    if not good:
        raise ValueError(f"no demonstration of the {len(records)} training tasks succeeds; nothing to imitate")
    return good, system_prompt


def response_ids(policy: Policy, text: str) -> list[int]:
    """Target ids of one reply: its tokens (no special tokens added) + the tokenizer's EOS, which closes an assistant
    turn in the chat template (``<|im_end|>`` for SmolLM2 and Qwen2.5): prompt + target is the template's rendering."""
    tokenizer = policy.tokenizer
    # the reply's text as text, even where it spells a control marker (src/models/chat_encoding.py)
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return list(ids) + [tokenizer.eos_token_id]


def build_examples(policy: Policy, records: list[dict[str, Any]], system_prompt: str, cfg: RolloutConfig,
                   max_steps: int | None = None) -> list[SFTExample]:
    """One example per step of each demonstration record, under the RL run's rollout settings ``cfg``.

    ``records``: ``{"task", "instruction", "initial_observation", "actions", "observations"}``, optionally
    ``responses`` (default: the actions), ``admissible_actions`` and ``tips`` (per step, shown with ``cfg.use_tips``).
    The state at step t is what the rollout runner sees after the first t demonstrated replies.
    """
    examples = []
    for record in records:
        history: list[HistoryItem] = []
        observation = record["initial_observation"]
        responses = record.get("responses") or record["actions"]
        admissible, tips = record.get("admissible_actions"), record.get("tips")
        for t, action in enumerate(record["actions"]):
            prompt = step_prompt(policy, cfg, system_prompt, record["instruction"], history, observation,
                                 admissible[t] if admissible else None, t, max_steps,
                                 tips[t] if tips else None).rollout_ids
            examples.append(SFTExample(prompt, response_ids(policy, responses[t]), record["task"], t))
            # as the runner records it: the reply as written (history_action=raw) or the executed action
            history.append(HistoryItem(observation, responses[t].strip() if cfg.history_action == "raw" else action))
            observation = record["observations"][t]
    return examples


class LengthGroupedBatches(torch.utils.data.Sampler):
    """Batches of indices of similar example length, in random order, freshly drawn every epoch.

    Each epoch shuffles the examples, cuts them into windows of ``window`` batches, sorts each window by length
    (prompt + response tokens) and splits it into batches; the batches are then shuffled. Left-padded prompts are
    most of the compute, so this cuts the padding without changing what is learned.
    """

    def __init__(self, lengths: list[int], batch_size: int, seed: int = 0, window: int = 16):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.lengths, self.batch_size, self.window = list(lengths), batch_size, window
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return -(-len(self.lengths) // self.batch_size) if self.lengths else 0

    def __iter__(self):
        perm = torch.randperm(len(self.lengths), generator=self.generator).tolist()
        size, batches = self.batch_size * self.window, []
        for start in range(0, len(perm), size):
            chunk = sorted(perm[start:start + size], key=self.lengths.__getitem__)
            batches += [chunk[i:i + self.batch_size] for i in range(0, len(chunk), self.batch_size)]
        for k in torch.randperm(len(batches), generator=self.generator).tolist():
            yield batches[k]


def make_dataloader(examples: list[SFTExample], batch_size: int, seed: int = 0) -> torch.utils.data.DataLoader:
    """Batches (lists of ``SFTExample``) of similar lengths in random order (``LengthGroupedBatches``),
    reproducible for a given ``seed``."""
    lengths = [len(e.prompt_ids) + len(e.response_ids) for e in examples]
    return torch.utils.data.DataLoader(examples, batch_sampler=LengthGroupedBatches(lengths, batch_size, seed),
                                       collate_fn=list, num_workers=0)
