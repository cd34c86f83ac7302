"""What the memory did in each iteration, as two tables a person can read: the entries ``written`` and the tips
``retrieved`` (docs/usage.md#reading-the-tips describes their columns).

Each table is a JSON file ``{"columns": [...], "data": [[...], ...]}`` (MLflow's table format) in the run directory
and, with the MLflow logger, the run's artifacts; ``scripts/show_tips.py`` prints them.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from src.utils.io import write_json_atomic

log = logging.getLogger(__name__)

TABLES = ("written", "retrieved")
# what a reader looks at first comes first (MLflow's table view shows the leftmost columns)
COLUMNS = {
    "written": ("iteration", "episode", "step", "action", "episode_score", "tip", "max_score", "partition", "mode",
                "task", "content"),
    "retrieved": ("iteration", "episode", "step", "rank", "similarity", "tip_score", "content", "tip_iteration",
                  "tip_step", "partition", "mode", "task"),
}
DIRECTORY = "tips"
TENSORBOARD_ROWS = 200  # a text summary is a markdown table: enough rows to read, not a dump


def table_name(iteration: int, table: str) -> str:
    """``tips/iteration_0003_written.json``: the file (and MLflow artifact) of one table of one iteration."""
    if table not in TABLES:
        raise ValueError(f"tip table must be one of {TABLES}, got {table!r}")
    return f"{DIRECTORY}/iteration_{int(iteration):04d}_{table}.json"


def as_table(rows: list[dict[str, Any]], table: str) -> dict[str, list]:
    """Rows (dicts with the table's ``COLUMNS``) as a table; raises ValueError for a row missing a column."""
    columns = COLUMNS[table]
    for row in rows:
        missing = [c for c in columns if c not in row]
        if missing:
            raise ValueError(f"tip table {table!r}: a row lacks the columns {missing} (has {sorted(row)})")
    return {"columns": list(columns), "data": [[row[c] for c in columns] for row in rows]}


def log_tip_tables(trainer, iteration: int, tables: dict[str, list[dict[str, Any]]]) -> float:
    """Write an iteration's non-empty tables (rank 0 only) to the run directory and to each logger that shows
    tables (MLflow: an artifact; W&B: a ``wandb.Table``; TensorBoard: the written tips as text). Returns seconds."""
    tic = time.perf_counter()
    if not trainer.is_global_zero:
        return 0.0
    from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger

    root = Path(trainer.default_root_dir)
    for table, rows in tables.items():
        if not rows:
            continue
        data, name = as_table(rows, table), table_name(iteration, table)
        write_json_atomic(root / name, data, ensure_ascii=False)
        for logger in trainer.loggers:
            if isinstance(logger, MLFlowLogger):
                logger.experiment.log_table(logger.run_id, data={c: [r[c] for r in rows] for c in data["columns"]},
                                            artifact_file=name)
            elif isinstance(logger, WandbLogger):
                logger.log_table(key=f"tips/{table}", columns=data["columns"], data=data["data"], step=iteration)
            elif isinstance(logger, TensorBoardLogger) and table == "written":
                logger.experiment.add_text("tips/written", markdown_table(data, TENSORBOARD_ROWS), iteration)
    return time.perf_counter() - tic


def markdown_table(data: dict[str, list], max_rows: int) -> str:
    """A ``{"columns", "data"}`` table as markdown (TensorBoard renders it), at most ``max_rows`` rows."""
    def cell(v: Any) -> str:
        return str(v).replace("|", "/").replace("\n", " ")

    lines = ["| " + " | ".join(data["columns"]) + " |", "|" + "---|" * len(data["columns"])]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in data["data"][:max_rows]]
    if len(data["data"]) > max_rows:
        lines.append(f"({len(data['data']) - max_rows} more rows in {DIRECTORY}/ of the run directory)")
    return "\n".join(lines)


def read_table(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a table file written by ``log_tip_tables``; raises ValueError, naming it, for an unreadable file
    or one that is not a ``{"columns", "data"}`` table."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"tip table {path} cannot be read: {type(err).__name__}: {err}") from err
    if not isinstance(data, dict) or not {"columns", "data"} <= set(data):
        raise ValueError(f"{path} is not a tip table (expected a JSON object with 'columns' and 'data')")
    return [dict(zip(data["columns"], row)) for row in data["data"]]
