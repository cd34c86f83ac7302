"""The original WebShop text observations (``web_agent_site/envs/web_agent_text_env.py``, mode 'text'), page by page:
the page's visible HTML text nodes in order, each stripped, joined with ' [SEP] '; nodes that are
exactly '\\n' or empty (an empty description or bullet) render none, which ``join_nodes`` reproduces.
"""
from __future__ import annotations

import json

# the admissible action that stands for "type a query" on the search page
SEARCH_PLACEHOLDER = "search[<query>]"

# the pages' buttons (a page's other clickables are products or option values)
BUTTONS = {"back to search", "< prev", "next >", "description", "features", "reviews", "buy now"}
SEP = " [SEP] "
RESULTS_PER_PAGE = 10


def join_nodes(nodes: list[str]) -> str:
    """Join visible text nodes like the original: drop empty nodes and '\\n', strip the rest."""
    return SEP.join(n.strip() for n in nodes if n != "" and n != "\n")


def search_page(instruction: str) -> str:
    """``WebShop [SEP] Instruction: [SEP] <instruction> [SEP] Search``."""
    return join_nodes(["WebShop", "Instruction:", instruction, "Search"])


def _header(instruction: str) -> list[str]:
    return ["Instruction:", instruction, "Back to Search"]


def results_page(instruction: str, page: int, total: int, items: list[dict]) -> str:
    """Results page ``page`` (1-based) of ``total`` hits; ``items`` are this page's products (<= 10).
    ``< Prev`` appears from page 2 on; ``Next >`` always."""
    nodes = _header(instruction) + [f"Page {page} (Total results: {total})"]
    if page > 1:
        nodes.append("< Prev")
    nodes.append("Next >")
    for p in items:
        nodes += [p["asin"], p["Title"], p["Price"]]
    return join_nodes(nodes)


def item_page(instruction: str, product: dict) -> str:
    """Item page: option names and values, title, price tag, rating, the four buttons (chosen options are
    not marked in this mode)."""
    nodes = _header(instruction) + ["< Prev"]
    for name, values in product["options"].items():
        nodes.append(name)
        nodes += values
    nodes += [product["Title"], f"Price: {product['Price']}", f"Rating: {product['Rating']}",
              "Description", "Features", "Reviews", "Buy Now"]
    return join_nodes(nodes)


def sub_page(instruction: str, page: str, product: dict) -> str:
    """An item's ``description``, ``features`` (its bullet points) or ``reviews`` page; the original never loads
    reviews (``Reviews = []``), so only the header shows there."""
    body = {"description": [product["Description"]], "features": list(product["BulletPoints"]),
            "reviews": [str(r.get(k, "")) for r in product["Reviews"] for k in ("title", "score", "body")]}[page]
    return join_nodes(_header(instruction) + ["< Prev"] + body)


def _tojson(obj) -> str:
    """Flask/Jinja ``tojson``: sorted keys, ASCII, and HTML-unsafe characters escaped."""
    s = json.dumps(obj, sort_keys=True)
    return s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").replace("'", "\\u0027")


def done_page(asin: str, options: dict[str, str], reward: float) -> str:
    """The page after Buy Now, as the original text env shows it (goal details are not rendered there)."""
    nodes = ["Thank you for shopping with us!", "Your code:", "None", "(Paste it in your MTurk interface.)",
             "Purchased", "asin", asin, "options", _tojson(options), "attrs", "None", "category", "None",
             "query", "None", "product category", "None", "Target", "asin", "options", "attrs", "price upper",
             "instuction text", "category", "product category", "query", "Goal", "None", "Reward",
             "Your score (min 0.0, max 1.0)", str(reward), "Reward Details", "None"]
    return join_nodes(nodes)
