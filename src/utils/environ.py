"""Process environment variables set for the duration of one call (e.g. while a library reads them at start-up)."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator


@contextlib.contextmanager
def temporary_environ(name: str, value: str) -> Iterator[None]:
    """Set ``os.environ[name] = value`` inside the block; restore the previous value (or absence) after it."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous
