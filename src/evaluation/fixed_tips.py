"""The diagnostic arms of the adaptation protocol (docs/evaluation.md#diagnostic-arms): tips fixed per task instead of
the policy's own, to tell "cannot use tips" from "bad tips". Oracle tips come from privileged information
(``Environment.oracle_tips``); empty tips are placeholder lines of the same token lengths, so the block's presence
alone is measured.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from src.utils.logging import task_text as task_key  # a task dict as one string, as the memory's tables hold it

PLACEHOLDER = " -"  # one token in the tokenizers we use (SmolLM2, Qwen2.5): a line of n of them is n tokens


class FixedTips:
    """The same tip lines at every step of a task's episodes, where the memory stands in a rollout
    (``src.data.rollout.EpisodeMemory``).

    Args:
        tips: per task (``task_key``), the lines shown in the tips block.
        kind: "oracle" or "empty", for the summary.
    """

    diagnostic = True  # never a training memory (src/train.py refuses it)
    reuse_rollout_cache = False
    tips_scope = "current"

    def __init__(self, tips: dict[str, list[str]], kind: str) -> None:
        self.tips, self.kind = tips, kind

    @staticmethod
    def state_text(instruction: str, observation: str) -> str:
        return ""

    @staticmethod
    def embed(texts: list[str]) -> np.ndarray:
        return np.zeros((len(texts), 1), dtype=np.float32)  # nothing is looked up by state

    def retrieve(self, tasks: list[dict], keys: np.ndarray, where=None) -> list[list[str]]:
        """The fixed lines of each task.

        Raises:
            KeyError: a task with no lines (the arm was built for other tasks)."""
        return [list(self.tips[task_key(t)]) for t in tasks]


def oracle_tips(env, tasks: list[dict[str, Any]], env_cfg: dict[str, Any], data_dir: str) -> FixedTips:
    """The environment's oracle tips of ``tasks`` (``Environment.oracle_tips``).

    Raises:
        ValueError: the environment has no oracle tips."""
    try:
        lines = env.oracle_tips(tasks, env_cfg, data_dir)
    except NotImplementedError as err:
        raise ValueError(f"eval.oracle_tips / eval.empty_tips: {err}") from err
    return FixedTips({task_key(t): list(tip) for t, tip in zip(tasks, lines)}, "oracle")


def _num_tokens(tokenizer, line: str) -> int:
    return len(tokenizer(line, add_special_tokens=False)["input_ids"])


def empty_tips(oracle: FixedTips, tokenizer) -> FixedTips:
    """Placeholder lines of the oracle lines' token lengths (counted by ``tokenizer``)."""
    return FixedTips({key: [(PLACEHOLDER * _num_tokens(tokenizer, line)).strip() for line in lines]
                      for key, lines in oracle.tips.items()}, "empty")


def token_lengths(arm: FixedTips, tokenizer) -> float:
    """Mean tokens per task of an arm's tip lines (the empty arm's should equal the oracle's)."""
    counts = [sum(_num_tokens(tokenizer, line) for line in lines) for lines in arm.tips.values()]
    return float(np.mean(counts)) if counts else 0.0
