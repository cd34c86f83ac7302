"""WebShop's demonstrations (the scripted expert's episodes on training goals), reflection trajectories and hindsight
tips for the imitation warm start (``WebShopEnv``'s ``Environment`` hooks; docs/usage.md#imitation-warm-start)."""
from __future__ import annotations

import logging
import re
from typing import Any

from src.envs.webshop.pages import BUTTONS
from src.utils.timing import EtaLog

log = logging.getLogger(__name__)


def webshop_expert_records(env, tasks: list[dict[str, Any]], expert=None) -> list[dict]:
    """Episodes of the scripted expert (or ``expert``, e.g. a ``FlawedExpertPolicy``) on WebShop ``tasks``
    (``{"goal_idx", "split"}``) in ``env``, under its step cap: records in ``replay``'s format without ``max_score``."""
    from src.envs.webshop.baselines import ExpertPolicy

    expert = expert or ExpertPolicy(env)
    out = []
    progress = EtaLog(log, "WebShop expert demonstrations", len(tasks), "goals") if len(tasks) > 1 else None
    for task in tasks:
        observation, info = env.reset(task)
        expert.reset()
        record = {"task": task, "instruction": info["instruction"], "initial_observation": observation,
                  "responses": [], "actions": [], "observations": [], "admissible_actions": []}
        done = truncated = False
        while not (done or truncated):
            response = expert.act(observation, info)
            record["admissible_actions"].append(info["admissible_actions"])
            observation, _, done, truncated, info = env.step(response)
            record["responses"].append(response)
            record["actions"].append(info["action"])
            record["observations"].append(observation)
        record["success"], record["score"] = bool(info["success"]), float(info["score"])
        out.append(record)
        if progress:
            progress.step()
    return out


_LEAD_WORDS = {"i", "i'd", "i'm", "im", "need", "want", "looking", "for", "a", "an", "some", "am", "would", "like",
               "to", "buy", "find", "get", "me", "please", "is", "that"}


def _words(text: str, n: int) -> str:
    return " ".join(text.split()[:n])


def _named_in(values: list[str], text: str) -> list[str]:
    """The values that ``text`` names as a whole phrase (case-insensitive)."""
    low = text.lower()
    return [v for v in values if re.search(rf"(?<![\w]){re.escape(v.lower())}(?![\w])", low)]


def _item_page(observation: str) -> tuple[str, float | None]:
    """(title, lowest price) of a WebShop item page: the title is the element before ``Price: ...``."""
    elements = [e.strip() for e in observation.split("[SEP]")]
    for k, e in enumerate(elements):
        if e.startswith("Price:") and k > 0:
            prices = re.findall(r"\$([\d.]+)", e)
            return elements[k - 1], (min(float(p) for p in prices) if prices else None)
    return "", None


def webshop_query(instruction: str, n_words: int = 8) -> str:
    """A search query from the instruction's own words: the price clause and the lead-in ("i need a") removed,
    the first ``n_words`` words kept."""
    text = re.split(r",?\s*and price lower than", instruction)[0]
    words = text.replace(",", " ").split()
    while words and words[0].lower() in _LEAD_WORDS:
        words = words[1:]
    return " ".join(words[:n_words])


def webshop_tip(record: dict[str, Any]) -> list[str]:
    """The hindsight tip on a WebShop trajectory (``Environment.hindsight_tip``). Option values count as required
    when the instruction names them; the price limit is the instruction's."""
    instruction, actions, pages = record["instruction"], record["actions"], record["observations"]
    admissible = record.get("admissible_actions") or []
    limit = re.search(r"price lower than ([\d.]+) dollars", instruction)
    limit = float(limit.group(1)) if limit else None
    query = next((a[7:-1] for a in actions if a.startswith("search[")), "")
    title, price, options, clicked = "", None, [], []
    for t, action in enumerate(actions):
        page_title, page_price = _item_page(pages[t])
        arg = action[6:-1] if action.startswith("click[") else None
        if page_title and arg is not None and arg not in BUTTONS and arg not in options:
            # a product opened: its options are the page's clickables other than buttons (next state's list)
            title, price, clicked = page_title, page_price, []
            nxt = admissible[t + 1] if t + 1 < len(admissible) else []
            options = [a[6:-1] for a in nxt if a.startswith("click[") and a[6:-1] not in BUTTONS]
        elif arg in options:
            clicked.append(arg)
    named = _named_in(options, instruction)
    missing = [v for v in named if v not in clicked]
    extra = [v for v in clicked if v not in named]
    short = _words(title, 5)
    # plain words, not the action syntax: a tip full of "click[...]" teaches the policy that "click[" is followed by an
    # option, and a tip should read as advice, not as an action
    need = "choose " + " and ".join(named) if named else ""
    bought = "click[buy now]" in actions
    if not bought:
        return [f"Score {record['score']:g}: I never clicked buy now within the step limit.",
                f"Next time open a result matching '{webshop_query(instruction, 6)}'"
                + (f", {need}" if need else "") + ", then buy it early."]
    if record["score"] >= record.get("max_score", 1.0):
        return [f"Score {record['score']:g}: worked. Searched '{webshop_query(query, 5)}', opened {_words(title, 4)}"
                + (f", {need}" if need else "") + ", buy now.",
                "Repeat: click every option the task names before buying."]
    problems = []
    if missing and extra:
        problems.append(f"I clicked {', '.join(extra)} but the task asked for {' and '.join(missing)}.")
    elif missing:
        problems.append(f"I never clicked {' and '.join(missing)}.")
    if price is not None and limit is not None and price > limit:
        problems.append(f"{short} cost ${price:g}, over the ${limit:g} limit.")
    vague = len(query.split()) < 4
    if vague:
        problems.append(f"My query '{query}' was too vague.")
    if not problems:
        problems.append(f"{short} did not match all the task's attributes.")
    fix = f"search '{webshop_query(instruction)}', open the best matching result" if vague or not missing \
        else "on the product page"
    problems[0] = f"Score {record['score']:g}: {problems[0]}"
    return problems + [f"Next time {fix}" + (f", {need}" if need else "") + ", then buy now."]


def webshop_records(env, tasks: list[dict[str, Any]]) -> list[dict]:
    """Per training goal two trajectories: the scripted expert's and the expert's with one deliberate mistake
    (``FlawedExpertPolicy``; the mistakes taken in turn over the goals). Same record format as
    ``webshop_expert_records``."""
    from src.envs.webshop.baselines import MISTAKES, FlawedExpertPolicy

    clean = webshop_expert_records(env, tasks)
    flawed = [webshop_expert_records(env, [task], FlawedExpertPolicy(env, MISTAKES[i % len(MISTAKES)]))[0]
              for i, task in enumerate(tasks)]
    return [r for pair in zip(clean, flawed) for r in pair]
