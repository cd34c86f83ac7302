"""WebShop data: the original-format loader (round trip, errors), goals, prices, split, generated catalog, search."""
from __future__ import annotations

import itertools
import json
import os
import random

import pytest
from thefuzz import fuzz

from src.envs.webshop.catalog import FILE_NAMES, ensure_generated_catalog, generate_catalog
from src.envs.webshop.data import (WebShopDataError, find_data_files, load_webshop_data, parse_pricing,
                                   split_goal_indices)
from src.envs.webshop.reward import get_reward, option_matches
from src.envs.webshop.search import SearchEngine
from src.envs.webshop.vocab import CATEGORIES


def raw_product(asin, name="Widget", pricing="$5.00", options=None, **extra):
    p = {"asin": asin, "name": name, "full_description": f"{name} description.", "small_description": ["bullet"],
         "pricing": pricing, "customization_options": options, "images": ["img.jpg"], "category": "home",
         "query": " Widgets ", "product_category": "Home › Widgets › Small", "average_rating": 4.5,
         "brand": "dropped", "list_price": "dropped"}
    p.update(extra)
    return p


def write_files(d, products, ins, human, suffix="_1000"):
    d.mkdir(parents=True, exist_ok=True)
    for name, obj in ((f"items_shuffle{suffix}.json", products), (f"items_ins_v2{suffix}.json", ins),
                      ("items_human_ins.json", human)):
        (d / name).write_text(json.dumps(obj))
    return d


PRODUCTS = [
    raw_product("B000000001", "Red Widget", "$975.00",
                {"Color": [{"value": "Black/White ", "image": None, "asin": "x", "is_selected": True},
                           {"value": "Navy", "asin": "y"}], "Size": None}),
    raw_product("nan"),
    raw_product("B0000000022"),  # 11 characters: skipped
    raw_product("B000000002", "Blue Widget", "$19.99$27.99$30.00", small_description="one bullet"),
    raw_product("B000000001", "Duplicate"),  # duplicate asin: skipped
    raw_product("B000000003", "Big Widget", "$1,299.00"),
    raw_product("B000000004", "Free Widget", ""),
]
INS = {"B000000001": {"attributes": ["red", "small"], "instruction": "i want a red widget",
                      "instruction_attributes": ["red"]},
       "B000000002": {"attributes": ["blue"]}}
HUMAN = {"B000000001": [{"instruction": "I need a red widget.", "instruction_attributes": ["red"],
                         "instruction_options": ["black"]},
                        {"instruction": "skipped", "instruction_attributes": [], "instruction_options": []}],
         "B000000002": [{"instruction": "blue one", "instruction_attributes": ["blue"], "instruction_options": []}],
         "B000000004": [{"instruction": "free one", "instruction_attributes": ["free"], "instruction_options": []}]}


def test_loader_round_trip(tmp_path):
    d = write_files(tmp_path / "ws", PRODUCTS, INS, HUMAN)
    data = load_webshop_data(d, price_seed=7)
    assert [p["asin"] for p in data.products] == ["B000000001", "B000000002", "B000000003", "B000000004"]
    p1, p2, p3, p4 = data.products
    assert p1["Title"] == p1["name"] == "Red Widget" and p1["Description"] == "Red Widget description."
    assert p1["options"] == {"color": ["black | white", "navy"]}  # strip, '/' -> ' | ', lower; None option dropped
    assert p1["Attributes"] == ["red", "small"] and p2["Attributes"] == ["blue"] and p3["Attributes"] == ["DUMMY_ATTR"]
    assert p1["query"] == "widgets" and p1["Rating"] == "N.A." and p1["Reviews"] == [] and p1["MainImage"] == "img.jpg"
    assert p2["BulletPoints"] == ["one bullet"]
    assert (p1["pricing"], p1["Price"]) == ([975.0], "$975.0")
    assert (p2["pricing"], p2["Price"]) == ([19.99, 27.99], "$19.99 to $27.99")
    assert (p3["pricing"], p3["Price"]) == ([1299.0], "$1299.0")
    assert (p4["pricing"], p4["Price"]) == ([100.0], "$100.0")
    # Range price: the first draw of Random(7) (products are drawn in file order; only p2 has a range).
    assert data.prices == {"B000000001": 975.0, "B000000002": random.Random(7).uniform(19.99, 27.99),
                           "B000000003": 1299.0, "B000000004": 100.0}
    # Human goals: 3 (the one with empty attributes is skipped). Price 975 -> caps [980, 990] -> upper 990 always.
    goals = {g["asin"]: g for g in data.goals}
    assert len(data.goals) == 3
    g1 = goals["B000000001"]
    assert g1["instruction_text"] == "I need a red widget, and price lower than 990.00 dollars"
    assert g1["price_upper"] == 990.0 and g1["goal_options"] == ["black"] and g1["attributes"] == ["red"]
    assert g1["query"] == "widgets" and g1["name"] == "Red Widget" and g1["weight"] == 1
    # Price 100.0 -> first 4 caps above: 110..140, the larger of two sampled -> 120..140
    assert goals["B000000004"]["price_upper"] in (120.0, 130.0, 140.0)
    assert goals["B000000004"]["instruction_text"] == (
        f"free one, and price lower than {goals['B000000004']['price_upper']:.2f} dollars")


def test_goal_order_is_the_original_seed_233_shuffle(tmp_path):
    products = [raw_product(f"B{i:09d}", f"Widget {i}") for i in range(30)]
    human = {p["asin"]: [{"instruction": f"goal {p['asin']} {k}", "instruction_attributes": ["a"],
                          "instruction_options": []} for k in range(2)] for p in products}
    d = write_files(tmp_path / "ws", products, {}, human)
    data = load_webshop_data(d)
    # Goals are built in file order (product, then instruction), then random.seed(233); random.shuffle(goals).
    expected = [f"goal B{i:09d} {k}" for i in range(30) for k in range(2)]
    random.Random(233).shuffle(expected)
    assert [g["instruction_text"].split(",")[0] for g in data.goals] == expected
    again = load_webshop_data(d)
    assert again.goals == data.goals and again.prices == data.prices


def test_synthetic_goals(tmp_path):
    products = [raw_product("B000000001", "Red Widget", "$975.00",
                            {"Color": [{"value": "Red"}, {"value": "Blue"}], "Size": [{"value": "L"}]}),
                raw_product("B000000002", "Other", "$975.00")]
    ins = {"B000000001": {"attributes": ["x"], "instruction": "i want a widget", "instruction_attributes": ["x", "y"]},
           "B000000002": {"attributes": ["x"], "instruction": "i want another", "instruction_attributes": ["x"]}}
    d = write_files(tmp_path / "ws", products, ins, {})
    data = load_webshop_data(d, human_goals=False)
    texts = sorted(g["instruction_text"] for g in data.goals)
    assert texts == ["i want a widget with color: blue, and size: l, and price lower than 990.00 dollars",
                     "i want a widget with color: red, and size: l, and price lower than 990.00 dollars",
                     "i want another, and price lower than 990.00 dollars"]
    w = {g["instruction_text"][:16]: g["weight"] for g in data.goals}
    # "x" is used by 3 goals, "y" by 2: product 1 goals -> (1/3 + 1/2) / 2 = 5/12; product 2 -> 1/3
    assert w["i want a widget "] == pytest.approx(5 / 12)
    assert w["i want another, "] == pytest.approx(1 / 3)
    assert {tuple(sorted(g["goal_options"].items())) for g in data.goals if g["asin"] == "B000000001"} == {
        (("color", "red"), ("size", "l")), (("color", "blue"), ("size", "l"))}


def test_num_products_and_full_size_names(tmp_path):
    d = write_files(tmp_path / "ws", PRODUCTS, INS, HUMAN, suffix="")
    assert find_data_files(d)["products"].name == "items_shuffle.json"
    data = load_webshop_data(d, num_products=1)
    assert [p["asin"] for p in data.products] == ["B000000001"] and len(data.goals) == 1


@pytest.mark.parametrize("mutate, message", [
    (lambda d: (d / "items_shuffle_1000.json").unlink(), "no items_shuffle_1000.json or items_shuffle.json"),
    (lambda d: (d / "items_ins_v2_1000.json").unlink(), "missing items_ins_v2_1000.json"),
    (lambda d: (d / "items_human_ins.json").unlink(), "missing items_human_ins.json"),
    (lambda d: (d / "items_shuffle_1000.json").write_text("[{"), "items_shuffle_1000.json: not valid JSON"),
    (lambda d: (d / "items_ins_v2_1000.json").write_text("[]"), "items_ins_v2_1000.json: expected a JSON dict"),
    (lambda d: (d / "items_shuffle_1000.json").write_text(json.dumps(
        [raw_product("B000000001"), {k: v for k, v in raw_product("B000000002").items() if k != "name"}])),
     "items_shuffle_1000.json: product 1 (asin B000000002) has no 'name'"),
    (lambda d: (d / "items_shuffle_1000.json").write_text(json.dumps([raw_product("B000000001", pricing="$abc")])),
     "items_shuffle_1000.json: product 0 (asin B000000001): cannot parse 'pricing' '$abc'"),
    (lambda d: (d / "items_shuffle_1000.json").write_text(json.dumps(
        [raw_product("B000000001", options={"Color": [{"image": "x"}]})])),
     "customization_options['Color'][0] has no string 'value'"),
    (lambda d: (d / "items_human_ins.json").write_text(json.dumps(
        {"B000000001": [{"instruction": "x", "instruction_attributes": ["a"]}]})),
     "items_human_ins.json: asin B000000001 instruction 0 has no 'instruction_options'"),
])
def test_malformed_files_raise_clear_errors(tmp_path, mutate, message):
    d = write_files(tmp_path / "ws", PRODUCTS, INS, HUMAN)
    mutate(d)
    with pytest.raises(WebShopDataError) as e:
        load_webshop_data(d)
    assert message in str(e.value)


def test_missing_dir_and_bad_pricing():
    with pytest.raises(WebShopDataError, match="does not exist"):
        find_data_files("/nonexistent/webshop")
    with pytest.raises(WebShopDataError, match="must be a string"):
        parse_pricing(19.99, "f: product 0")
    assert parse_pricing(None, "f") == ([100.0], "$100.0")


def test_split_indices():
    assert split_goal_indices(1600, "test") == range(0, 500)
    assert split_goal_indices(1600, "train") == range(500, 1600)
    assert split_goal_indices(1600, "dev") == range(500, 500)
    assert split_goal_indices(1600, "dev", num_dev=100) == range(500, 600)
    assert split_goal_indices(1600, "train", num_dev=100) == range(600, 1600)
    with pytest.raises(ValueError, match="no train goals"):
        split_goal_indices(400, "train")
    with pytest.raises(ValueError, match="unknown WebShop split 'val'"):
        split_goal_indices(1600, "val")


# ------------------------------------------------------------------------------------------ generated catalog
def test_generated_catalog_is_deterministic_and_seeded():
    a = generate_catalog(150, seed=3)
    b = generate_catalog(150, seed=3)
    assert json.dumps(a) == json.dumps(b)
    c = generate_catalog(150, seed=4)
    assert json.dumps(a) != json.dumps(c)
    products, ins, human = a
    assert len(products) == 150 and len({p["asin"] for p in products}) == 150
    assert all(len(p["asin"]) == 10 for p in products) and set(ins) == {p["asin"] for p in products}
    assert sum(len(v) for v in human.values()) > 150
    types = {t["query"]: t for cat in CATEGORIES.values() for t in cat["types"]}
    for p in products:
        attrs = ins[p["asin"]]["attributes"]
        assert not any(x in attrs and y in attrs for x, y in types[p["query"]].get("exclusive", [])), attrs


def test_generated_catalog_files_load_and_are_reused(tmp_path):
    d = ensure_generated_catalog(tmp_path, 200, seed=1)
    assert sorted(os.listdir(d)) == sorted(FILE_NAMES)
    mtimes = [os.stat(d / n).st_mtime_ns for n in FILE_NAMES]
    assert ensure_generated_catalog(tmp_path, 200, seed=1) == d
    assert [os.stat(d / n).st_mtime_ns for n in FILE_NAMES] == mtimes
    one, two = load_webshop_data(d), load_webshop_data(d)
    assert one.goals == two.goals and one.prices == two.prices  # prices and caps seeded
    assert len(one.products) == 200 and len(one.goals) > 250
    assert load_webshop_data(d, price_seed=1).prices != one.prices  # range prices depend on the seed


def test_generated_goals_have_a_perfect_target_and_partial_distractors(tmp_path):
    data = load_webshop_data(ensure_generated_catalog(tmp_path, 300, seed=0))
    n_partial = 0
    for g in data.goals[:60]:
        target = data.product_by_asin[g["asin"]]
        chosen = {}
        for want in g["goal_options"]:
            name = next(n for n, vals in target["options"].items() if want in vals)
            chosen[name] = want
        assert get_reward(target, g, data.prices[g["asin"]], chosen)[0] == 1.0, g["instruction_text"]
        rewards = []
        for p in data.products:
            if p["query"] != g["query"] or p["asin"] == g["asin"]:
                continue
            best = {n: next((v for v in vals if any(option_matches(v, w) for w in g["goal_options"])), vals[0])
                    for n, vals in p["options"].items()}
            rewards.append(get_reward(p, g, data.prices[p["asin"]], best)[0])
        n_partial += any(0 < r < 1 for r in rewards)
    assert n_partial == 60  # every goal has a same-type product that scores partially


def test_vocab_is_consistent():
    for cat in CATEGORIES.values():
        for t in cat["types"]:
            for phrase, sentence in t["attrs"].items():
                assert phrase in sentence.lower(), (t["query"], phrase)
            for a, b in itertools.combinations(t["attrs"], 2):
                assert fuzz.token_set_ratio(a, b) <= 85, (t["query"], a, b)


# ------------------------------------------------------------------------------------------------ search
def _norm_products(names):
    return [{"asin": f"B{i:09d}", "Title": n, "Description": "", "BulletPoints": [], "options": {}}
            for i, n in enumerate(names)]


def test_search_ranking_ties_single_chars_and_cache(tmp_path):
    products = _norm_products(["red widget", "blue widget", "red red widget", "size x tee", "gadget"])
    eng = SearchEngine(products, tmp_path, stemmer="none")
    # "red red widget" has tf(red)=2 -> first; the two single-"red" docs tie on length -> catalog order
    assert eng.search("red") == ["B000000002", "B000000000"]
    assert eng.search("widget") == ["B000000000", "B000000001", "B000000002"]
    assert eng.search("x") == ["B000000003"]  # single-character tokens are indexed
    assert eng.search("the of") == [] and eng.search("zzz") == []
    assert eng.search("widget", k=2) == ["B000000000", "B000000001"]
    # Second engine on the same catalog loads the cached index directory instead of rebuilding it.
    built = os.stat(eng.index_dir / "asins.json").st_mtime_ns
    again = SearchEngine(products, tmp_path, stemmer="none")
    assert again.index_dir == eng.index_dir and os.stat(again.index_dir / "asins.json").st_mtime_ns == built
    assert len([p for p in os.listdir(tmp_path) if p.startswith("bm25-")]) == 1


def test_search_porter_stemming(tmp_path):
    pytest.importorskip("Stemmer")
    eng = SearchEngine(_norm_products(["summer dresses", "running shoe", "s"]), tmp_path, stemmer="porter")
    assert eng.stemmer == "porter"
    assert eng.search("dress") == ["B000000000"] and eng.search("runs shoes") == ["B000000001"]
    assert eng.search("s") == ["B000000002"]  # words of <= 2 characters are not stemmed (Lucene's Porter)
