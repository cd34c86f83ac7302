"""Reflection examples of the imitation warm start (src/data/reflections.py): trajectories that go right and wrong
from the real WebShop expert and the real ScienceWorld simulator, hindsight tips from what the agent saw only."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from src.data.reflections import fit_tip, reflection_examples, reflection_records, tipped_demonstrations
from src.envs.scienceworld_demos import scienceworld_tip
from src.envs.webshop.demos import webshop_records, webshop_tip
from src.data.rollout_config import RolloutConfig
from src.envs.base import extract_action
from src.envs.webshop.baselines import MISTAKES, FlawedExpertPolicy

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("EMPO2_DATA_DIR", ROOT / "data"))
WEBSHOP_CFG = {"_target_": "src.envs.webshop.WebShopEnv", "data_dir": str(DATA / "webshop"), "max_steps": 8,
               "observation_instruction": False}
SCIENCEWORLD_CFG = {"_target_": "src.envs.scienceworld.ScienceWorldEnv", "task": "find-non-living-thing",
                    "max_steps": 6}
# What a record shows the agent: the task, every page/observation, its own actions, the listed admissible actions
# and the final score (the reflection prompt shows it). Anything else (the goal's product, options, attributes,
# the gold path) is hidden.
VISIBLE = ("instruction", "initial_observation", "actions", "observations", "admissible_actions", "score",
           "max_score")
# The tip writers' own words (their sentence templates).
TEMPLATE = set("""i never clicked buy now within the step limit next time open a result matching then click early
worked search opened repeat every option task names before buying but asked for and cost over my query was too vague
did not match all s attributes best matching on product page it with no extra look around focusing ended episode
points wrong object focus only an that fits score ran out of steps after actions them needless skip go straight to
move finish in fewer done nothing choose searched""".split())
TEXTWORLD_TEMPLATE = TEMPLATE | set("""was is there take no try exits of the or inventory episode last recipe says read
cookbook first coin""".split())


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def _visible_text(record: dict) -> str:
    parts = [record["instruction"], record["initial_observation"], *record["actions"], *record["observations"]]
    parts += [a for state in record.get("admissible_actions") or [] for a in state or []]
    return " ".join(parts + [f"{record['score']:g}", f"{record.get('max_score', 1.0):g}"])


def _check_visible_only(records: list[dict], write_tip, template: set[str] = TEMPLATE) -> None:
    for record in records:
        tip = " ".join(write_tip(record))
        # a function of what the agent saw: the same tip from the visible fields alone
        assert " ".join(write_tip({k: record[k] for k in VISIBLE if k in record})) == tip
        unseen = {w for w in _words(tip) - template - _words(_visible_text(record)) if not w.isdigit()}
        assert not unseen, f"tip {tip!r} names {sorted(unseen)}, which the trajectory never showed"
        # the outcome first, copied from the prompt's "Final score": success and failure tips part at a visible number
        assert tip.startswith(f"Score {record['score']:g}: "), tip


@pytest.fixture(scope="module")
def webshop_env():
    from src.envs.webshop import WebShopEnv

    env = WebShopEnv(WEBSHOP_CFG["data_dir"], max_steps=8, observation_instruction=False)
    yield env
    env.close()


@pytest.fixture(scope="module")
def webshop_reflections(webshop_env):
    return webshop_records(webshop_env, webshop_env.tasks("train")[:12])


def test_webshop_trajectories_go_right_and_wrong_and_tips_use_only_what_the_agent_saw(webshop_reflections):
    records = webshop_reflections
    assert len(records) == 24 and all(r["task"]["split"] == "train" for r in records)
    scores = [r["score"] for r in records]
    assert max(scores) == 1.0 and sum(s < 1.0 for s in scores) >= 6  # the flawed expert's episodes go wrong
    _check_visible_only(records, webshop_tip)
    tips = [" ".join(webshop_tip(r)) for r in records]
    # a wrong or missing option is named, with the value the instruction asked for
    assert any(re.search(r"I clicked .+ but the task asked for", t) for t in tips)
    assert any(re.match(r"Score [\d.]+: I never clicked", t) for t in tips) and any("too vague" in t for t in tips)
    assert all(extract_action(t)[0] is None for t in tips)  # advice, not an <action> reply


def test_each_deliberate_mistake_shows_in_the_trajectory(webshop_env):
    task = webshop_env.tasks("train")[0]  # asks for the option "2 cameras"
    from src.envs.webshop.demos import webshop_expert_records

    runs = {m: webshop_expert_records(webshop_env, [task], FlawedExpertPolicy(webshop_env, m))[0] for m in MISTAKES}
    assert "click[2 cameras]" not in runs["wrong_option"]["actions"] and runs["wrong_option"]["score"] < 1
    assert "click[1 camera]" in runs["wrong_option"]["actions"]  # another value of the same option
    assert "click[2 cameras]" not in runs["missing_option"]["actions"] and runs["missing_option"]["score"] < 1
    assert len(runs["weak_query"]["actions"][0][7:-1].split()) == 2
    goal = f"click[{webshop_env.goal['asin'].lower()}]"
    assert runs["wrong_product"]["actions"][1] != goal
    with pytest.raises(ValueError, match="mistake='typo'"):
        FlawedExpertPolicy(webshop_env, "typo")


def test_scienceworld_tips_use_only_what_the_agent_saw(tmp_path, monkeypatch):
    import src.envs.scienceworld_demos as scienceworld_demos

    cfg = {**SCIENCEWORLD_CFG, "num_test_variations": 1}
    records, write_tip, _ = reflection_records(cfg, 2, tmp_path)  # gold paths generated in a subprocess
    # the replays are cached next to the gold paths (the simulator orders a room's objects differently per process)
    assert len(list(tmp_path.glob("reflection_replays-*.json"))) == 1
    monkeypatch.setattr(scienceworld_demos, "scienceworld_records", lambda *a: pytest.fail("replayed again"))
    assert reflection_records(cfg, 2, tmp_path)[0] == records
    assert write_tip is scienceworld_tip and len(records) == 4
    assert any(r["success"] for r in records) and any(not r["success"] for r in records)
    assert all(r["actions"][0] == "look around" for r in records[1::2])  # the wasteful variant
    _check_visible_only(records, scienceworld_tip)
    tips = [" ".join(scienceworld_tip(r)) for r in records]
    assert any(t.startswith("Score 100: worked.") for t in tips) and any("needless look around" in t for t in tips)


def test_fit_tip_keeps_whole_sentences_within_the_budget(tiny_policy):
    tokens = lambda t: len(tiny_policy.tokenizer(t, add_special_tokens=False)["input_ids"]) + 1  # noqa: E731
    first, second = "I never clicked grey.", "Next time click grey on the product page, then buy now."
    assert fit_tip(tiny_policy, [first, second], 64) == f"{first} {second}"
    assert fit_tip(tiny_policy, [first, second], tokens(first)) == first
    long = " ".join(["word"] * 80)
    cut = fit_tip(tiny_policy, [long, second], 10)
    assert tokens(cut) <= 10 and long.startswith(cut) and cut


def test_reflection_examples_are_the_memorys_prompt_and_a_short_tip(tiny_policy, webshop_reflections):
    records = webshop_reflections[:4]
    cfg = RolloutConfig(max_response_tokens=64, history_length=2, history_obs_chars=200, history_action="executed")
    examples = reflection_examples(tiny_policy, records, "You shop.", cfg, 8, webshop_tip, 48)
    decode = tiny_policy.tokenizer.decode
    for example, record in zip(examples, records):
        assert len(example.response_ids) <= 48 and example.response_ids[-1] == tiny_policy.tokenizer.eos_token_id
        assert decode(example.response_ids[:-1]) in " ".join(webshop_tip(record))
        prompt = decode(example.prompt_ids)
        # the continued reflection: the last step's prompt and reply, then the reflection turn with the ending
        assert prompt.count("Final score:") == 1 and f"Final score: {record['score']:g} out of 1." in prompt
        assert record["responses"][-1].strip() in prompt
    fresh = reflection_examples(tiny_policy, records[:1], "You shop.", cfg, 8, webshop_tip, 48, continue_last=False)
    assert "Your trajectory (" in decode(fresh[0].prompt_ids)


def test_tipped_demonstrations_show_the_other_trajectorys_tip_as_the_memory_stores_it(tiny_policy, webshop_env,
                                                                                      webshop_reflections):
    from src.data.demonstrations import build_examples
    from src.envs.webshop.demos import webshop_expert_records
    from src.memory.tip_entry import format_entry

    tasks = webshop_env.tasks("train")[:3]
    demos = webshop_expert_records(webshop_env, tasks)
    tipped = tipped_demonstrations(tiny_policy, demos, webshop_reflections, webshop_tip, 48)
    assert [d["task"] for d in tipped] == tasks and all(d["actions"] == e["actions"] for d, e in zip(tipped, demos))
    cfg = RolloutConfig(max_response_tokens=64, history_length=2, history_obs_chars=200, history_action="executed",
                        use_tips=True)
    examples = build_examples(tiny_policy, tipped, "You shop.", cfg, 8)
    plain = build_examples(tiny_policy, demos, "You shop.", cfg, 8)
    assert [e.response_ids for e in examples] == [e.response_ids for e in plain]  # same targets: the expert's actions
    decode = tiny_policy.tokenizer.decode
    for demo in tipped:
        flawed = next(r for r in webshop_reflections if r["task"] == demo["task"] and r["actions"] != demo["actions"])
        tip = fit_tip(tiny_policy, webshop_tip(flawed), 48)
        for t, step_tips in enumerate(demo["tips"]):
            # the flawed trajectory's entry at the same step (or its last), as the memory writes it
            action = flawed["actions"][min(t, len(flawed["actions"]) - 1)]
            assert step_tips == [format_entry(tip, action, flawed["score"], 1.0)]
    entries = {(str(d["task"]), t): step_tips for d in tipped for t, step_tips in enumerate(d["tips"])}
    for example, without in zip(examples, plain):
        prompt = decode(example.prompt_ids)
        assert all(entry in prompt for entry in entries[str(example.task), example.step])  # shown in the prompt
        assert not any(entry in decode(without.prompt_ids) for entry in entries[str(example.task), example.step])


def test_textworld_express_tips_use_only_what_the_agent_saw(tmp_path):
    from src.envs.textworld_express import textworld_express_tip

    cfg = {"_target_": "src.envs.textworld_express.TextWorldExpressEnv", "max_steps": 12,
           "game_params": {"numLocations": 4, "includeDoors": 1, "numDistractorItems": 0}}
    records, write_tip, _ = reflection_records(cfg, 10, tmp_path)
    assert write_tip is textworld_express_tip and len(records) == 20
    _check_visible_only(records, textworld_express_tip, TEXTWORLD_TEMPLATE)
    tips = [" ".join(textworld_express_tip(r)) for r in records]
    assert any("The coin is in the" in t for t in tips) and any("Next time try the exits" in t for t in tips)
