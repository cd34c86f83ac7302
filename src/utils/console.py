"""What a run prints: warnings, errors and the INFO lines marked for the console (``extra=CONSOLE``): the run
directory, one line per iteration, what a long first step is doing (a model conversion, the warm start) and the
settings a checkpoint gave. The run's ``<task>.log`` (``train.log``) keeps every INFO line (rollout steps, timings,
the precision chosen, ...). Hydra's console handler takes ``ConsoleFilter`` (``configs/hydra/default.yaml``).
"""
from __future__ import annotations

import logging

CONSOLE = {"console": True}  # log.info(..., extra=CONSOLE): also on the console


class ConsoleFilter(logging.Filter):
    """Pass records at WARNING and above, and INFO records marked with ``extra=CONSOLE``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or bool(getattr(record, "console", False))
