"""Reflection examples for the imitation warm start: the policy is taught to write a tip, not only to act.

EMPO²'s memory holds the policy's own reflections (docs/method.md#memory): after an episode the same LLM is asked
for a one-line tip. A small policy fine-tuned on actions only answers that prompt with an action, so the memory
holds nothing to learn from (``rollout/tip_action_frac``). Next to the action demonstrations the warm start
therefore trains on reflection examples:

- trajectories that go right and wrong on the *training* tasks: WebShop — the scripted expert, and the expert
  making one deliberate mistake (``FlawedExpertPolicy``: another option value, a missing option click, a two-word
  query, another product); ScienceWorld — the gold paths and the gold paths after needless ``look around`` steps,
  replayed in the simulator under the run's step cap (so some run out of steps);
- the prompt: the memory's own reflection prompt (``reflection_prompt_ids``) over the trajectory as the rollout
  runner renders it (``step_prompt``), token for token;
- the target: a tip written in hindsight from what the trajectory shows the agent and nothing else (the
  instruction, the pages or rooms it saw, the actions it took, the final score): what the task asked for, what the
  episode did, what was missing, what to do next time. ``webshop_tip`` and ``scienceworld_tip`` read only those
  fields of a record; the hidden goal (product id, goal options and attributes, gold path) never reaches them.

Targets are at most ``max_tokens`` tokens with EOS (``memory.tip_max_tokens``): the tip is built from sentences in
order of importance and stops before the one that would not fit.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from src.data.prompts import HistoryItem
from src.data.reflection_prompt import reflection_prompt_ids
from src.data.rollout_config import RolloutConfig
from src.data.samples import SFTExample
from src.data.step_prompt import step_prompt

log = logging.getLogger(__name__)

# Buttons of the WebShop pages (the rest of a page's clickables are products or option values).
WEBSHOP_BUTTONS = {"back to search", "< prev", "next >", "description", "features", "reviews", "buy now"}
_LEAD_WORDS = {"i", "i'd", "i'm", "im", "need", "want", "looking", "for", "a", "an", "some", "am", "would", "like",
               "to", "buy", "find", "get", "me", "please", "is", "that"}
SCIENCEWORLD_WASTE = ("look around", "inventory")  # actions that show but never change the state


# --------------------------------------------------------------------------- WebShop
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
    """The hindsight tip on a WebShop trajectory, as sentences in order of importance.

    Reads only what the agent saw: ``instruction``, ``actions`` (executed), ``observations`` (the page after each
    action), ``admissible_actions`` (per state, listed in the prompt) and ``score`` ([0, 1], shown in the reflection
    prompt). Option values count as required when the instruction names them; the price limit is the instruction's.
    """
    instruction, actions, pages = record["instruction"], record["actions"], record["observations"]
    admissible = record.get("admissible_actions") or []
    limit = re.search(r"price lower than ([\d.]+) dollars", instruction)
    limit = float(limit.group(1)) if limit else None
    query = next((a[7:-1] for a in actions if a.startswith("search[")), "")
    title, price, options, clicked = "", None, [], []
    for t, action in enumerate(actions):
        page_title, page_price = _item_page(pages[t])
        arg = action[6:-1] if action.startswith("click[") else None
        if page_title and arg is not None and arg not in WEBSHOP_BUTTONS and arg not in options:
            # a product opened: its options are the page's clickables other than buttons (next state's list)
            title, price, clicked = page_title, page_price, []
            nxt = admissible[t + 1] if t + 1 < len(admissible) else []
            options = [a[6:-1] for a in nxt if a.startswith("click[") and a[6:-1] not in WEBSHOP_BUTTONS]
        elif arg in options:
            clicked.append(arg)
    named = _named_in(options, instruction)
    missing = [v for v in named if v not in clicked]
    extra = [v for v in clicked if v not in named]
    short = _words(title, 5)
    # plain words, not the action syntax: a tip full of "click[...]" teaches the policy that "click[" is followed by an
    # option (its buy-now step lost 5 nats of log-prob), and a tip should read as advice, not as an action
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
    from src.data.demonstrations import webshop_expert_records
    from src.envs.webshop.baselines import MISTAKES, FlawedExpertPolicy

    clean = webshop_expert_records(env, tasks)
    flawed = [webshop_expert_records(env, [task], FlawedExpertPolicy(env, MISTAKES[i % len(MISTAKES)]))[0]
              for i, task in enumerate(tasks)]
    return [r for pair in zip(clean, flawed) for r in pair]


# --------------------------------------------------------------------------- ScienceWorld
def _arg(action: str, verb: str) -> str | None:
    return action[len(verb):].strip() if action.startswith(verb) else None


def scienceworld_tip(record: dict[str, Any]) -> list[str]:
    """The hindsight tip on a ScienceWorld trajectory, as sentences in order of importance.

    Reads only ``instruction``, ``initial_observation`` (the room it starts in), ``actions`` (executed) and ``score``
    (points, −100..100; shown in the reflection prompt): the rooms gone to, the object focused on and the actions
    that changed something; needless ``look around``/``inventory`` steps (a look with no move since the last one;
    the first observation already shows the room) are counted. What is left to do comes from the instruction
    (the thing to find, the box and room to move it to).
    """
    actions, score, top = record["actions"], float(record["score"]), float(record.get("max_score", 100.0))
    waste, moved = 0, False
    for a in actions:
        if a in SCIENCEWORLD_WASTE:
            waste += 0 if moved else 1
            moved = False
        elif a.startswith(("go to", "teleport to")):
            moved = True
    key = [a for a in actions if a not in SCIENCEWORLD_WASTE and not a.startswith(("open door", "close door"))]
    focus = next((_arg(a, "focus on") for a in actions if a.startswith("focus on")), None)
    if score >= top:
        return [f"Score {score:g}: worked. {'; '.join(key)}.", "Repeat it with no extra look around."]
    if score < 0 and focus:
        return [f"Score {score:g}: focusing on the {focus} ended the episode, the wrong object.",
                "Next time focus only on an object that fits the task."]
    instruction = record["instruction"]
    thing = re.search(r"find an? ?(?:\(n\) )?([\w -]+?)\.", instruction)
    box = re.search(r"move it to (the [\w ]+?)(?: in the ([\w ]+))?\.", instruction)
    start = re.search(r"This room is called the ([\w ]+?)\.", record["initial_observation"])
    rooms = [start.group(1)] if start else []
    rooms += [_arg(a, "go to") or _arg(a, "teleport to") for a in actions if a.startswith(("go to", "teleport to"))]
    todo = []
    if box and box.group(2) and (not rooms or rooms[-1] != box.group(2)):
        todo.append(f"go straight to the {box.group(2)}")
    if not focus:
        todo.append(f"focus on a {thing.group(1)}" if thing else "focus on the object the task names")
    if box and not any(a.startswith("move") for a in actions):
        todo.append(f"move it to {box.group(1)}")
    return [f"Score {score:g}: I ran out of steps after {len(actions)} actions"
            + (f", {waste} of them needless look around" if waste else "") + ".",
            "Next time " + ("skip look around, " if waste else "") + ", then ".join(todo or ["finish in fewer steps"])
            + ".", f"Done: {'; '.join(key)}." if key else "Nothing done."]


def scienceworld_records(env, tasks: list[dict[str, Any]], gold: list[dict[str, Any]]) -> list[dict]:
    """Per training variation two trajectories replayed in ``env`` under its step cap: the gold path, and the gold
    path after needless ``look around`` steps (as many as push it past the cap, at least one), so some go right and
    some run out of steps."""
    out = []
    for task, record in zip(tasks, gold):
        cap = env.max_steps or 30
        extra = max(1, cap - len(record["actions"]) + 1)
        for actions in (record["actions"], ["look around"] * extra + record["actions"]):
            out.append(replay(env, task, actions))
    return out


def replay(env, task: dict[str, Any], replies: list[str]) -> dict[str, Any]:
    """Run ``replies`` in ``env`` from ``task``'s reset until the episode ends; a demonstration record."""
    observation, info = env.reset(task)
    record = {"task": task, "instruction": info["instruction"], "initial_observation": observation,
              "responses": [], "actions": [], "observations": [], "admissible_actions": [],
              "max_score": float(getattr(env, "max_score", 1.0))}
    for reply in replies:
        record["admissible_actions"].append(info.get("admissible_actions"))
        observation, _, done, truncated, info = env.step(reply)
        record["responses"].append(reply)
        record["actions"].append(info["action"])
        record["observations"].append(observation)
        if done or truncated:
            break
    record["success"], record["score"] = bool(info["success"]), float(info["score"])
    if not any(record["admissible_actions"]):
        record["admissible_actions"] = None
    return record


def reflection_records(env_cfg: dict[str, Any], num_tasks: int | None, gold_dir: str
                       ) -> tuple[list[dict], Callable[[dict[str, Any]], list[str]], str]:
    """(trajectories to reflect on, the tip writer for them, the environment's system prompt) on the *training*
    tasks ``demonstration_records`` takes its demonstrations from (``num_tasks`` as there).

    Raises:
        ValueError: an environment without reflection examples.
    """
    from src.data.demonstrations import ensure_gold, training_tasks
    from src.envs.scienceworld import ScienceWorldEnv
    from src.envs.webshop import WebShopEnv

    env_cfg, env, tasks = training_tasks(env_cfg, num_tasks)
    try:
        if isinstance(env, WebShopEnv):
            records, write = webshop_records(env, tasks), webshop_tip
        elif isinstance(env, ScienceWorldEnv):
            gold = ensure_gold(tasks, gold_dir, env_cfg.get("simplification", "easy"), env_cfg.get("jvm_heap", "768m"))
            records, write = _cached_replays(env, env_cfg, tasks, gold, gold_dir), scienceworld_tip
        else:
            raise ValueError(f"env._target_={env_cfg.get('_target_')!r} has no reflection examples; they exist for "
                             "ScienceWorld and WebShop (set model.warm_start.reflections=null)")
        system_prompt = env.system_prompt
    finally:
        env.close()
    return records, write, system_prompt


def _cached_replays(env, env_cfg: dict[str, Any], tasks: list[dict[str, Any]], gold: list[dict[str, Any]],
                    gold_dir: str) -> list[dict]:
    """``scienceworld_records``, cached in ``gold_dir`` on first use. The simulator lists a room's objects in an order
    that changes from one process (JVM) to the next, so replays made afresh gave each run other reflection examples
    and so another warm-start cache entry; read from the cache they are the same in every run."""
    import json

    from src.utils.io import json_digest, write_json_atomic

    settings = {k: env_cfg.get(k) for k in ("task", "simplification", "action_correction")}
    key = json_digest([settings, env.max_steps, tasks, [r["actions"] for r in gold]])
    path = Path(gold_dir) / f"reflection_replays-{key}.json"
    if path.exists():
        return json.loads(path.read_text())
    records = scienceworld_records(env, tasks, gold)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, records, default=str)
    return json.loads(path.read_text())  # the same JSON types whether just written or read later


# --------------------------------------------------------------------------- examples
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
    """One example per record: the memory's reflection prompt on the record's trajectory → its hindsight tip.

    Args:
        policy: renders the prompts and tokenizes the tips.
        records: demonstration records (``replay`` / ``webshop_expert_records`` format) with ``score`` and
            ``max_score``; optionally ``response_ids`` per step (the replies' ids as sampled; default: each reply's
            text tokenized + EOS).
        cfg, max_steps: the RL run's rollout settings and step budget (``step_prompt``); tip-free prompts.
        write_tip: ``webshop_tip`` or ``scienceworld_tip``.
        max_tokens: the tip's token budget with EOS (``memory.tip_max_tokens``).
        continue_last: as ``memory.reuse_rollout_cache`` (the reflection continues the last rollout prompt).

    The episode is rebuilt exactly as the rollout runner records it (each step's rollout prompt from
    ``step_prompt``, the reply's ids + EOS, the executed action, the past steps the prompt showed), then
    ``reflection_prompt_ids`` renders the prompt; the target is the tip's ids + EOS (``response_ids``).
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
