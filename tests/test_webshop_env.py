"""WebShop pages, transitions and the agent wrapper on a tiny hand-built catalog in the original file format;
baselines on the generated catalog. Expected observation strings are written out by hand (the original's
``web_agent_site/envs/web_agent_text_env.py``)."""
from __future__ import annotations

import json

import pytest

from src.envs.webshop import WebShopEnv
from src.envs.webshop.baselines import ExpertPolicy, RandomPolicy, run_policy

WORDS = ["Alpha", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot", "Golf", "Hotel", "India", "Juliet", "Kilo", "Lima"]
INSTR = "i need a black widget in size large, and price lower than 990.00 dollars"
INSTR2 = "i want any widget, and price lower than 990.00 dollars"
HEAD = f"Instruction: [SEP] {INSTR} [SEP] Back to Search"


def _product(i: int) -> dict:
    # Every document has 13 index tokens with tf(widget) = 2, so a "widget" search ties and keeps file order.
    return {"asin": f"B{i:09d}", "name": f"Widget {WORDS[i]}", "full_description": "A handy widget.",
            "small_description": ["Solid build", "Ships fast"],
            "pricing": {0: "$975.00", 1: "$970.00$975.00"}.get(i, "$19.99"),
            "customization_options": {"Color": [{"value": "Black"}, {"value": "Natural Brown"}],
                                      "Size": [{"value": "Small"}, {"value": "Large"}]},
            "images": [], "category": "home", "query": "Widgets", "product_category": "Home › Widgets"}


@pytest.fixture()
def env(tmp_path):
    d = tmp_path / "original"
    d.mkdir()
    (d / "items_shuffle_1000.json").write_text(json.dumps([_product(i) for i in range(12)]))
    (d / "items_ins_v2_1000.json").write_text(json.dumps({"B000000000": {"attributes": ["handy"]}}))
    (d / "items_human_ins.json").write_text(json.dumps({
        "B000000000": [{"instruction": "i need a black widget in size large.", "instruction_attributes": ["handy"],
                        "instruction_options": ["black", "large"]}],
        "B000000001": [{"instruction": "i want any widget", "instruction_attributes": ["handy"],
                        "instruction_options": []}]}))
    e = WebShopEnv(tmp_path / "cache", str(d), num_test_goals=1, max_steps=40)
    yield e
    e.close()


def _idx(env, asin):
    return next(i for i, g in enumerate(env.data.goals) if g["asin"] == asin)


def act(env, action):
    return env.step(f"<think>...</think><action>{action}</action>")


def test_pages_and_transitions(env):
    obs, info = env.reset({"goal_idx": _idx(env, "B000000000")})
    assert obs == f"WebShop [SEP] Instruction: [SEP] {INSTR} [SEP] Search"
    assert info["admissible_actions"] == ["search[<query>]"] and info["instruction"] == INSTR

    page1 = (f"{HEAD} [SEP] Page 1 (Total results: 12) [SEP] Next > [SEP] "
             "B000000000 [SEP] Widget Alpha [SEP] $975.0 [SEP] B000000001 [SEP] Widget Bravo [SEP] $970.0 to $975.0 "
             "[SEP] B000000002 [SEP] Widget Charlie [SEP] $19.99 [SEP] B000000003 [SEP] Widget Delta [SEP] $19.99 "
             "[SEP] B000000004 [SEP] Widget Echo [SEP] $19.99 [SEP] B000000005 [SEP] Widget Foxtrot [SEP] $19.99 "
             "[SEP] B000000006 [SEP] Widget Golf [SEP] $19.99 [SEP] B000000007 [SEP] Widget Hotel [SEP] $19.99 "
             "[SEP] B000000008 [SEP] Widget India [SEP] $19.99 [SEP] B000000009 [SEP] Widget Juliet [SEP] $19.99")
    obs, r, term, trunc, info = act(env, "search[Widget]")
    assert (obs, r, term, trunc, info["valid_action"]) == (page1, 0.0, False, False, True)
    assert info["admissible_actions"] == ["click[back to search]", "click[next >]"] + [
        f"click[b{i:09d}]" for i in range(10)]

    page2 = (f"{HEAD} [SEP] Page 2 (Total results: 12) [SEP] < Prev [SEP] Next > [SEP] "
             "B000000010 [SEP] Widget Kilo [SEP] $19.99 [SEP] B000000011 [SEP] Widget Lima [SEP] $19.99")
    obs, *_, info = act(env, "click[Next >]")
    assert obs == page2
    assert info["admissible_actions"] == ["click[back to search]", "click[< prev]", "click[next >]",
                                          "click[b000000010]", "click[b000000011]"]
    obs, *_ = act(env, "click[next >]")  # past the last page: no items, Next > still shown
    assert obs == f"{HEAD} [SEP] Page 3 (Total results: 12) [SEP] < Prev [SEP] Next >"
    assert act(env, "click[< prev]")[0] == page2
    assert act(env, "click[< prev]")[0] == page1
    obs, r, _, _, info = act(env, "click[< prev]")  # no < Prev on page 1: no-op
    assert (obs, r, info["valid_action"]) == (page1, 0.0, False)

    item = (f"{HEAD} [SEP] < Prev [SEP] color [SEP] black [SEP] natural brown [SEP] size [SEP] small [SEP] large "
            "[SEP] Widget Alpha [SEP] Price: $975.0 [SEP] Rating: N.A. [SEP] Description [SEP] Features [SEP] Reviews "
            "[SEP] Buy Now")
    obs, *_, info = act(env, "click[B000000000]")  # argument is lower-cased
    assert obs == item
    assert info["admissible_actions"] == [
        "click[back to search]", "click[< prev]", "click[description]", "click[features]", "click[reviews]",
        "click[buy now]", "click[black]", "click[natural brown]", "click[small]", "click[large]"]
    obs, *_, info = act(env, "click[black]")  # the chosen option is not marked in the simple text mode
    assert obs == item and info["valid_action"]
    assert act(env, "click[description]")[0] == f"{HEAD} [SEP] < Prev [SEP] A handy widget."
    assert act(env, "click[< prev]")[0] == item
    assert act(env, "click[features]")[0] == f"{HEAD} [SEP] < Prev [SEP] Solid build [SEP] Ships fast"
    assert act(env, "click[< prev]")[0] == item
    assert act(env, "click[reviews]")[0] == f"{HEAD} [SEP] < Prev"
    assert act(env, "click[< prev]")[0] == item
    act(env, "click[large]")
    # handy (attribute) 1 + black, large 2 + price 975 <= 990 1 -> 4/4, same query -> r_type 1
    obs, r, term, trunc, info = act(env, "click[buy now]")
    assert obs == ('Thank you for shopping with us! [SEP] Your code: [SEP] None [SEP] (Paste it in your MTurk '
                   'interface.) [SEP] Purchased [SEP] asin [SEP] B000000000 [SEP] options [SEP] {"color": "black", '
                   '"size": "large"} [SEP] attrs [SEP] None [SEP] category [SEP] None [SEP] query [SEP] None [SEP] '
                   'product category [SEP] None [SEP] Target [SEP] asin [SEP] options [SEP] attrs [SEP] price upper '
                   '[SEP] instuction text [SEP] category [SEP] product category [SEP] query [SEP] Goal [SEP] None '
                   '[SEP] Reward [SEP] Your score (min 0.0, max 1.0) [SEP] 1.0 [SEP] Reward Details [SEP] None')
    assert (r, term, trunc) == (1.0, True, False)
    assert info["score"] == 1.0 and info["success"] and info["won"] and info["admissible_actions"] == []
    assert info["reward_info"]["n_opt_matched"] == 2 and info["reward_info"]["purchased_asin"] == "B000000000"
    with pytest.raises(RuntimeError):
        act(env, "click[back to search]")


def test_back_navigation_resets_options_and_session(env):
    env.reset({"goal_idx": _idx(env, "B000000000")})
    act(env, "search[widget]")
    act(env, "click[b000000000]")
    act(env, "click[black]")
    act(env, "click[large]")
    act(env, "click[< prev]")  # item -> results: options are dropped when an item is opened again
    act(env, "click[b000000000]")
    obs, *_, info = act(env, "click[back to search]")
    assert obs == f"WebShop [SEP] Instruction: [SEP] {INSTR} [SEP] Search"
    act(env, "search[widget]")
    act(env, "click[next >]")
    act(env, "click[b000000010]")
    assert act(env, "click[< prev]")[0].startswith(f"{HEAD} [SEP] Page 2 (Total results: 12)")
    obs, *_ = act(env, "click[b000000000]")  # not on this page: no-op
    assert "Page 2" in obs
    act(env, "click[b000000011]")
    # search works on any page (original behaviour), resetting to page 1
    obs, *_, info = act(env, "search[widget]")
    assert obs.startswith(f"{HEAD} [SEP] Page 1 (Total results: 12)") and info["valid_action"]
    act(env, "click[b000000000]")
    # bought without options: 1 attr + 0 options + price 1 = 2/4
    _, r, term, _, info = act(env, "click[buy now]")
    assert r == 0.5 and term and not info["success"] and info["reward_info"]["r_option"] == 0.0


def test_partial_purchase_of_other_product(env):
    env.reset({"goal_idx": _idx(env, "B000000000")})
    act(env, "search[widget]")
    act(env, "click[b000000002]")
    act(env, "click[black]")
    act(env, "click[large]")
    # no attributes in the ins file (DUMMY_ATTR) but "handy" is in the description: 1 + 2 + price 19.99 -> 4/4
    _, r, _, _, info = act(env, "click[buy now]")
    assert r == 1.0 and info["reward_info"]["purchased_asin"] == "B000000002"


def test_invalid_actions_are_noops(env):
    obs0, _ = env.reset({"goal_idx": _idx(env, "B000000000")})
    for action in ["click[search]", "click[buy now]", "buy it", "search[]", "Search[widget]", "click[< prev]"]:
        obs, r, term, trunc, info = act(env, action)
        assert (obs, r, term, trunc, info["valid_action"]) == (obs0, 0.0, False, False, False), action
        assert info["format_ok"] and info["action"] == action


def test_wrapper_format_penalty_first_tag_and_step_cap(tmp_path, env):
    obs0, _ = env.reset({"goal_idx": 0})
    obs, r, term, trunc, info = env.step("I think I should search for widgets")
    assert (obs, r, term, trunc) == (obs0, -0.1, False, False)
    assert not info["valid_action"] and not info["format_ok"] and info["action"] == "" and info["step"] == 1
    assert env.step("<action>  </action>")[1] == -0.1  # empty action: also a format error
    # Several tags: the first runs (the rule ScienceWorld uses too), and it is a format error.
    obs, r, _, _, info = env.step("<action>search[widget]</action> no wait <action>click[x]</action>")
    assert "Page 1" in obs and r == -0.1 and info["action"] == "search[widget]" and info["valid_action"]
    assert not info["format_ok"]
    obs, r, _, _, info = env.step("<action>click[b000000001]")  # unclosed (cut at the token limit): runs
    assert info["valid_action"] and not info["format_ok"] and r == -0.1 and "Widget Bravo" in obs
    assert env.step("<action>click[< prev]</action>")[4]["format_ok"]

    capped = WebShopEnv(tmp_path / "cache", env.data.source_dir, max_steps=3, format_penalty=0.5)
    capped.reset({"goal_idx": 0})
    assert capped.step("nothing")[1:4] == (-0.5, False, False)
    assert capped.step("<action>click[nope]</action>")[1:4] == (0.0, False, False)
    obs, r, term, trunc, info = capped.step("<action>click[nope]</action>")
    assert (r, term, trunc, info["score"]) == (0.0, False, True, 0.0)
    with pytest.raises(RuntimeError):
        capped.step("<action>search[x]</action>")


def test_observation_without_the_instruction(tmp_path, env):
    """observation_instruction=False drops exactly the instruction nodes every page repeats; the rest of each page,
    the admissible actions and the rewards are the original's."""
    short = WebShopEnv(tmp_path / "cache", env.data.source_dir, num_test_goals=1, max_steps=40,
                       observation_instruction=False)
    goal = {"goal_idx": _idx(env, "B000000000")}
    for e in (env, short):
        e.reset(goal)
    obs, info = short.reset(goal)
    assert obs == "WebShop [SEP] Search" and info["instruction"] == INSTR
    for action in ("search[widget]", "click[b000000000]", "click[description]", "click[< prev]", "click[black]"):
        full, short_step = act(env, action), act(short, action)
        assert full[0] == f"Instruction: [SEP] {INSTR} [SEP] " + short_step[0]
        assert INSTR not in short_step[0] and short_step[0].startswith("Back to Search [SEP] ")
        assert full[1:4] == short_step[1:4] and full[4]["admissible_actions"] == short_step[4]["admissible_actions"]
    full, short_step = act(env, "click[buy now]"), act(short, "click[buy now]")
    assert full[:4] == short_step[:4] and short_step[2]


def test_wrapper_success_reward_mode_and_tasks(tmp_path, env):
    env_s = WebShopEnv(tmp_path / "cache", env.data.source_dir, reward_mode="success", num_test_goals=1)
    assert env_s.tasks("test") == [{"task_name": "webshop", "goal_idx": 0, "split": "test", "variation": 0}]
    assert env_s.tasks("train") == [{"task_name": "webshop", "goal_idx": 1, "split": "train", "variation": 1}]
    for asin, opts, expected in (("B000000000", ["black", "large"], 10.0), ("B000000000", [], 0.0)):
        obs, info = env_s.reset({"goal_idx": _idx(env_s, "B000000000")})
        assert info["task_id"] == f"webshop-{_idx(env_s, 'B000000000')}" and info["max_score"] == 1.0
        assert info["variation"] == _idx(env_s, "B000000000") and info["score"] == 0.0
        act(env_s, "search[widget]")
        act(env_s, f"click[{asin.lower()}]")
        for o in opts:
            act(env_s, f"click[{o}]")
        _, r, term, _, info = act(env_s, "click[buy now]")
        assert (r, term) == (expected, True) and info["score"] == (1.0 if expected else 0.5)
    with pytest.raises(ValueError, match="goal_idx"):
        env_s.reset({"goal_idx": 2})
    with pytest.raises(ValueError, match="goal_idx"):
        env_s.reset({"goal_idx": "0"})
    with pytest.raises(ValueError, match="not in the 'test' split"):
        env_s.reset({"goal_idx": 1, "split": "test"})
    with pytest.raises(ValueError, match="reward_mode"):
        WebShopEnv(tmp_path / "cache", env.data.source_dir, reward_mode="points")
    assert "<action>" in env_s.system_prompt and "search[" in env_s.system_prompt


def test_env_var_selects_real_data(tmp_path, env, monkeypatch):
    monkeypatch.setenv("WEBSHOP_DATA_DIR", env.data.source_dir)
    e = WebShopEnv(tmp_path / "other")
    assert e.uses_real_data and len(e.data.products) == 12


def test_generated_catalog_baselines(tmp_path):
    env = WebShopEnv(tmp_path / "webshop")  # generated catalog (1000 products)
    assert not env.uses_real_data and len(env.data.products) == 1000
    assert len(env.tasks("test")) == 500 and len(env.tasks("train")) >= 1000
    tasks = env.tasks("test")[:100]
    expert = run_policy(env, ExpertPolicy(env), tasks)
    rand = run_policy(env, RandomPolicy(seed=0), tasks)
    assert expert["success_rate"] >= 0.9
    assert rand["success_rate"] < 0.3 and rand["mean_score"] < expert["mean_score"] - 0.3
    obs, info = env.reset(tasks[0])
    obs, *_ = env.step("<action>search[black]</action>")
    assert "(Total results: 50)" in obs  # top-50 cap
