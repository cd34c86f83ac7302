"""The tip memory as portable files, readable without the training checkpoint (docs/export.md#the-memory).

A memory directory holds three files:

- ``memory.json``: ``format``, ``embedder_name`` (the keys are only comparable with queries of the same embedder),
  ``dim``, ``partition`` (how tasks map to partitions: ``variation``, ``task`` or ``global``), ``num_entries`` and
  ``partitions`` (entries per partition);
- ``tips.jsonl``: one JSON object per entry (``partition``, ``content``, ``score``, ``step``, ``created_at``,
  ``iteration``), partition by partition, oldest entry first;
- ``keys.npy``: float32 ``[num_entries, dim]``, the unit-norm state embedding of each entry, row i for line i. The
  FAISS index of a partition is an inner-product index over its rows (``TipMemory`` rebuilds it on load).

Written by ``src/export.py``, read by ``src/eval.py`` (``eval.memory_file=<dir>``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from src.memory.tip_memory import STATE_FORMAT

MEMORY_FILE_FORMAT = "empo2.memory_file.v1"
INFO, TIPS, KEYS = "memory.json", "tips.jsonl", "keys.npy"


def write_memory_files(tip_state: dict[str, Any], out_dir: str | Path, partition: str) -> Path:
    """Write a ``TipMemory.state_dict()`` (e.g. from a checkpoint's ``MemoryCallback`` state) to ``out_dir``.

    ``partition``: the memory's partition setting (``memory.partition``), stored so a reader maps tasks to the same
    partitions. Returns ``out_dir``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dim = int(tip_state["dim"])
    keys, counts = [], {}
    with open(out_dir / TIPS, "w", encoding="utf-8") as f:
        for name, part in tip_state["partitions"].items():
            rows = np.asarray(part["keys"], dtype=np.float32).reshape(-1, dim)
            keys.append(rows)
            counts[name] = len(part["entries"])
            for entry in part["entries"]:
                f.write(json.dumps({"partition": name, **entry}, ensure_ascii=False) + "\n")
    np.save(out_dir / KEYS, np.concatenate(keys) if keys else np.zeros((0, dim), np.float32))
    info = {"format": MEMORY_FILE_FORMAT, "embedder_name": tip_state["embedder_name"], "dim": dim,
            "partition": partition, "num_entries": sum(counts.values()), "partitions": counts}
    (out_dir / INFO).write_text(json.dumps(info, indent=1) + "\n")
    return out_dir


def _read(path: Path, read):
    """``read(path)``; a failure to read or parse it raises ValueError naming the file and what the folder holds."""
    try:
        return read(path)
    except (OSError, ValueError, EOFError) as err:
        size = f"{path.stat().st_size} bytes" if path.is_file() else "missing"
        raise ValueError(f"memory file {path} ({size}) cannot be read: {type(err).__name__}: {err}. A memory "
                         f"directory written by src/export.py holds {INFO}, {TIPS} and {KEYS}; export it again") from err


def _finite(keys: np.ndarray) -> np.ndarray:
    if keys.dtype.kind == "f" and not np.isfinite(keys).all():
        bad = np.flatnonzero(~np.isfinite(keys.reshape(len(keys), -1)).all(axis=1))
        raise ValueError(f"{len(bad)} of its {len(keys)} keys hold NaN or inf (e.g. row {bad[0]}), which no embedder "
                         "writes")
    return keys


def read_memory_files(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read a memory directory (or its ``memory.json``) back: ``(tip_state, info)``, ``tip_state`` in the form of
    ``TipMemory.state_dict()`` (load it with ``TipMemory.load_state_dict``, which refuses another embedder) and
    ``info`` the contents of ``memory.json``. Raises FileNotFoundError (no ``memory.json``), ValueError (a file
    missing, empty, cut short or not in its format, another format, or files that disagree).
    """
    path = Path(path)
    directory = path.parent if path.name == INFO else path
    if not (directory / INFO).is_file():
        raise FileNotFoundError(f"no memory file at {path} (expected a directory with {INFO}, {TIPS}, {KEYS})")
    info = _read(directory / INFO, lambda f: json.loads(f.read_text()))
    if not isinstance(info, dict) or info.get("format") != MEMORY_FILE_FORMAT:
        found = info.get("format") if isinstance(info, dict) else type(info).__name__
        raise ValueError(f"{directory / INFO}: format {found!r}, expected {MEMORY_FILE_FORMAT!r}")
    lines = _read(directory / TIPS, lambda f: [json.loads(line) for line in f.read_text(encoding="utf-8").splitlines()
                                               if line])
    keys = _read(directory / KEYS, lambda f: _finite(np.load(f, allow_pickle=False)))
    if keys.shape != (len(lines), int(info["dim"])):
        raise ValueError(f"{directory}: {KEYS} has shape {keys.shape}, expected ({len(lines)}, {info['dim']}) "
                         f"(one row per line of {TIPS})")
    partitions: dict[str, dict[str, Any]] = {}
    for row, line in enumerate(lines):
        part = partitions.setdefault(line.pop("partition"), {"rows": [], "entries": []})
        part["rows"].append(row)
        part["entries"].append(line)
    sizes = {name: len(p["entries"]) for name, p in partitions.items()}
    if sizes != info["partitions"]:
        raise ValueError(f"{directory}: {TIPS} has partitions {sizes}, {INFO} says {info['partitions']}")
    state = {"format": STATE_FORMAT, "embedder_name": info["embedder_name"], "dim": int(info["dim"]),
             "partitions": {name: {"keys": keys[p["rows"]], "entries": p["entries"]} for name, p in partitions.items()}}
    return state, info
