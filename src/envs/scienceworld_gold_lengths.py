"""How long the simulator's own gold paths are, against the action caps (docs/environments.md#scienceworld).

For 12 of the 30 tasks the gold path is longer than the default cap of 30 actions, so even a perfect copy of it is
cut off. The gold path is one solution, not always the shortest, but a cap below it is a warning sign
(``warn_gold_paths_over_cap``, when training starts).
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

from src.envs.scienceworld_tasks import default_max_steps, resolve_task, task_list

log = logging.getLogger(__name__)

# (shortest, longest) gold path in actions over the first 5 train variations ("easy" simplification), measured
# with scripts/cache_gold_trajectories.py --split train --num-variations 5 (every path replayed to success; the
# simulator picks among equivalent paths at random, so another generation can differ by a few actions).
GOLD_PATH_LENGTHS: dict[str, tuple[int, int]] = {
    "boil": (29, 47),
    "change-the-state-of-matter-of": (16, 35),
    "chemistry-mix": (15, 20),
    "chemistry-mix-paint-secondary-color": (6, 26),
    "chemistry-mix-paint-tertiary-color": (14, 32),
    "find-animal": (6, 12),
    "find-living-thing": (6, 12),
    "find-non-living-thing": (3, 7),
    "find-plant": (10, 12),
    "freeze": (22, 35),
    "grow-fruit": (55, 75),
    "grow-plant": (29, 35),
    "identify-life-stages-1": (25, 39),
    "identify-life-stages-2": (8, 15),
    "inclined-plane-determine-angle": (54, 96),
    "inclined-plane-friction-named-surfaces": (50, 54),
    "inclined-plane-friction-unnamed-surfaces": (177, 205),
    "lifespan-longest-lived": (1, 7),
    "lifespan-longest-lived-then-shortest-lived": (2, 8),
    "lifespan-shortest-lived": (1, 7),
    "measure-melting-point-known-substance": (18, 30),
    "measure-melting-point-unknown-substance": (31, 93),
    "melt": (18, 50),
    "mendelian-genetics-known-plant": (125, 131),
    "mendelian-genetics-unknown-plant": (126, 133),
    "power-component": (8, 13),
    "power-component-renewable-vs-nonrenewable-energy": (13, 26),
    "test-conductivity": (24, 38),
    "test-conductivity-of-unknown-substances": (24, 38),
    "use-thermometer": (15, 21),
}


def warn_gold_paths_over_cap(env_cfg: Mapping[str, Any] | None) -> list[str]:
    """Log (and return) a message for each task of a ScienceWorld environment config (the ``env`` group) whose
    longest gold path (``GOLD_PATH_LENGTHS``) exceeds its action cap (``env.max_steps``, or the task's default when
    null); nothing for any other environment. A WARNING when the cap is below every measured gold path of the task,
    else INFO (a cap that cuts only the longer variations, as the CPU experiments choose)."""
    env = env_cfg or {}
    if not str(env.get("_target_", "")).endswith("scienceworld.ScienceWorldEnv"):
        return []
    messages = []
    for name in dict.fromkeys(resolve_task(t) for t in task_list(env["task"])):
        shortest, longest = GOLD_PATH_LENGTHS[name]
        cap = env["max_steps"] if env.get("max_steps") is not None else default_max_steps(name)
        if longest > cap:
            span = f"{shortest}" if shortest == longest else f"{shortest}-{longest}"
            messages.append(f"ScienceWorld task {name!r}: the simulator's gold path takes {span} actions (first 5 "
                            f"train variations) but the action cap is {cap}; episodes that need more are cut off. "
                            f"Raise env.max_steps if that is not intended.")
            log.log(logging.WARNING if cap < shortest else logging.INFO, messages[-1])
    return messages
