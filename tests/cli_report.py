"""Run the project's CLI in a subprocess for a test, and say why it failed.

Under DDP each rank prints its own traceback to the shared stderr; a rank that crashes makes the other ranks
fail later with gloo's "Connection closed by peer", so the tail of stderr shows only the consequence. The
report therefore carries every traceback in stderr (the first is the cause), then the last log lines.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_TRACEBACK = "Traceback (most recent call last):"


def failure_report(proc: subprocess.CompletedProcess, limit: int = 12_000) -> str:
    """Exit code, every traceback in ``proc.stderr`` (each with the lines after it up to the next one; the first
    kept whole, the others cut to their last ``limit / n`` characters), the last 30 lines of stdout (the log) and
    the last 10 of stderr."""
    # each block runs from its "Traceback" line to the next one: the exception and the lines its message spans
    starts = [m.start() for m in re.finditer(re.escape(_TRACEBACK), proc.stderr or "")]
    blocks = [proc.stderr[a:b] for a, b in zip(starts, [*starts[1:], len(proc.stderr)])]
    budget = max(limit // max(len(blocks), 1), 1500)
    parts = [f"exit code {proc.returncode}; {len(blocks)} traceback(s) in stderr"]
    parts += [f"--- traceback {k + 1} ---\n{b if k == 0 else b[-budget:]}" for k, b in enumerate(blocks)]
    for name, text, n in (("stdout", proc.stdout, 30), ("stderr", proc.stderr, 10)):
        parts.append(f"--- last lines of {name} ---\n" + "\n".join((text or "").splitlines()[-n:]))
    return "\n".join(parts)


def run_cli(args: list[str], timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python <args>`` from the repository root, output captured, with Hydra's full tracebacks; ``env`` adds to
    (or replaces) this process's environment variables."""
    env = {**os.environ, "HYDRA_FULL_ERROR": "1", **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
