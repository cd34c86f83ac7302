"""Loading the original WebShop data files (the original's ``engine.load_products``, ``goal.get_goals`` and the
goal shuffle ``random.seed(233); random.shuffle``): ``items_shuffle_1000.json`` / ``items_shuffle.json`` (raw
products), ``items_ins_v2_1000.json`` / ``items_ins_v2.json`` (asin -> attributes, instruction) and, for human goals,
``items_human_ins.json`` (asin -> instructions). One change: the original draws prices and price caps from the
*unseeded* global RNG; here they come from ``random.Random(price_seed)`` in its call order, so every worker and run
sees the same goals.
"""
from __future__ import annotations

import itertools
import json
import os
import random
import re
from collections import defaultdict
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

PRICE_RANGE = [10.0 * i for i in range(1, 100)]  # candidate price caps, dollars (original goal.py)
SPLIT_SEED = 233  # the original shuffles the goal list with random.seed(233)
NO_PRICE_CAP = 1_000_000  # original's cap when fewer than 2 PRICE_RANGE values exceed the price
REQUIRED_PRODUCT_FIELDS = ("asin", "name", "full_description", "small_description", "customization_options",
                           "images", "category", "query", "product_category")


class WebShopDataError(ValueError):
    """A missing or malformed WebShop data file; the message names the file and the field at fault."""


@dataclass
class WebShopData:
    """Loaded catalog and goals: ``products`` normalised (``normalize_product``) in file order, ``prices`` asin ->
    the reward's price (dollars), ``goals`` shuffled (index i is task ``goal_idx`` i)."""
    products: list[dict]
    product_by_asin: dict[str, dict]
    prices: dict[str, float]
    goals: list[dict]
    source_dir: str


def find_data_files(data_dir: str | os.PathLike, human_goals: bool = True) -> dict[str, Path]:
    """{"products", "attributes", "human" (only with ``human_goals``)}: the files in ``data_dir``, the 1000-product
    ones (the original's small setting) when present. Raises WebShopDataError naming the missing file(s)."""
    d = Path(data_dir)
    if not d.is_dir():
        raise WebShopDataError(f"WebShop data dir {str(d)!r} does not exist (expected a directory with "
                               f"items_shuffle_1000.json / items_ins_v2_1000.json / items_human_ins.json)")
    for suffix in ("_1000", ""):
        products = d / f"items_shuffle{suffix}.json"
        if products.is_file():
            attributes = d / f"items_ins_v2{suffix}.json"
            break
    else:
        raise WebShopDataError(f"{d}: no items_shuffle_1000.json or items_shuffle.json")
    files = {"products": products, "attributes": attributes}
    if human_goals:
        files["human"] = d / "items_human_ins.json"
    for key, path in files.items():
        if not path.is_file():
            raise WebShopDataError(f"{d}: missing {path.name} (needed next to {products.name})")
    return files


def _read_json(path: Path, expected: type) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise WebShopDataError(f"{path.name}: not valid JSON ({e})") from e
    if not isinstance(data, expected):
        raise WebShopDataError(f"{path.name}: expected a JSON {expected.__name__} at top level, "
                               f"got {type(data).__name__}")
    return data


def parse_pricing(pricing: str | None, where: str) -> tuple[list[float], str]:
    """The original's price parsing: ``"$19.99$27.99"`` -> ([19.99, 27.99], "$19.99 to $27.99"); each '$' part
    without its non-digit/non-dot characters ("$1,299.00" -> 1299.0), the first two; none -> ([100.0], "$100.0").
    Raises WebShopDataError for an unparsable part."""
    if not pricing:
        return [100.0], "$100.0"
    if not isinstance(pricing, str):
        raise WebShopDataError(f"{where}: 'pricing' must be a string like '$19.99', got {pricing!r}")
    try:
        values = [float(Decimal(re.sub(r'[^\d.]', '', p))) for p in pricing.split('$')[1:]]
    except InvalidOperation as e:
        raise WebShopDataError(f"{where}: cannot parse 'pricing' {pricing!r}") from e
    if not values:
        raise WebShopDataError(f"{where}: cannot parse 'pricing' {pricing!r} (no '$' amount)")
    if len(values) == 1:
        return values, f"${values[0]}"
    values = values[:2]
    return values, f"${values[0]} to ${values[1]}"


def normalize_product(p: dict, idx: int, file_name: str, ins: dict, human_ins: dict | None,
                      human_goals: bool) -> dict:
    """One raw product -> the original's normalised product dict. Raises WebShopDataError."""
    where = f"{file_name}: product {idx} (asin {p.get('asin', '?')})"
    for field in REQUIRED_PRODUCT_FIELDS:
        if field not in p:
            raise WebShopDataError(f"{where} has no {field!r}")
    for field in ("name", "full_description", "category", "query", "product_category"):
        if not isinstance(p[field], str):
            raise WebShopDataError(f"{where}: {field!r} must be a string, got {type(p[field]).__name__}")
    small = p["small_description"]
    bullets = small if isinstance(small, list) else [small]
    if not all(isinstance(b, str) for b in bullets):
        raise WebShopDataError(f"{where}: 'small_description' must be a string or a list of strings")
    pricing, price_tag = parse_pricing(p.get("pricing"), where)
    options: dict[str, list[str]] = {}
    custom = p["customization_options"]
    if custom:
        if not isinstance(custom, dict):
            raise WebShopDataError(f"{where}: 'customization_options' must be an object or null")
        for name, contents in custom.items():
            if contents is None:
                continue
            values = []
            for j, c in enumerate(contents):
                if not isinstance(c, dict) or not isinstance(c.get("value"), str):
                    raise WebShopDataError(f"{where}: customization_options[{name!r}][{j}] has no string 'value'")
                values.append(c["value"].strip().replace('/', ' | ').lower())
            options[name.lower()] = values
    images = p["images"]
    if not isinstance(images, list):
        raise WebShopDataError(f"{where}: 'images' must be a list")
    asin = p["asin"]
    entry = ins.get(asin, {})
    product = {
        "asin": asin,
        "name": p["name"],
        "Title": p["name"],
        "Description": p["full_description"],
        "BulletPoints": bullets,
        "Reviews": [],
        "Rating": "N.A.",
        "pricing": pricing,
        "Price": price_tag,
        "options": options,
        "Attributes": entry["attributes"] if "attributes" in entry else ["DUMMY_ATTR"],
        "MainImage": images[0] if images else None,
        "category": p["category"],
        "query": p["query"].lower().strip(),
        "product_category": p["product_category"],
    }
    if human_goals:
        if human_ins is not None and asin in human_ins:
            product["instructions"] = human_ins[asin]
    else:
        product["instruction_text"] = entry.get("instruction")
        product["instruction_attributes"] = entry.get("instruction_attributes")
    return product


def load_products(files: dict[str, Path], num_products: int | None = None,
                  human_goals: bool = True) -> list[dict]:
    """Read and normalise products like the original ``load_products``: the first ``num_products`` raw entries (None
    = all), without asin 'nan', asins over 10 characters and duplicates. Raises WebShopDataError for a bad file."""
    raw = _read_json(files["products"], list)
    ins = _read_json(files["attributes"], dict)
    human = _read_json(files["human"], dict) if human_goals else None
    if num_products is not None:
        raw = raw[:num_products]
    seen: set[str] = set()
    products = []
    for i, p in enumerate(raw):
        if not isinstance(p, dict):
            raise WebShopDataError(f"{files['products'].name}: product {i} is not an object")
        asin = p.get("asin")
        if not isinstance(asin, str):
            raise WebShopDataError(f"{files['products'].name}: product {i} has no string 'asin'")
        if asin == 'nan' or len(asin) > 10 or asin in seen:
            continue
        seen.add(asin)
        products.append(normalize_product(p, i, files["products"].name, ins, human, human_goals))
    return products


def draw_prices(products: list[dict], rng: random.Random) -> dict[str, float]:
    """The reward price of each product: its single price, or ``rng.uniform(lo, hi)`` for a range (original
    ``generate_product_prices``, seeded here)."""
    prices = {}
    for p in products:
        pricing = p["pricing"]
        prices[p["asin"]] = 100.0 if not pricing else (pricing[0] if len(pricing) == 1 else rng.uniform(*pricing[:2]))
    return prices


def price_cap(price: float, rng: random.Random) -> tuple[float, str]:
    """(price_upper, text) for a product price: the larger of 2 values sampled from the first 4 PRICE_RANGE
    values above the price, with text ", and price lower than X.XX dollars"; (1e6, "") if fewer than 2 exist."""
    candidates = [p for p in PRICE_RANGE if p > price][:4]
    if len(candidates) < 2:
        return NO_PRICE_CAP, ""
    _, upper = sorted(rng.sample(candidates, 2))
    return upper, f", and price lower than {upper:.2f} dollars"


def human_goals_from(products: list[dict], prices: dict[str, float], rng: random.Random) -> list[dict]:
    """One goal per human instruction with non-empty instruction_attributes (original ``get_human_goals``)."""
    goals = []
    for item in products:
        for j, ins in enumerate(item.get("instructions", [])):
            where = f"items_human_ins.json: asin {item['asin']} instruction {j}"
            for field in ("instruction", "instruction_attributes", "instruction_options"):
                if field not in ins:
                    raise WebShopDataError(f"{where} has no {field!r}")
            if len(ins["instruction_attributes"]) == 0:
                continue
            upper, price_text = price_cap(prices[item["asin"]], rng)
            goals.append({
                "asin": item["asin"], "category": item["category"], "query": item["query"], "name": item["name"],
                "product_category": item["product_category"],
                "instruction_text": ins["instruction"].strip('.') + price_text,
                "attributes": ins["instruction_attributes"], "price_upper": upper,
                "goal_options": ins["instruction_options"], "weight": 1,
            })
    return goals


def synthetic_goals_from(products: list[dict], prices: dict[str, float], rng: random.Random) -> list[dict]:
    """One goal per combination of option values of each product with an instruction (original
    ``get_synthetic_goals``); weight = mean over attributes of 1 / (goals using that attribute)."""
    goals = []
    counts: dict[str, int] = defaultdict(int)
    for p in products:
        if p.get("instruction_text") is None:
            continue
        attributes = p["instruction_attributes"]
        if not attributes:
            raise WebShopDataError(f"items_ins_v2: asin {p['asin']} has an instruction but no "
                                   f"'instruction_attributes'")
        upper, price_text = price_cap(prices[p["asin"]], rng)
        names = sorted(p["options"])
        for combo in itertools.product(*(p["options"][n] for n in names)):
            goal_options = dict(zip(names, combo))
            option_text = ', and '.join(f'{k}: {v}' for k, v in goal_options.items())
            option_text = ' with ' + option_text if option_text else ''
            goals.append({
                "asin": p["asin"], "category": p["category"], "query": p["query"], "name": p["Title"],
                "product_category": p["product_category"],
                "instruction_text": f"{p['instruction_text']}{option_text}{price_text}",
                "attributes": attributes, "price_upper": upper, "goal_options": goal_options,
            })
            for a in attributes:
                counts[a] += 1
    for g in goals:
        g["weight"] = sum(1.0 / counts[a] for a in g["attributes"]) / len(g["attributes"])
    return goals


def load_webshop_data(data_dir: str | os.PathLike, *, num_products: int | None = None, human_goals: bool = True,
                      price_seed: int = 0) -> WebShopData:
    """Load products, draw prices and caps with ``random.Random(price_seed)``, build and shuffle the goals. Raises
    WebShopDataError for a missing/malformed file (naming the file and field) or when no goal could be built."""
    files = find_data_files(data_dir, human_goals)
    products = load_products(files, num_products, human_goals)
    if not products:
        raise WebShopDataError(f"{files['products'].name}: no usable product")
    rng = random.Random(price_seed)
    prices = draw_prices(products, rng)
    goals = (human_goals_from if human_goals else synthetic_goals_from)(products, prices, rng)
    if not goals:
        raise WebShopDataError(f"{data_dir}: no goal could be built ({'human' if human_goals else 'synthetic'} "
                               f"goals need instructions with non-empty instruction_attributes)")
    random.Random(SPLIT_SEED).shuffle(goals)
    return WebShopData(products=products, product_by_asin={p["asin"]: p for p in products}, prices=prices,
                       goals=goals, source_dir=str(data_dir))


def split_goal_indices(n_goals: int, split: str, num_test: int = 500, num_dev: int = 0) -> range:
    """Goal indices of a split (as verl-agent splits them; docs/environments.md#webshop): test = [0, num_test), dev =
    [num_test, num_test + num_dev), train = the rest. Raises ValueError for an unknown split or an empty train split."""
    test_end = min(num_test, n_goals)
    dev_end = min(test_end + num_dev, n_goals)
    if split == "test":
        return range(0, test_end)
    if split == "dev":
        return range(test_end, dev_end)
    if split == "train":
        if dev_end >= n_goals:
            raise ValueError(f"WebShop has {n_goals} goals, all used by test ({num_test}) + dev ({num_dev}); "
                             f"no train goals left")
        return range(dev_end, n_goals)
    raise ValueError(f"unknown WebShop split {split!r}; expected 'train', 'dev' or 'test'")
