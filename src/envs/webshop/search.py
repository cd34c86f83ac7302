"""BM25 product search, as the original's pyserini/Lucene index (docs/environments.md#webshop).

Documents: ``product_document``. Scoring: ``bm25s``, Lucene variant, k1 = 0.9, b = 0.4 (pyserini's defaults).
Analyzer as Lucene's default English one: lower-cased ``\\b\\w+\\b`` tokens (single characters kept; bm25s's default
pattern drops them), Lucene's 33 English stopwords (= bm25s "en"), Porter stemming by ``PyStemmer`` leaving words of
<= 2 characters alone as Lucene does (Snowball would turn "s" into ""); without PyStemmer, unstemmed with a warning.
Hits: positive score, best first, ties by catalog order (Lucene: by document id), at most ``k``. The index is built
once per catalog under ``cache_root/bm25-<hash>/`` (documents, asins, analyzer), so each worker only loads it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import bm25s
import numpy as np

from src.utils.io import atomic_dir

log = logging.getLogger(__name__)

K1, B = 0.9, 0.4
TOKEN_PATTERN = r"(?u)\b\w+\b"
STOPWORDS = "en"
INDEX_FORMAT = 1  # bump when the document text or analyzer changes


def product_document(p: dict) -> str:
    """The indexed text of a normalised product (original convert_product_file_format)."""
    option_text = ', and '.join(f'{name}: {", ".join(values)}' for name, values in p["options"].items())
    first_bullet = p["BulletPoints"][0] if p["BulletPoints"] else ""
    return ' '.join([p["Title"], p["Description"], first_bullet, option_text]).lower()


def _porter_stemmer():
    """A list-of-words stemmer (Lucene-style Porter), or None when PyStemmer is not installed."""
    try:
        import Stemmer  # noqa: PLC0415 - optional dependency (PyStemmer)
    except ImportError:
        return None
    porter = Stemmer.Stemmer("porter")
    return lambda words: [w if len(w) <= 2 else porter.stemWord(w) for w in words]


class SearchEngine:
    """BM25 search over normalised products, its index cached under ``cache_root``. ``stemmer``: "porter" (the
    original's; "none" with a warning without PyStemmer) or "none"; another raises ValueError."""

    def __init__(self, products: list[dict], cache_root: str | os.PathLike, stemmer: str = "porter"):
        if stemmer not in ("porter", "none"):
            raise ValueError(f"stemmer must be 'porter' or 'none', got {stemmer!r}")
        self._stem = _porter_stemmer() if stemmer == "porter" else None
        if stemmer == "porter" and self._stem is None:
            log.warning("PyStemmer is not installed: WebShop search runs without Porter stemming "
                        "(the original stems); pip install PyStemmer to match it")
        self.stemmer = "porter" if self._stem is not None else "none"
        self.asins = [p["asin"] for p in products]
        docs = [product_document(p) for p in products]
        h = hashlib.sha256()
        h.update(json.dumps({"format": INDEX_FORMAT, "k1": K1, "b": B, "pattern": TOKEN_PATTERN,
                             "stopwords": STOPWORDS, "stemmer": self.stemmer}).encode())
        for asin, doc in zip(self.asins, docs):
            h.update(asin.encode() + b"\0" + doc.encode() + b"\0")
        self.index_dir = Path(cache_root) / f"bm25-{h.hexdigest()[:20]}"
        if not (self.index_dir / "asins.json").is_file():
            self._build(docs, Path(cache_root))
        self.retriever = bm25s.BM25.load(str(self.index_dir), show_progress=False)
        with open(self.index_dir / "asins.json", encoding="utf-8") as f:
            if json.load(f) != self.asins:
                raise RuntimeError(f"cached BM25 index {self.index_dir} lists other products; delete it")

    def tokenize(self, texts: list[str]) -> list[list[str]]:
        return bm25s.tokenize(texts, lower=True, token_pattern=TOKEN_PATTERN, stopwords=STOPWORDS,
                              stemmer=self._stem, return_ids=False, show_progress=False)

    def _build(self, docs: list[str], cache_root: Path) -> None:
        cache_root.mkdir(parents=True, exist_ok=True)
        retriever = bm25s.BM25(k1=K1, b=B, method="lucene")
        retriever.index(self.tokenize(docs), show_progress=False)
        try:
            with atomic_dir(self.index_dir) as tmp:  # the rename fails if another worker finished first
                retriever.save(str(tmp), show_progress=False)
                with open(tmp / "asins.json", "w", encoding="utf-8") as f:
                    json.dump(self.asins, f)
        except OSError:
            if not (self.index_dir / "asins.json").is_file():
                raise

    def search(self, query: str, k: int = 50) -> list[str]:
        """Asins of the top-``k`` products for ``query`` (positive BM25 score only), best first."""
        tokens = self.tokenize([query])[0]
        if not tokens:
            return []
        scores = self.retriever.get_scores(tokens)
        hits = np.flatnonzero(scores > 0)
        order = hits[np.lexsort((hits, -scores[hits]))][:k]
        return [self.asins[i] for i in order]
