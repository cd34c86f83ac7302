"""WebShop environments (docs/environments.md#webshop): ``WebShopTextEnv``, the original text-mode state machine on raw
actions, and ``WebShopEnv``, the agent wrapper behind the contract of src/envs/base.py."""
from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any

from src.envs.base import Environment, count_problem, extract_action
from src.envs.webshop import pages
from src.envs.webshop.pages import SEARCH_PLACEHOLDER
from src.envs.webshop.catalog import ensure_generated_catalog
from src.envs.webshop.data import (WebShopData, WebShopDataError, find_data_files, load_webshop_data,
                                   split_goal_indices)
from src.envs.webshop.demos import webshop_tip
from src.envs.webshop.reward import NOUN_TAGGERS, check_noun_tagger, get_reward
from src.envs.webshop.search import SearchEngine

ACTION_RE = re.compile(r'(.+)\[(.+)\]')  # the original's parse_action
TASK_NAME = "webshop"
TOP_K = 50  # the original shows the top-50 hits
SUB_PAGES = ("description", "features", "reviews")


def parse_raw_action(action: str) -> tuple[str, str | None]:
    """The original ``parse_action``: (name, lower-cased argument) or (action, None) when it does not match."""
    m = ACTION_RE.match(action)
    if m is None:
        return action, None
    name, arg = m.groups()
    return name, arg.lower()


class WebShopTextEnv:
    """One shopping session on a loaded catalog, stepping raw actions like the original text env: pages search ->
    results -> item -> description/features/reviews -> done, the reward on Buy Now only. ``step(action)`` returns
    (observation, reward in [0, 1], done, valid), valid False for a no-op (not clickable, bad syntax)."""

    def __init__(self, data: WebShopData, engine: SearchEngine, noun_tagger: str = "fallback"):
        self.data = data
        self.engine = engine
        self.noun_tagger = check_noun_tagger(noun_tagger)
        self.goal: dict | None = None
        self._results_cache: dict[str, list[str]] = {}

    def reset(self, goal_idx: int) -> str:
        self.goal = self.data.goals[goal_idx]
        self._reset_session()
        self.done = False
        self.reward = 0.0
        self.reward_info: dict | None = None
        return self.observation

    def _reset_session(self) -> None:
        self.page = "search"
        self.keywords: str | None = None
        self.page_num = 1
        self.asin: str | None = None
        self.options: dict[str, str] = {}

    @property
    def instruction(self) -> str:
        return self.goal["instruction_text"]

    @property
    def product(self) -> dict | None:
        return self.data.product_by_asin[self.asin] if self.asin is not None else None

    def results(self) -> list[str]:
        """Top-50 asins for the current keywords (cached per query)."""
        if self.keywords not in self._results_cache:
            self._results_cache[self.keywords] = self.engine.search(self.keywords, TOP_K)
        return self._results_cache[self.keywords]

    def page_items(self) -> list[dict]:
        start = (self.page_num - 1) * pages.RESULTS_PER_PAGE
        asins = self.results()[start:start + pages.RESULTS_PER_PAGE]
        return [self.data.product_by_asin[a] for a in asins]

    @property
    def observation(self) -> str:
        ins = self.instruction
        if self.page == "search":
            return pages.search_page(ins)
        if self.page == "results":
            return pages.results_page(ins, self.page_num, len(self.results()), self.page_items())
        if self.page == "item":
            return pages.item_page(ins, self.product)
        if self.page in SUB_PAGES:
            return pages.sub_page(ins, self.page, self.product)
        return pages.done_page(self.asin, self.options, self.reward)

    def option_clickables(self) -> dict[str, str]:
        """Option value -> option name on the item page (a value shared by two options maps to the last one,
        as in the original's text_to_clickable dict)."""
        out: dict[str, str] = {}
        for name, values in self.product["options"].items():
            for v in values:
                out[v] = name
        return out

    def available_actions(self) -> dict[str, Any]:
        """The original ``get_available_actions``: {'has_search_bar': bool, 'clickables': [lower-cased texts]}."""
        if self.page == "search":
            return {"has_search_bar": True, "clickables": ["search"]}
        clickables = ["back to search"]
        if self.page == "results":
            if self.page_num > 1:
                clickables.append("< prev")
            clickables.append("next >")
            clickables += [p["asin"].lower() for p in self.page_items()]
        elif self.page == "item":
            clickables += ["< prev", "description", "features", "reviews", "buy now"]
            clickables += [v for v in self.option_clickables() if v not in clickables]
        elif self.page in SUB_PAGES:
            clickables.append("< prev")
        else:  # done
            clickables = []
        return {"has_search_bar": False, "clickables": clickables}

    def admissible_actions(self) -> list[str]:
        """``search[<query>]`` while the search bar shows, plus ``click[x]`` for every clickable but 'search'."""
        avail = self.available_actions()
        acts = [SEARCH_PLACEHOLDER] if avail["has_search_bar"] else []
        return acts + [f"click[{c}]" for c in avail["clickables"] if c != "search"]

    def step(self, action: str) -> tuple[str, float, bool, bool]:
        """Apply one raw action. ``search[kw]`` works on any page (as in the original, although it is only
        advertised on the search page); ``click[x]`` needs x among the current clickables."""
        if self.goal is None:
            raise RuntimeError("WebShopTextEnv.step called before reset")
        if self.done:
            raise RuntimeError("WebShopTextEnv.step called after Buy Now; call reset")
        name, arg = parse_raw_action(action)
        if name == "search" and arg is not None and arg != "":
            self._reset_session()
            self.keywords, self.page = arg, "results"
            return self.observation, 0.0, False, True
        if name == "click" and arg is not None and arg != "search" \
                and arg in self.available_actions()["clickables"]:
            self._click(arg)
            return self.observation, self.reward, self.done, True
        return self.observation, 0.0, False, False

    def _click(self, arg: str) -> None:
        if arg == "back to search":
            self._reset_session()
        elif arg == "next >":
            self.page_num += 1
        elif arg == "< prev":
            if self.page == "results":
                self.page_num -= 1
            elif self.page == "item":
                self.page, self.asin, self.options = "results", None, {}
            else:  # a sub-page: back to the item, options kept
                self.page = "item"
        elif arg == "buy now":
            self.reward, self.reward_info = get_reward(self.product, self.goal, self.data.prices[self.asin],
                                                       self.options, self.noun_tagger)
            self.done, self.page = True, "done"
        elif arg in SUB_PAGES and self.page == "item":
            self.page = arg
        elif self.page == "results":
            self.asin = next(p["asin"] for p in self.page_items() if p["asin"].lower() == arg)
            self.page, self.options = "item", {}
        else:  # an option value on the item page
            self.options[self.option_clickables()[arg]] = arg


@functools.lru_cache(maxsize=4)
def _load(source_dir: str, cache_dir: str, num_products: int | None, human_goals: bool, price_seed: int,
          stemmer: str) -> tuple[WebShopData, SearchEngine]:
    """Load data + search index once per process for a given configuration."""
    data = load_webshop_data(source_dir, num_products=num_products, human_goals=human_goals, price_seed=price_seed)
    return data, SearchEngine(data.products, cache_dir, stemmer=stemmer)


class WebShopEnv(Environment):
    """The WebShop environment for agents (docs/environments.md#webshop).

    Args:
        data_dir: where the generated catalog and the BM25 index are cached.
        real_data_dir: directory of the original files (else ``WEBSHOP_DATA_DIR``); without either, a catalog of
            ``catalog_size`` products is generated from ``catalog_seed``.
        num_products: keep only the first N products of the file (the original's option; None = all).
        human_goals: human instructions (True) or synthetic option-combination goals (False).
        price_seed: seed of the price and price-cap draws (unseeded in the original).
        max_steps: action cap per episode (verl-agent: 15); reaching it truncates.
        format_penalty: subtracted from the reward when the reply has no ``<action>...</action>``, several or an
            unclosed one.
        reward_mode: "score" (train reward = score in [0, 1]) or "success" (10 × (score == 1)).
        num_test_goals, num_dev_goals: split sizes (test = goals[:500], dev next, train = the rest).
        stemmer: the search's analyzer, "porter" (the original's) or "none" (``SearchEngine``).
        noun_tagger: product-name noun tagger of the reward's type factor (``reward.NOUN_TAGGERS``).
        observation_instruction: keep the instruction the original repeats atop every page (True) or drop it
            (False; the prompt shows it once as the task).
        seed: accepted so every environment takes the same config keys; unused.
    Raises ValueError for a bad setting, WebShopDataError for missing/malformed data files.
    """

    display_name = "WebShop"
    score_unit = "score in [0, 1]"
    max_score = 1.0
    novelty_coef = 0.01  # of the [0, 1] score
    bare_command = re.compile(r"(?:search|click)\[[^\]]*\]")  # one action without tags

    def __init__(self, data_dir: str | os.PathLike = "data/webshop", real_data_dir: str | None = None, *,
                 num_products: int | None = None, human_goals: bool = True, catalog_size: int = 1000,
                 catalog_seed: int = 0, price_seed: int = 0, max_steps: int = 15, format_penalty: float = 0.1,
                 reward_mode: str = "score", num_test_goals: int = 500, num_dev_goals: int = 0,
                 stemmer: str = "porter", noun_tagger: str = "fallback", observation_instruction: bool = True,
                 seed: int | None = None):
        self.check_config({"real_data_dir": real_data_dir, "human_goals": human_goals, "catalog_size": catalog_size,
                           "num_products": num_products, "max_steps": max_steps, "reward_mode": reward_mode,
                           "num_test_goals": num_test_goals, "num_dev_goals": num_dev_goals, "stemmer": stemmer,
                           "noun_tagger": noun_tagger})
        real = real_data_dir or os.environ.get("WEBSHOP_DATA_DIR") or None
        data_dir = Path(data_dir).resolve()
        source = Path(real).resolve() if real else ensure_generated_catalog(data_dir, catalog_size, catalog_seed)
        try:
            self.data, self.engine = _load(str(source), str(data_dir), num_products, human_goals, price_seed, stemmer)
        except WebShopDataError as err:  # a file's content (its presence is config_problems'): name the setting
            raise WebShopDataError(f"env.real_data_dir={real!r}: {err}" if real else str(err)) from None
        self.uses_real_data = bool(real)
        self.max_steps = max_steps
        self.format_penalty = float(format_penalty)
        self.reward_mode = reward_mode
        self.num_test_goals, self.num_dev_goals = num_test_goals, num_dev_goals
        self.text_env = WebShopTextEnv(self.data, self.engine, noun_tagger)
        self.observation_instruction = bool(observation_instruction)
        self.system_prompt = SYSTEM_PROMPT.format(max_steps=max_steps)
        self._active = False

    @classmethod
    def config_problems(cls, env_cfg: dict[str, Any], training: bool = False) -> list[str]:
        """The reward mode, counts, analyzers and, with real data (``env.real_data_dir`` or ``WEBSHOP_DATA_DIR``),
        that its directory holds the files (``find_data_files``); the files' content is read when the data loads."""
        env_cfg = cls.with_defaults(env_cfg)
        problems = super().config_problems({"max_steps": env_cfg["max_steps"]})
        for key, allowed in (("reward_mode", ("score", "success")), ("stemmer", ("porter", "none")),
                             ("noun_tagger", NOUN_TAGGERS)):
            if env_cfg[key] not in allowed:
                problems.append(f"env.{key}={env_cfg[key]!r}: expected one of {list(allowed)}")
        for key, minimum, meaning in (("num_test_goals", 0, "goals held out for test"),
                                      ("num_dev_goals", 0, "goals held out for validation"),
                                      ("catalog_size", 10, "products of the generated catalog")):
            problems += count_problem(key, env_cfg[key], minimum, meaning)
        problems += count_problem("num_products", env_cfg["num_products"], 1, "the first N products of the "
                                  "file; null: all", allow_none=True)
        real = env_cfg.get("real_data_dir") or os.environ.get("WEBSHOP_DATA_DIR")
        if real:
            try:
                find_data_files(real, bool(env_cfg["human_goals"]))
            except WebShopDataError as err:
                problems.append(f"env.real_data_dir={real!r} (or WEBSHOP_DATA_DIR): {err}; set it to the directory "
                                "of the original files, or null for the generated catalog")
        return problems

    def tasks(self, split: str) -> list[dict[str, Any]]:
        """``[{"task_name": "webshop", "goal_idx": i, "split": split, "variation": i}, ...]`` for the split's goal
        indices (``split_goal_indices``): every goal is a variation of the one task ``webshop``."""
        idx = split_goal_indices(len(self.data.goals), split, self.num_test_goals, self.num_dev_goals)
        return [{"task_name": TASK_NAME, "goal_idx": i, "split": split, "variation": i} for i in idx]

    def demonstrations(self, tasks: list[dict[str, Any]], env_cfg: dict[str, Any], data_dir: str) -> list[dict]:
        """The scripted expert's episodes on ``tasks`` (``webshop.demos.webshop_expert_records``)."""
        from src.envs.webshop.demos import webshop_expert_records

        return webshop_expert_records(self, tasks)

    def reflection_records(self, tasks: list[dict[str, Any]], env_cfg: dict[str, Any], data_dir: str
                           ) -> list[dict]:
        """Per goal the expert's episode and the expert's with one deliberate mistake (``webshop_records``)."""
        from src.envs.webshop.demos import webshop_records

        return webshop_records(self, tasks)

    def oracle_tips(self, tasks: list[dict[str, Any]], env_cfg: dict[str, Any], data_dir: str) -> list[list[str]]:
        """Diagnostic only (``Environment.oracle_tips``): the goal's product, its options and the actions that buy
        it, from the hidden goal."""
        out = []
        for task in tasks:
            self.reset(task)
            goal = self.goal
            clicks = [f"click[{goal['asin'].lower()}]"] + [f"click[{o}]" for o in goal["goal_options"]]
            out.append([f"The product is {goal['name']} ({goal['asin'].lower()}).",
                        f"search[{goal['name'].lower()}], then {', '.join(clicks)}, then click[buy now]."])
        return out

    hindsight_tip = staticmethod(webshop_tip)

    @property
    def goal(self) -> dict:
        return self.text_env.goal

    def reset(self, task: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Start goal ``task["goal_idx"]``. Raises ValueError for a missing/out-of-range index or one outside
        ``task["split"]`` when given."""
        idx = task.get("goal_idx") if isinstance(task, dict) else None
        if not isinstance(idx, int) or isinstance(idx, bool) or not 0 <= idx < len(self.data.goals):
            raise ValueError(f"WebShop task needs an int 'goal_idx' in [0, {len(self.data.goals)}), got {task!r}")
        split = task.get("split")
        if split is not None and idx not in split_goal_indices(len(self.data.goals), split, self.num_test_goals,
                                                                self.num_dev_goals):
            raise ValueError(f"goal_idx {idx} is not in the {split!r} split")
        self.goal_idx = idx
        obs = self._shown(self.text_env.reset(idx))
        self.steps = 0
        self._active = True
        return obs, self._info(action="", valid=True, format_ok=True)

    def step(self, response: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Apply the action of ``response`` (``extract_action``); ``format_ok`` is also False without a tag, and then
        ``format_penalty`` is subtracted from the step's reward. No tag, an empty one or an invalid action: no-op,
        reward 0 (minus the penalty). Raises RuntimeError after the episode ended."""
        if not self._active:
            raise RuntimeError("WebShopEnv.step called before reset or after the episode ended")
        self.steps += 1
        action, format_ok = extract_action(response)
        format_ok = format_ok and bool(action)
        action = action or ""
        obs, reward, done, valid = self.text_env.observation, 0.0, False, False
        if action:
            obs, score, done, valid = self.text_env.step(action)
            if done:
                reward = score if self.reward_mode == "score" else 10.0 * float(score == 1.0)
        if not format_ok:
            reward -= self.format_penalty
        truncated = not done and self.steps >= self.max_steps
        if done or truncated:
            self._active = False
        info = self._info(action=action, valid=valid, format_ok=format_ok)
        return self._shown(obs), float(reward), done, truncated, info

    def close(self) -> None:
        self._active = False

    def _shown(self, obs: str) -> str:
        # Every page repeats the instruction; the prompt already shows it as the task, and in a CPU-sized prompt
        # the copy would crowd out the page (and fill the capped history observations).
        if self.observation_instruction:
            return obs
        # the nodes as the page renderer joins them (stripped), so the match cannot silently miss
        return obs.replace(pages.join_nodes(["Instruction:", self.text_env.instruction]) + pages.SEP, "", 1)

    def _info(self, action: str, valid: bool, format_ok: bool) -> dict[str, Any]:
        te = self.text_env
        score = float(te.reward) if te.done else 0.0
        info = {
            "score": score, "success": score == 1.0, "won": score == 1.0, "max_score": 1.0,
            "instruction": te.instruction, "task_id": f"webshop-{self.goal_idx}", "variation": self.goal_idx,
            "admissible_actions": te.admissible_actions(), "valid_action": valid, "action": action,
            "format_ok": format_ok, "page": te.page, "step": self.steps,
        }
        if te.done:
            info["reward_info"] = te.reward_info
        return info


SYSTEM_PROMPT = """You shop on the WebShop website: buy the product that best matches the instruction (its \
attributes, options such as color and size, and price limit). Each turn shows the page (elements separated by \
[SEP]) and the admissible actions: search[keywords] while the search box shows, or click[element] on a product \
id, an option or a button as listed. On a product page click the options you need, then click[buy now], which \
ends the episode. At most {max_steps} actions. Reply with one action inside <action>...</action>, optionally \
after brief reasoning inside <think>...</think>."""
