"""Known-answer tests of the original WebShop reward (WEBSHOP.md "Reward"); expected values worked out by hand."""
from __future__ import annotations

import copy

import pytest

from src.envs.webshop.reward import get_reward, noun_extractor_name, normalize_color, title_nouns, type_reward

FALLBACK = noun_extractor_name() == "fallback"
needs_fallback = pytest.mark.skipif(not FALLBACK, reason="expected values assume the fallback noun extractor")

SHOES = {
    "asin": "B000SHOE01",
    "name": "Solvera Women's Lightweight Running Shoes",
    "Title": "Solvera Women's Lightweight Running Shoes",
    "BulletPoints": ["RUBBER SOLE - grips wet pavement"],
    "Description": "Comfortable shoes for daily runs.",
    "Attributes": ["lightweight", "easy clean"],
    "query": "women's running shoes",
    "product_category": "Clothing, Shoes & Jewelry › Women › Shoes › Running",
}
GOAL = {
    "asin": "B000SHOE01",
    "name": SHOES["name"],
    "query": "women's running shoes",
    "product_category": SHOES["product_category"],
    "attributes": ["lightweight", "rubber sole"],
    "goal_options": ["navy", "8"],
    "price_upper": 50.0,
}


def goal(**changes):
    g = copy.deepcopy(GOAL)
    g.update(changes)
    return g


def test_exact_match_scores_one():
    # attrs: "lightweight" fuzzy 100 with the attribute, "rubber sole" substring of the bullet -> 2/2;
    # options navy/8 -> 2/2; price 40 <= 50 -> 1; (2 + 2 + 1) / 5 * r_type 1 = 1.0
    r, info = get_reward(SHOES, GOAL, 40.0, {"color": "navy", "size": "8"})
    assert r == 1.0
    assert info["n_attr_matched"] == 2 and info["n_opt_matched"] == 2 and info["r_price"] is True
    assert info["r_type"] == 1.0 and info["query_match"] and info["category_match"]
    assert info["title_score"] == 1.0
    assert info["w_att"] == pytest.approx(2 / 5) and info["w_option"] == pytest.approx(2 / 5)
    assert info["w_price"] == pytest.approx(1 / 5)
    assert info["noun_extractor"] in ("spacy", "fallback")


def test_fuzzy_attribute_synonym():
    # "easy to clean" vs product attribute "easy clean": token sets {easy, to, clean} ⊇ {easy, clean} -> 100 > 85.
    # "water resistant" is neither an attribute nor in any text -> no match. (1 + 2 + 1) / 5 = 0.8
    r, info = get_reward(SHOES, goal(attributes=["easy to clean", "water resistant"]), 40.0,
                         {"color": "navy", "size": "8"})
    assert info["n_attr_matched"] == 1
    assert r == pytest.approx(0.8)


def test_colour_normalisation():
    # The first colour of the list contained in the string wins: "navy blue" -> "blue" (blue precedes navy),
    # "navy" -> "navy"; "blue" vs "navy" share no letters -> ratio 0, so the colour does not match.
    assert normalize_color("navy blue") == "blue"
    assert normalize_color("navy") == "navy"
    assert normalize_color("dark blue") == "blue"
    assert normalize_color("32w x 30l") == "32w x 30l"
    r, info = get_reward(SHOES, GOAL, 40.0, {"color": "navy blue", "size": "8"})
    assert info["n_opt_matched"] == 1
    assert r == pytest.approx((2 + 1 + 1) / 5)
    # A goal written "Navy Blue" is not normalised (the colour test is case-sensitive); thefuzz lower-cases it and
    # {blue} ⊆ {navy, blue} -> 100: match. Two blues with different shade words both normalise to "blue": match.
    assert get_reward(SHOES, goal(goal_options=["Navy Blue", "8"]), 40.0, {"color": "navy blue", "size": "8"})[0] == 1.0
    assert get_reward(SHOES, goal(goal_options=["dark blue", "8"]), 40.0, {"color": "navy blue", "size": "8"})[0] == 1.0


def test_missing_option():
    # Only the size was clicked: options 1/2 -> (2 + 1 + 1) / 5 = 0.8; nothing clicked -> (2 + 0 + 1) / 5 = 0.6
    assert get_reward(SHOES, GOAL, 40.0, {"size": "8"})[0] == pytest.approx(0.8)
    r, info = get_reward(SHOES, GOAL, 40.0, {})
    assert r == pytest.approx(0.6) and info["r_option"] == 0.0


def test_price_cap_boundary():
    # price <= cap passes (50.00 exactly); 50.01 fails: (2 + 2 + 0) / 5 = 0.8
    assert get_reward(SHOES, GOAL, 50.0, {"color": "navy", "size": "8"})[0] == 1.0
    r, info = get_reward(SHOES, GOAL, 50.01, {"color": "navy", "size": "8"})
    assert r == pytest.approx(0.8) and info["r_price"] is False


def test_empty_goal_options():
    # denominator |A| + 0 + 1 = 3; r_option is None (no options asked)
    r, info = get_reward(SHOES, goal(goal_options=[]), 40.0, {"color": "red"})
    assert r == 1.0 and info["r_option"] is None and info["w_option"] == 0.0
    r, _ = get_reward(SHOES, goal(goal_options=[], attributes=["lightweight", "waterproof"]), 40.0, {})
    assert r == pytest.approx(2 / 3)


def test_synthetic_goal_option_tuples():
    # Synthetic goals pass dict.items(): ("color", "black") normalises to "black" (tuple element equality);
    # ("size", "large") stays a tuple, which thefuzz stringifies to "size large" ⊇ {large} -> 100.
    g = goal(goal_options={"color": "black", "size": "large"})
    r, info = get_reward(SHOES, g, 40.0, {"color": "black", "size": "large"})
    assert info["n_opt_matched"] == 2 and r == 1.0
    r, info = get_reward(SHOES, g, 40.0, {"color": "white", "size": "large"})
    assert info["n_opt_matched"] == 1 and r == pytest.approx(0.8)


@needs_fallback
def test_wrong_product_type():
    speaker = dict(SHOES, asin="B000SPKR01", name="Nexwave Bluetooth Speaker", Title="Nexwave Bluetooth Speaker",
                   query="bluetooth speaker", product_category="Electronics › Portable Audio › Speakers",
                   Attributes=["lightweight"], BulletPoints=["Loud sound"], Description="A speaker.")
    # goal nouns (fallback): solvera, women, lightweight, running, shoes (5); speaker shares none -> title_score 0
    assert title_nouns(GOAL["name"]) == ("solvera", "women", "lightweight", "running", "shoes")
    r, info = get_reward(speaker, GOAL, 40.0, {})
    assert info["title_score"] == 0.0 and info["r_type"] == 0.0 and r == 0.0
    # one shared noun: title_score 1/5 = 0.2, not > 0.2, no query/category match -> r_type 0.5;
    # attrs 1 (lightweight) + options 0 + price 1 -> 2 / 5 * 0.5 = 0.2
    runner = dict(speaker, name="Nexwave Running Speaker")
    r, info = get_reward(runner, GOAL, 40.0, {})
    assert info["title_score"] == pytest.approx(0.2) and info["r_type"] == 0.5
    assert not info["query_match"] and not info["category_match"]
    assert r == pytest.approx(0.2)


@needs_fallback
def test_type_reward_thresholds():
    long_name = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima"  # 12 nouns
    g = {"query": "q", "product_category": "A › B", "name": long_name}
    base = {"query": "other", "product_category": "C › D"}
    # 1/12 < 0.1 -> 0.1
    assert type_reward(dict(base, name="lima widget"), g)["r_type"] == 0.1
    # 2/12 in [0.1, 0.2] -> 0.5
    assert type_reward(dict(base, name="lima kilo"), g)["r_type"] == 0.5
    # 3/12 = 0.25 > 0.2 -> 1.0
    assert type_reward(dict(base, name="lima kilo juliet"), g)["r_type"] == 1.0
    # a query match keeps 1.0 even at 2/12; 0 shared nouns is 0 whatever matches
    assert type_reward(dict(base, query="q", name="lima kilo"), g)["r_type"] == 1.0
    assert type_reward(dict(base, query="q", name="zulu"), g)["r_type"] == 0.0
    # >= 2 shared category levels counts as a match
    assert type_reward({"query": "x", "product_category": "A › B › E", "name": "lima kilo"}, g)["category_match"]
    # goal name without nouns -> title_score 0.2 (original default)
    assert type_reward(dict(base, name="anything"), dict(g, name="the new and the best"))["title_score"] == 0.2
