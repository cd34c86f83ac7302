"""A deterministic stub environment for tests of what the real environments cannot be made to do on demand
(a constant reward for every episode, a NaN reward, a reward the policy's words decide). Built inside pool workers
by ``_target_: stub_envs.StubEnv`` (``tests/`` is on ``sys.path`` under pytest, and spawned workers inherit it; a
CLI run needs ``PYTHONPATH=tests``: ``STUB_ENV_VARS``)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from src.envs.base import Environment

STUB_CFG = {"_target_": "stub_envs.StubEnv"}
# the states an action leads to with reward_per_char > 0 (MiniLM cosine ~0.4 between rooms, > 0.99 within one)
ROOMS = ("You are in a dark cellar full of barrels.", "A sunny garden with roses and a fountain.",
         "The kitchen smells of fresh bread and coffee.")
# the environment of a CLI run (src/train.py, src/eval.py) that builds the stub environment in its workers
STUB_ENV_VARS = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent),
                                                os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


class StubEnv(Environment):
    """Every step is valid and gives ``reward`` (NaN at step ``nan_step`` of variation ``nan_variation``); the
    observation names the variation and the step; episodes are cut after ``max_steps`` steps.

    ``reward_per_char`` > 0 makes the policy's words matter, so a tiny random policy has something to learn: each
    step also pays ``reward_per_char`` per character of the action, leads to one of three rooms (by the action's
    length mod 3: states that recur across episodes and iterations, whose novelty bonus falls as they are
    revisited) and the score is the return so far."""

    system_prompt = "You are a test agent. Reply with one short action."

    def __init__(self, reward: float = 0.0, max_steps: int = 2, num_tasks: int = 2, nan_variation: int | None = None,
                 nan_step: int = 2, reward_per_char: float = 0.0, raise_variation: int | None = None,
                 raise_in: str = "step", raise_type: str = "ValueError", **_: Any) -> None:
        self.reward, self.max_steps, self.num_tasks = float(reward), int(max_steps), int(num_tasks)
        # variation raise_variation raises raise_type (a builtin exception's name) in raise_in (reset or step)
        self.raise_variation, self.raise_in, self.raise_type = raise_variation, raise_in, raise_type
        self.nan_variation, self.nan_step = nan_variation, int(nan_step)
        self.reward_per_char = float(reward_per_char)
        self.variation, self.steps, self.total = 0, 0, 0.0

    def tasks(self, split: str) -> list[dict[str, Any]]:
        return [{"task_name": "stub", "variation": v} for v in range(self.num_tasks)]

    def _maybe_raise(self, where: str) -> None:
        if self.variation == self.raise_variation and where == self.raise_in:
            import builtins

            raise getattr(builtins, self.raise_type)(f"injected in {where} of variation {self.variation}")

    def reset(self, task: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        self.variation, self.steps, self.total = int(task["variation"]), 0, 0.0
        self._maybe_raise("reset")
        return f"Variation {self.variation}, step 0.", self._info("")

    def step(self, response: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self._maybe_raise("step")
        self.steps += 1
        action = response.strip()
        nan = self.variation == self.nan_variation and self.steps == self.nan_step
        reward = float("nan") if nan else self.reward + self.reward_per_char * len(action)
        self.total += reward
        obs = f"Variation {self.variation}, step {self.steps}."
        if self.reward_per_char:
            obs += " " + ROOMS[len(action) % len(ROOMS)]
        return obs, reward, False, self.steps >= self.max_steps, self._info(action)

    def _info(self, action: str) -> dict[str, Any]:
        return {"score": self.total if self.reward_per_char else 0.0, "max_score": 1.0, "success": False,
                "won": False, "valid_action": True, "action": action, "task_id": "stub", "variation": self.variation,
                "instruction": "Do nothing in particular.", "steps": self.steps}

    def close(self) -> None:
        pass


class HangingStubEnv(StubEnv):
    """A StubEnv whose ``step`` of variation ``hang_variation`` sleeps ``hang_s`` seconds (a hung simulator)."""

    def __init__(self, hang_variation: int = 0, hang_s: float = 60.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hang_variation, self.hang_s = int(hang_variation), float(hang_s)

    def step(self, response: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.variation == self.hang_variation:
            import time

            time.sleep(self.hang_s)
        return super().step(response)
