"""Wall-clock timing of code blocks into a dict of seconds (rollout, memory and update timings)."""
from __future__ import annotations

import contextlib
import time
from typing import Iterator


@contextlib.contextmanager
def timed(timers: dict[str, float], key: str) -> Iterator[None]:
    """Add the block's wall time (s, ``time.perf_counter``) to ``timers[key]`` (created at 0), also on an error."""
    tic = time.perf_counter()
    try:
        yield
    finally:
        timers[key] = timers.get(key, 0.0) + time.perf_counter() - tic
