"""One tip-memory entry: its stored fields and the line it shows in a prompt (docs/method.md#memory, "Entries")."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TipEntry:
    """One stored tip: ``content`` the formatted line (``format_entry``), ``score`` the episode's final return R in
    environment units, ``created_at`` the unix time of the write."""

    content: str
    score: float
    step: int
    created_at: float
    iteration: int | None = None


def _fmt_number(x: float) -> str:
    """100.0 → "100", 0.75 → "0.75", -12.5 → "-12.5"; at most 4 decimals (float noise such as 0.30000000000000004
    would otherwise leak into prompts)."""
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"expected a finite number, got {x!r}")
    s = f"{x:.4f}".rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


def format_entry(tip: str, action: str, final_score: float, max_score: float) -> str:
    """The stored tip line:
    ``"<tip>; At that step the action taken was <a_k>; the episode's final score was <R>/<max>."``

    Whitespace runs (including newlines) in ``tip`` and ``action`` are collapsed to single spaces so each entry is
    one line in the prompt. Scores are printed without trailing zeros (100 → "100"). Raises ValueError: non-finite.
    """
    tip = " ".join(str(tip).split())
    action = " ".join(str(action).split())
    return (
        f"{tip}; At that step the action taken was {action}; "
        f"the episode's final score was {_fmt_number(final_score)}/{_fmt_number(max_score)}."
    )
