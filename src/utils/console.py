"""What a run prints: warnings, errors and the INFO lines marked ``extra=CONSOLE``; the run's ``<task>.log`` keeps
every INFO line. Hydra's console handler takes ``ConsoleFilter`` (``configs/hydra/default.yaml``).
"""
from __future__ import annotations

import logging

CONSOLE = {"console": True}  # log.info(..., extra=CONSOLE): also on the console


class ConsoleFilter(logging.Filter):
    """Pass records at WARNING and above, and INFO records marked with ``extra=CONSOLE``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or bool(getattr(record, "console", False))
