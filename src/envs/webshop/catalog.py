"""A deterministic generated WebShop catalog in the original files' schemas (docs/environments.md#webshop), used
when no original data is given; ``data.py`` reads it like the original files. Same seed -> byte-identical files.

Products come in groups of one product type (``vocab.py``): a target and distractors built against its goals (one
missing a goal attribute, one without the goal's option values by the reward's own matcher, one priced above any
possible cap) plus 1-2 random siblings. Every product gets human goals (the target up to 3 with different options),
so partial rewards carry signal.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

from src.envs.webshop.reward import option_matches
from src.envs.webshop.vocab import CATEGORIES, OPENERS, OPTION_PHRASES
from src.utils.io import write_json_atomic

CATALOG_VERSION = 2  # bump whenever the generator or vocab changes, so stale cached catalogs are not reused
FILE_NAMES = ("items_shuffle.json", "items_ins_v2.json", "items_human_ins.json")
_CONTAINERS = {"pair", "box", "bag", "set", "bottle", "tube", "pack"}
_MASS_WORDS = {"shampoo", "coffee", "jerky", "oil", "tea", "polish", "color"}
_ASIN_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def _norm(value: str) -> str:
    """An option value as the original loader shows it (strip, '/' -> ' | ', lower-case)."""
    return value.strip().replace('/', ' | ').lower()


def _title_case(phrase: str) -> str:
    return " ".join(w[:1].upper() + w[1:] for w in phrase.split())


def _with_article(noun: str) -> str:
    words = noun.split()
    last = noun.split(" for ")[0].split()[-1]  # the head noun ("jeans for men" -> "jeans")
    if words[0] in _CONTAINERS:
        return "a " + noun
    if last in _MASS_WORDS or (last.endswith("s") and not last.endswith("ss")):
        return noun
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _and_join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _price(rng: random.Random, lo: float, hi: float) -> float:
    return float(int(rng.uniform(lo, hi))) + rng.choice([0.99, 0.49, 0.95, 0.0])


def _price_str(values: list[float]) -> str:
    return "".join(f"${v:,.2f}" for v in values)


class _Generator:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.asins: set[str] = set()
        self.texts: set[str] = set()
        self.n_ins = 0

    def asin(self) -> str:
        while True:
            a = "B0" + "".join(self.rng.choice(_ASIN_CHARS) for _ in range(8))
            if a not in self.asins:
                self.asins.add(a)
                return a

    def attrs(self, t: dict, k_min: int, k_max: int, pool: list[str] | None = None,
              keep: list[str] = ()) -> list[str]:
        """``keep`` plus k random attributes from ``pool`` (default: all of the type's), never an exclusive pair."""
        pairs = t.get("exclusive", [])
        clash = {b for a, b in pairs if a in keep} | {a for a, b in pairs if b in keep}
        pool = [a for a in (pool if pool is not None else t["attrs"]) if a not in keep and a not in clash]
        k_max = min(k_max, len(pool))
        for _ in range(100):
            chosen = list(keep) + self.rng.sample(pool, self.rng.randint(min(k_min, k_max), k_max))
            if not any(a in chosen and b in chosen for a, b in pairs):
                return chosen
        raise AssertionError(f"no compatible attribute set for {t['query']}; fix vocab.py")

    def random_options(self, t: dict) -> dict[str, list[str]]:
        options = {}
        for name, pool, k_min, k_max, contiguous in t["options"]:
            k = self.rng.randint(k_min, min(k_max, len(pool)))
            if contiguous:
                start = self.rng.randint(0, len(pool) - k)
                options[name] = pool[start:start + k]
            else:
                options[name] = self.rng.sample(pool, k)
        return options

    def random_pricing(self, t: dict, options: dict) -> list[float]:
        lo = _price(self.rng, *t["price"])
        if "Size" in options and len(options["Size"]) > 1 and self.rng.random() < 0.3:
            return [lo, round(lo * self.rng.uniform(1.1, 1.5), 2)]
        return [lo]

    def product(self, cat_name: str, cat: dict, t: dict, attrs: list[str], options: dict[str, list[str]],
                pricing: list[float]) -> dict:
        """A raw product (original items_shuffle schema) plus private keys ``_attrs`` / ``_type``."""
        rng = self.rng
        asin = self.asin()
        brand = rng.choice(cat["brands"])
        noun = rng.choice(t["nouns"])
        noun_words = set(noun.lower().split())
        # Skip attributes sharing a word with the noun ("High Protein Protein Bars").
        fitting = [a for a in attrs if not noun_words & set(a.split())]
        title_attrs = rng.sample(fitting, min(len(fitting), rng.choice([1, 2, 2])))
        head = " ".join(x for x in (brand, t["prefix"], " ".join(_title_case(a) for a in title_attrs), noun) if x)
        rest = [a for a in attrs if a not in title_attrs]
        title = head + (f" with {_title_case(rest[0])}" if rest and rng.random() < 0.4 else "")
        bullets = [f"{a.upper()} - {t['attrs'][a]}" for a in attrs]
        bullets += rng.sample(cat["generic_bullets"], rng.randint(1, 2))
        rng.shuffle(bullets)
        sentences = [t["attrs"][a] for a in attrs]
        rng.shuffle(sentences)
        description = " ".join([f"Meet the {brand} {noun.lower()}."] + sentences + [rng.choice(cat["closing"])])
        custom = {name: [{"value": v, "image": f"images/{asin}/{name.lower().replace(' ', '-')}-{k}.jpg",
                          "asin": f"{asin[:-2]}{k:02d}", "is_selected": k == 0} for k, v in enumerate(values)]
                  for name, values in options.items()}
        return {
            "asin": asin, "name": title, "full_description": description, "small_description": bullets,
            "pricing": _price_str(pricing), "list_price": "", "brand": brand,
            "customization_options": custom or None, "images": [f"images/{asin}/main.jpg"],
            "category": cat_name, "query": t["query"], "product_category": " › ".join(t["path"]),
            "average_rating": round(rng.uniform(3.4, 5.0), 1), "product_information": {},
            "_attrs": list(attrs), "_type": t, "_options": options, "_pricing": pricing,
        }

    def goal_options(self, options: dict[str, list[str]]) -> list[tuple[str, str]]:
        """(normalised option name, normalised value) pairs a shopper asks for."""
        chosen = [(name.lower(), _norm(self.rng.choice(values))) for name, values in options.items()
                  if self.rng.random() < 0.85]
        if options and not chosen:
            name = self.rng.choice(sorted(options))
            chosen = [(name.lower(), _norm(self.rng.choice(options[name])))]
        return chosen

    def instruction(self, t: dict, attrs: list[str], opts: list[tuple[str, str]]) -> str:
        rng = self.rng
        noun = _with_article(rng.choice(t["goal_nouns"]))
        shown = [a.replace(" ", "-") if " " in a and rng.random() < 0.2 else a for a in attrs]
        link = rng.choice(["that is", "with", "which is", "that has", "that comes with"])
        text = f"{rng.choice(OPENERS)} {noun} {link} {_and_join(shown)}"
        if opts:
            if rng.random() < 0.6:
                text += " " + " and ".join(rng.choice(OPTION_PHRASES.get(n, ["{v}"])).format(v=v) for n, v in opts)
            else:
                label = {"flavor name": "flavor"}
                text += ", and choose " + " and ".join(f"the {v} {label.get(n, n)}" for n, v in opts)
        return text

    def goals_for(self, p: dict, attrs: list[str], n: int) -> list[dict]:
        """Up to n human-instruction entries (original items_human_ins schema) for product p, asking for
        ``attrs`` and distinct option choices."""
        entries, seen = [], set()
        for _ in range(4 * n):
            if len(entries) == n:
                break
            opts = self.goal_options(p["_options"])
            key = tuple(opts)
            if key in seen:
                continue
            text = self.instruction(p["_type"], attrs, opts)
            if text in self.texts:
                continue
            seen.add(key)
            self.texts.add(text)
            self.n_ins += 1
            entries.append({"instruction": text, "instruction_attributes": list(attrs),
                            "instruction_options": [v for _, v in opts], "assignment_id": f"gen{self.n_ins:06d}",
                            "worker_id": "generator"})
        return entries

    def group(self, cat_name: str, cat: dict, t: dict) -> tuple[list[dict], dict[str, list[dict]]]:
        """A target, its three distractors and 1-2 siblings, with their human goals."""
        rng = self.rng
        all_attrs = list(t["attrs"])
        attrs = self.attrs(t, 3, min(5, len(all_attrs) - 1))
        options = self.random_options(t)
        target = self.product(cat_name, cat, t, attrs, options, self.random_pricing(t, options))
        goal_attrs = rng.sample(attrs, rng.choice([1, 2, 2, 3]))
        human = {target["asin"]: self.goals_for(target, goal_attrs, 3)}
        asked = [v for e in human[target["asin"]] for v in e["instruction_options"]]
        products = [target]

        # Missing one asked-for attribute (replaced by one the target does not have).
        missing = rng.choice(goal_attrs)
        spare = [a for a in all_attrs if a not in attrs]
        d_attrs = self.attrs(t, 1, 1, pool=spare, keep=[a for a in attrs if a != missing])
        products.append(self.product(cat_name, cat, t, d_attrs, options, target["_pricing"]))

        # Without any value matching an asked-for option of one option group (checked with the reward's matcher).
        for name, pool, *_ in t["options"]:
            keep = [v for v in options[name] if not any(option_matches(_norm(v), g) for g in asked)]
            if len(keep) < len(options[name]):
                extra = [v for v in pool if v not in options[name]
                         and not any(option_matches(_norm(v), g) for g in asked)]
                keep += rng.sample(extra, min(len(extra), max(1, len(options[name]) - len(keep))))
                if keep:
                    products.append(self.product(cat_name, cat, t, attrs, {**options, name: keep},
                                                 target["_pricing"]))
                    break

        # Priced above any cap the target's goals can get (a cap is at most 40 dollars above the price).
        pricey = [_price(rng, target["_pricing"][-1] + 45, target["_pricing"][-1] + 90)]
        products.append(self.product(cat_name, cat, t, attrs, options, pricey))

        for _ in range(rng.randint(1, 2)):
            s_attrs = self.attrs(t, 2, 5)
            s_opts = self.random_options(t)
            products.append(self.product(cat_name, cat, t, s_attrs, s_opts, self.random_pricing(t, s_opts)))
        for p in products[1:]:
            n = 2 if rng.random() < 0.3 else 1
            human[p["asin"]] = self.goals_for(p, rng.sample(p["_attrs"], min(len(p["_attrs"]),
                                                                           rng.choice([1, 2, 2, 3]))), n)
        return products, human


def _check_texts(p: dict) -> None:
    """An attribute of the type that the product lacks must not appear in its texts (the reward's substring
    rule would otherwise count it as present)."""
    text = " ".join([p["name"], " ".join(p["small_description"]), p["full_description"]]).lower()
    for a in p["_type"]["attrs"]:
        if a not in p["_attrs"] and a in text:
            raise AssertionError(f"generated product {p['asin']} ({p['query']}) mentions attribute {a!r} it "
                                 f"does not have; fix vocab.py")


def generate_catalog(num_products: int = 1000, seed: int = 0) -> tuple[list[dict], dict, dict]:
    """Generate (products, ins, human_ins) in the original schemas (items_shuffle / items_ins_v2 /
    items_human_ins). Deterministic in (num_products, seed). Raises ValueError if num_products < 10."""
    if num_products < 10:
        raise ValueError(f"num_products must be >= 10 for a generated catalog, got {num_products}")
    gen = _Generator(seed)
    types = [(cat_name, cat, t) for cat_name, cat in CATEGORIES.items() for t in cat["types"]]
    gen.rng.shuffle(types)
    products: list[dict] = []
    human: dict[str, list[dict]] = {}
    while len(products) < num_products:
        for cat_name, cat, t in types:
            group, group_human = gen.group(cat_name, cat, t)
            group = group[:num_products - len(products)]
            products += group
            human.update({p["asin"]: group_human[p["asin"]] for p in group})
            if len(products) >= num_products:
                break
    ins = {}
    for p in products:
        _check_texts(p)
        entry = {"attributes": p["_attrs"]}
        first = human[p["asin"]][0] if human[p["asin"]] else None
        if first is not None:
            noun = _with_article(p["_type"]["goal_nouns"][0])
            entry["instruction"] = f"i want {noun} with {_and_join(first['instruction_attributes'])}"
            entry["instruction_attributes"] = first["instruction_attributes"]
        ins[p["asin"]] = entry
    gen.rng.shuffle(products)
    raw = [{k: v for k, v in p.items() if not k.startswith("_")} for p in products]
    human = {a: v for a, v in human.items() if v}
    return raw, ins, human


def generated_catalog_dir(root: str | os.PathLike, num_products: int, seed: int) -> Path:
    return Path(root) / f"generated-v{CATALOG_VERSION}-seed{seed}-n{num_products}"


def ensure_generated_catalog(root: str | os.PathLike, num_products: int = 1000, seed: int = 0) -> Path:
    """The directory of the generated catalog's three files, written on first use (safe when several workers race:
    each file is renamed into place, and every writer writes identical bytes)."""
    d = generated_catalog_dir(root, num_products, seed)
    if all((d / name).is_file() for name in FILE_NAMES):
        return d
    d.mkdir(parents=True, exist_ok=True)
    raw, ins, human = generate_catalog(num_products, seed)
    for name, obj in zip(FILE_NAMES, (raw, ins, human)):
        write_json_atomic(d / name, obj, ensure_ascii=False)
    return d
