"""How torch's CPU threads wait, set before torch loads (docs/performance.md, "Threads on a shared machine").

libgomp's threads spin ~300,000 rounds at every barrier before they sleep: the fastest wait alone, the slowest beside
another job (a spinning thread burns the core the descheduled one needs). A bounded spin (``GOMP_SPINCOUNT``) keeps
the quiet speed and gives a busy core away. libgomp reads it once, when it loads; child processes inherit it.
"""
from __future__ import annotations

import logging
import math
import os
import sys
import time

log = logging.getLogger(__name__)

# spins before a waiting OpenMP thread sleeps (libgomp's default: 300,000); chosen from scripts/bench_threads.py
SPIN_COUNT = "10000"
USER_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
# the choice, for the start-up log line (and inherited by child processes with the setting itself)
CHOICE_VAR = "EMPO2_THREADS"


def configure_threads() -> str:
    """Set ``GOMP_SPINCOUNT`` unless the user set one of ``USER_VARS``; return (and keep in ``EMPO2_THREADS``) a line
    saying what waits how."""
    if CHOICE_VAR in os.environ:  # a child process: the parent decided, and the variables came along
        return os.environ[CHOICE_VAR]
    user = {name: os.environ[name] for name in USER_VARS if name in os.environ}
    if user:
        choice = "as set by the user: " + ", ".join(f"{k}={v}" for k, v in user.items())
    else:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
        choice = (f"OpenMP threads spin {int(SPIN_COUNT):,} rounds, then sleep (GOMP_SPINCOUNT={SPIN_COUNT}: fast "
                  "alone, no stall beside other jobs; set OMP_WAIT_POLICY or GOMP_SPINCOUNT to override)")
    if "torch" in sys.modules:  # too late for libgomp to read it (e.g. a library imported torch first)
        choice += "; torch was already loaded, so it applies to child processes only"
    os.environ[CHOICE_VAR] = choice
    return choice


class ThreadGovernor:
    """torch's thread count set to the cores other processes leave free, re-read at most every ``period_s`` seconds.

    Other processes' load is the machine's busy CPU time (``/proc/stat``) less that of this process and its
    descendants (``/proc/<pid>/stat``) since the last reading. Threads = cores − (the other processes' cores, rounded
    to the nearest whole core, so half a core of background work changes nothing), between 1 and ``max_threads``:
    beside another job, two threads would wait at every barrier for the one the other job holds.
    """

    def __init__(self, max_threads: int, period_s: float = 2.0, cpus: int | None = None):
        self.max_threads, self.period_s = int(max_threads), float(period_s)
        self.cpus = cpus or len(os.sched_getaffinity(0))
        self.threads = self.max_threads
        self.last_others = 0.0  # cores the other processes used at the last reading
        self._last = self._sample()

    @staticmethod
    def _sample() -> tuple[float, int, int]:
        """(monotonic time, the machine's busy ticks, the ticks of this process and its descendants)."""
        fields = [int(v) for v in open("/proc/stat").readline().split()[1:8]]
        busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6]  # user, nice, system, irq, softirq
        parent, ticks = {}, {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
            except OSError:  # the process ended meanwhile
                continue
            pid = int(entry.name)
            # ppid; utime + stime, and cutime + cstime: the time of children it has reaped (an environment worker
            # that ended in the window is still the run's work, not another job's)
            parent[pid], ticks[pid] = int(rest[1]), sum(int(v) for v in rest[11:15])
        children: dict[int, list[int]] = {}
        for pid, ppid in parent.items():
            children.setdefault(ppid, []).append(pid)
        own, todo = 0, [os.getpid()]
        while todo:
            pid = todo.pop()
            own += ticks.get(pid, 0)
            todo += children.get(pid, [])
        return time.monotonic(), busy, own

    def others(self) -> float | None:
        """Cores the other processes used since the last reading, or None within ``period_s`` of it."""
        now = time.monotonic()
        if now - self._last[0] < self.period_s:
            return None
        sample = self._sample()
        ticks = os.sysconf("SC_CLK_TCK") * (sample[0] - self._last[0])
        others = max(0.0, ((sample[1] - self._last[1]) - (sample[2] - self._last[2])) / ticks)
        self._last = sample
        return others

    def update(self) -> int:
        """Re-read the load (at most every ``period_s``) and return the thread count to use."""
        others = self.others()
        if others is not None:
            self.last_others = others
            self.threads = max(1, min(self.max_threads, self.cpus - max(0, math.ceil(others - 0.5))))
        return self.threads


_governor: ThreadGovernor | None = None
_adapting = True


def adapt_threads() -> None:
    """Set torch's thread count with ``ThreadGovernor`` (cheap between re-readings). Off where the user set
    ``OMP_NUM_THREADS`` or ``EMPO2_ADAPT_THREADS=0``, without ``/proc``, and in a multi-process run (DDP/FSDP)."""
    global _governor, _adapting
    if not _adapting:
        return
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # DDP/FSDP ranks are each other's load, and a thread count that follows their timing would make their float
        # rounding, and so exact resume and the 1-process equivalence, depend on it
        return

    if _governor is None:
        if "OMP_NUM_THREADS" in os.environ or os.environ.get("EMPO2_ADAPT_THREADS") == "0" \
                or not os.path.exists("/proc/stat"):
            _adapting = False
            return
        _governor = ThreadGovernor(torch.get_num_threads())
    before = _governor.threads
    threads = _governor.update()
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
        if threads != before:
            log.info("torch threads %d -> %d: other processes used %.1f of %d cores in the last %.0f s", before,
                     threads, _governor.last_others, _governor.cpus, _governor.period_s)
