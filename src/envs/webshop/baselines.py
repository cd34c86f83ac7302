"""Reference policies for WebShop: a scripted oracle expert and a uniform random clicker.

Both map (observation, info) to a response string ``<action>...</action>`` as a model would produce, so they
exercise the same parsing path as training. Used by scripts/webshop_baselines.py and the tests.
"""
from __future__ import annotations

import random
from typing import Any

from src.envs.webshop.pages import BUTTONS, SEARCH_PLACEHOLDER
from src.envs.webshop.reward import option_matches

MAX_RESULT_PAGES = 5  # 50 hits / 10 per page


def _strip_price(instruction: str) -> str:
    return instruction.split(", and price lower than")[0]


class ExpertPolicy:
    """Oracle expert: searches the instruction words, pages through the hits to the goal's product (falling
    back to a search on its title), clicks the goal's options and buys. Reads the goal from ``env.goal``."""

    def __init__(self, env):
        self.env = env
        self.reset()

    def reset(self) -> None:
        self.searches = 0
        self.done_options: set[int] = set()

    def act(self, obs: str, info: dict[str, Any]) -> str:
        goal, te = self.env.goal, self.env.text_env
        admissible = info["admissible_actions"]
        target = goal["asin"].lower()
        page = info["page"]
        if page == "search":
            return self._search(goal)
        if page == "results":
            if f"click[{target}]" in admissible:
                return f"<action>click[{target}]</action>"
            if te.page_num < MAX_RESULT_PAGES and te.page_items():
                return "<action>click[next >]</action>"
            if self.searches < 2:
                return self._search(goal)
            first = next((a for a in admissible if a[6:-1] not in BUTTONS), "click[back to search]")
            return f"<action>{first}</action>"
        if page == "item":
            values = [a[6:-1] for a in admissible if a.startswith("click[") and a[6:-1] not in BUTTONS]
            wanted = goal["goal_options"]
            wanted = list(wanted.values()) if isinstance(wanted, dict) else list(wanted)
            for i, g in enumerate(wanted):
                if i in self.done_options:
                    continue
                self.done_options.add(i)
                exact = [v for v in values if v == g.lower()]
                fuzzy = [v for v in values if option_matches(v, g)]
                if exact or fuzzy:
                    return f"<action>click[{(exact or fuzzy)[0]}]</action>"
            return "<action>click[buy now]</action>"
        return "<action>click[< prev]</action>"  # a sub-page

    def _search(self, goal: dict) -> str:
        self.searches += 1
        query = _strip_price(goal["instruction_text"]) if self.searches == 1 else goal["name"]
        return f"<think>search for the product</think><action>search[{query}]</action>"


MISTAKES = ("wrong_option", "missing_option", "weak_query", "wrong_product")


class FlawedExpertPolicy(ExpertPolicy):
    """The oracle expert making one deliberate mistake, for trajectories that go wrong (the warm start's reflection
    examples, ``src/data/reflections.py``).

    ``mistake``: ``wrong_option`` — clicks another value instead of the goal's first option (where the item has one);
    ``missing_option`` — never clicks the goal's first option; ``weak_query`` — searches only the instruction's first
    two words and opens the first hit; ``wrong_product`` — opens the first hit that is not the goal's product.

    Raises:
        ValueError: an unknown ``mistake``.
    """

    def __init__(self, env, mistake: str):
        if mistake not in MISTAKES:
            raise ValueError(f"mistake={mistake!r}: expected one of {MISTAKES}")
        self.mistake = mistake
        super().__init__(env)

    def act(self, obs: str, info: dict[str, Any]) -> str:
        admissible, page = info["admissible_actions"], info["page"]
        clickable = [a for a in admissible if a.startswith("click[") and a[6:-1] not in BUTTONS]
        if page == "search" and self.mistake == "weak_query":
            self.searches += 1
            words = _strip_price(self.env.goal["instruction_text"]).split()
            lead = {"i", "i'm", "im", "need", "want", "looking", "for", "a", "an", "some", "am", "would", "like"}
            query = " ".join([w for w in words if w.lower() not in lead][:2])
            return f"<action>search[{query}]</action>"
        if page == "results" and self.mistake in ("weak_query", "wrong_product") and clickable:
            target = f"click[{self.env.goal['asin'].lower()}]"
            others = [a for a in clickable if a != target] if self.mistake == "wrong_product" else clickable
            return f"<action>{(others or clickable)[0]}</action>"
        if page == "item" and self.mistake in ("wrong_option", "missing_option") and 0 not in self.done_options:
            self.done_options.add(0)
            wanted = self.env.goal["goal_options"]
            wanted = list(wanted.values()) if isinstance(wanted, dict) else list(wanted)
            groups = self.env.text_env.option_clickables()  # value -> option name
            match = [v for v in groups if wanted and option_matches(v, wanted[0])]
            # another value of the same option (another size, not a colour instead of a size)
            others = [v for v in groups if match and groups[v] == groups[match[0]] and v not in match]
            if self.mistake == "wrong_option" and others:
                return f"<action>click[{others[0]}]</action>"
        return super().act(obs, info)


class RandomPolicy:
    """Uniform over the admissible actions; the search placeholder searches the instruction text."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def reset(self) -> None:
        pass

    def act(self, obs: str, info: dict[str, Any]) -> str:
        action = self.rng.choice(info["admissible_actions"])
        if action == SEARCH_PLACEHOLDER:
            action = f"search[{_strip_price(info['instruction'])}]"
        return f"<action>{action}</action>"


def run_policy(env, policy, tasks: list[dict]) -> dict[str, float]:
    """Run one episode per task; returns {'mean_score', 'success_rate', 'mean_steps', 'episodes'}."""
    scores, successes, steps = [], [], []
    for task in tasks:
        obs, info = env.reset(task)
        policy.reset()
        done = truncated = False
        while not (done or truncated):
            obs, _, done, truncated, info = env.step(policy.act(obs, info))
        scores.append(info["score"])
        successes.append(float(info["success"]))
        steps.append(info["step"])
    n = max(len(tasks), 1)
    return {"mean_score": sum(scores) / n, "success_rate": sum(successes) / n, "mean_steps": sum(steps) / n,
            "episodes": len(tasks)}
