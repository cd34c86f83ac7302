"""How torch's threads wait (src/utils/threads.py), in fresh processes as the entry points start: the bounded spin is
set before torch loads and reaches child processes (environment workers, DDP ranks); a user's setting wins; the
thread count follows the cores other processes take."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what an entry point does first (src/train.py imports src.utils.entrypoint before torch), then a spawned child
PROBE = """
import multiprocessing as mp, os
import src.utils.entrypoint as entry
import torch

def child(queue):
    queue.put(os.environ.get("GOMP_SPINCOUNT"))

if __name__ == "__main__":
    queue = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=child, args=(queue,))
    proc.start(); proc.join()
    print(repr((os.environ.get("GOMP_SPINCOUNT"), queue.get(), entry.THREADS)))
"""


def _probe(tmp_path: Path, **env: str) -> tuple:
    script = tmp_path / "probe.py"  # a file: a spawned child re-imports its parent's main module
    script.write_text(PROBE)
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS",
                                                              "EMPO2_THREADS")}
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env={**clean, "PYTHONPATH": str(ROOT), **env},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return eval(proc.stdout.strip().splitlines()[-1])  # noqa: S307 - our own repr


def test_a_bounded_spin_is_set_before_torch_and_inherited(tmp_path):
    from src.utils.threads import SPIN_COUNT

    spin, child, line = _probe(tmp_path)
    assert spin == child == SPIN_COUNT
    assert f"GOMP_SPINCOUNT={SPIN_COUNT}" in line and "already loaded" not in line


def test_the_users_setting_wins(tmp_path):
    spin, child, line = _probe(tmp_path, OMP_WAIT_POLICY="PASSIVE")
    assert spin is None and child is None and line == "as set by the user: OMP_WAIT_POLICY=PASSIVE"
    spin, _, line = _probe(tmp_path, GOMP_SPINCOUNT="500")
    assert spin == "500" and "GOMP_SPINCOUNT=500" in line


def _busy_child() -> int:
    """A pure-Python busy loop (one core taken) in a child process of ours; its pid."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"]).pid


def _busy_other() -> int:
    """The same loop as another job: started by a shell that exits at once, so it is no descendant of ours."""
    out = subprocess.run(["sh", "-c", f"'{sys.executable}' -c 'while True: pass' >/dev/null 2>&1 & echo $!"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def _threads_beside(pid: int) -> int:
    from src.utils.threads import ThreadGovernor

    governor = ThreadGovernor(max_threads=2, period_s=1.0, cpus=2)
    try:
        time.sleep(1.5)
        return governor.update()
    finally:
        os.kill(pid, signal.SIGKILL)
        try:
            os.waitpid(pid, 0)  # our child: reaped; the other job's is not ours to wait for
        except ChildProcessError:
            pass


def test_the_thread_count_follows_the_cores_other_processes_take():
    """Another job taking a core (no descendant of this process) leaves one thread; the same load in a process of
    the run's own (an environment worker, a JVM) is the run's work and leaves both."""
    assert _threads_beside(_busy_other()) == 1
    assert _threads_beside(_busy_child()) == 2
