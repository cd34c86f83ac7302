"""The errors Hydra prints as their message alone: a setting that cannot work (docs/robustness.md, "Settings refused
at start-up") and a run stopped by a failure the message fully explains."""
from __future__ import annotations

import contextlib
from typing import Iterator

from hydra.errors import CompactHydraException


class ConfigError(CompactHydraException, ValueError):
    """A bad setting, found before anything is built: Hydra prints a ``CompactHydraException`` as its message alone
    (the traceback with ``HYDRA_FULL_ERROR=1``); a ``ValueError`` for code that catches those."""


class RunError(CompactHydraException, RuntimeError):
    """A run stopped by a failure whose message says all the user needs (a checkpoint the disk could not hold):
    printed alone, like a ``ConfigError``; a ``RuntimeError`` for code that catches those."""


@contextlib.contextmanager
def refused_settings() -> Iterator[None]:
    """Turn a ``ValueError`` or ``OSError`` raised by start-up checks inside the block into a ``ConfigError`` (the
    same message, the original as its cause), so Hydra prints the message alone."""
    try:
        yield
    except ConfigError:
        raise
    except (ValueError, OSError) as err:
        raise ConfigError(str(err)) from err
