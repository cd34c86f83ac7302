"""Wall-clock timing of code blocks, progress lines and the process's peak memory."""
from __future__ import annotations

import contextlib
import resource
import sys
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


def peak_rss_gib() -> float:
    """This process's peak resident memory so far, in GiB (``getrusage`` ``ru_maxrss``: KiB on Linux, bytes on
    macOS). Child processes (environment workers) are not included."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


def eta_text(elapsed_s: float, done: float, total: float) -> str:
    """``"1.5 min elapsed, about 3.0 min left"``: the time left extrapolated from the rate so far."""
    if done <= 0:
        return f"{elapsed_s / 60:.1f} min elapsed"
    left = elapsed_s / done * max(total - done, 0)
    return f"{elapsed_s / 60:.1f} min elapsed, about {left / 60:.1f} min left"


class EtaLog:
    """Progress of a phase as log lines ``<what>: <done>/<total> <unit>, <eta_text>[, detail]``, at most every
    ``every_s`` seconds and always for the last item."""

    def __init__(self, logger, what: str, total: int, unit: str = "", every_s: float = 10.0):
        self.logger, self.what, self.total, self.unit, self.every_s = logger, what, total, unit, every_s
        self.start = self.last = time.perf_counter()
        self.done = 0

    def step(self, n: int = 1, detail: str = "") -> None:
        """Count ``n`` more items done; log when ``every_s`` has passed or all are done."""
        self.done += n
        now = time.perf_counter()
        if now - self.last < self.every_s and self.done < self.total:
            return
        self.last = now
        unit = f" {self.unit}" if self.unit else ""
        self.logger.info("%s: %d/%d%s, %s%s", self.what, self.done, self.total, unit,
                         eta_text(now - self.start, self.done, self.total), f", {detail}" if detail else "")
