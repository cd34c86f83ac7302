"""``scripts/show_tips.py`` read by a pager or ``head``: a reader that stops early ends the output quietly."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from src.callbacks.tip_tables import as_table, table_name
from src.utils.io import write_json_atomic

ROOT = Path(__file__).resolve().parents[1]


def test_show_tips_piped_into_head_exits_quietly(tmp_path):
    rows = [{"iteration": 0, "episode": e, "step": 0, "action": "look around", "episode_score": 1.0,
             "tip": f"Tip {e}: " + "look before you leap " * 20, "max_score": 1.0, "partition": "t/0",
             "mode": "on_policy", "task": "{}", "content": "c"} for e in range(3000)]  # far over a pipe's buffer
    write_json_atomic(tmp_path / table_name(0, "written"), as_table(rows, "written"))
    proc = subprocess.run(f"{sys.executable} scripts/show_tips.py {tmp_path} --table written | head -n 2",
                          shell=True, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.splitlines()[1].startswith("  3000 entries written")
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr[-2000:]
