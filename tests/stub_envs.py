"""A deterministic stub environment for tests of what the real environments cannot be made to do on demand
(a constant reward for every episode, a NaN reward). Built inside pool workers by ``_target_: stub_envs.StubEnv``
(``tests/`` is on ``sys.path`` under pytest, and spawned workers inherit it)."""
from __future__ import annotations

from typing import Any

STUB_CFG = {"_target_": "stub_envs.StubEnv"}


class StubEnv:
    """Every step is valid and gives ``reward`` (NaN at step ``nan_step`` of variation ``nan_variation``); the
    observation names the variation and the step; episodes are cut after ``max_steps`` steps."""

    system_prompt = "You are a test agent. Reply with one short action."

    def __init__(self, reward: float = 0.0, max_steps: int = 2, num_tasks: int = 2, nan_variation: int | None = None,
                 nan_step: int = 2, **_: Any) -> None:
        self.reward, self.max_steps, self.num_tasks = float(reward), int(max_steps), int(num_tasks)
        self.nan_variation, self.nan_step = nan_variation, int(nan_step)
        self.variation, self.steps = 0, 0

    def tasks(self, split: str) -> list[dict[str, Any]]:
        return [{"task_name": "stub", "variation": v} for v in range(self.num_tasks)]

    def reset(self, task: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        self.variation, self.steps = int(task["variation"]), 0
        return f"Variation {self.variation}, step 0.", self._info("")

    def step(self, response: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.steps += 1
        nan = self.variation == self.nan_variation and self.steps == self.nan_step
        reward = float("nan") if nan else self.reward
        return (f"Variation {self.variation}, step {self.steps}.", reward, False, self.steps >= self.max_steps,
                self._info(response.strip()))

    def _info(self, action: str) -> dict[str, Any]:
        return {"score": 0.0, "max_score": 1.0, "success": False, "won": False, "valid_action": True,
                "action": action, "task_id": "stub", "variation": self.variation,
                "instruction": "Do nothing in particular.", "steps": self.steps}

    def close(self) -> None:
        pass
