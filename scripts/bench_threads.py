"""How torch's CPU threads behave on a quiet and on a shared machine, for each thread setting.

    python scripts/bench_threads.py                                  # the decoding-shaped loop, every setting
    python scripts/bench_threads.py --workload steps                 # + a warm-start step, a generation, an update
    python scripts/bench_threads.py --settings default empo2 --loads quiet torch

Each measurement runs in a fresh process whose environment carries the setting (OpenMP reads its variables when
torch loads it), optionally beside a competing load started first and stopped after:

- loads: ``quiet`` (nothing else), ``torch`` (another process running the same decoding-shaped loop with torch's
  defaults: 2 threads that spin, like someone else's training job), ``empo2`` (the same loop with this project's
  thread settings, like a second run of it), ``busy`` (a pure-Python busy loop: one core taken);
- settings: ``default`` (torch's own: one thread per core, libgomp spinning ~300,000 rounds at every barrier),
  ``passive`` (``OMP_WAIT_POLICY=PASSIVE``: threads sleep at once), ``one-thread`` (``OMP_NUM_THREADS=1``),
  ``spin-<n>`` (``GOMP_SPINCOUNT=<n>``: a bounded spin), ``empo2`` (what ``src/utils/threads.py`` does by default:
  the bounded spin and the thread count re-read from the load before each step, as ``Policy.generate`` does);
- workloads: ``decode`` (30 × two matmuls of an 8 × 576 batch through SmolLM2's 1,536-wide MLP: ms per step, the
  median of ``--repeats`` runs of 20 steps) and ``steps`` (``scripts/bench_cpu_speed.py``'s warm-start step,
  generation step and update of the real SmolLM2, fp32, seconds per call).

Figures belong to the machine they ran on; the first line names it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PROJECT_ROOT", str(ROOT))

SETTINGS = {
    "default": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "one-thread": {"OMP_NUM_THREADS": "1"},
    "spin-10000": {"GOMP_SPINCOUNT": "10000"},
    "spin-1000": {"GOMP_SPINCOUNT": "1000"},
    "empo2": None,  # src/utils/threads.py's choice, made in the child as the entry points make it
}
THREAD_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS", "EMPO2_THREADS",
               "EMPO2_ADAPT_THREADS")
DECODE_LOOP = """
import time, torch
x = torch.randn(8, 576); w1 = torch.randn(576, 1536) / 24; w2 = torch.randn(1536, 576) / 40
def step():
    h = x
    for _ in range(30):
        h = torch.relu(h @ w1) @ w2
    return h
for _ in range(3): step()
"""


def decode_ms(repeats: int, before_step=lambda: None) -> float:
    """Median ms per decoding-shaped step (30 layers of an 8-row MLP), ``repeats`` runs of 20 steps; ``before_step``
    runs before each step (what ``Policy.generate`` runs before a call)."""
    namespace: dict = {}
    exec(DECODE_LOOP, namespace)  # noqa: S102 - the loop above, shared with the competing load
    runs = []
    for _ in range(repeats):
        tic = time.perf_counter()
        for _ in range(20):
            before_step()
            namespace["step"]()
        runs.append((time.perf_counter() - tic) / 20 * 1000)
    return statistics.median(runs)


def child(workload: str, repeats: int) -> dict:
    adapt = lambda: None  # noqa: E731
    if os.environ.get("BENCH_EMPO2_DEFAULT"):
        from src.utils.threads import adapt_threads, configure_threads

        configure_threads()
        adapt = adapt_threads
    import torch

    out = {"env": {v: os.environ[v] for v in THREAD_VARS if v in os.environ}}
    adapt()
    time.sleep(2.5)  # one reading of the load from the last one (src/utils/threads.py re-reads every 2 s)
    out["decode_ms"] = decode_ms(repeats, adapt)
    out["threads"] = torch.get_num_threads()
    if workload == "steps":
        import lightning as L

        from scripts.bench_cpu_speed import Bench, compose, timed

        bench = Bench(compose("scienceworld"), 1)
        autocast = L.Fabric(accelerator="cpu", devices=1, precision="32-true").autocast
        bench.set_checkpointing(False)
        with autocast():
            out["warm_start_s"] = timed(lambda: bench.sft_step(True), repeats)
            new = int(bench.data.max_response_tokens)
            with torch.no_grad():
                generation = bench.policy.generate(bench.prompts, max_new_tokens=new, temperature=1.0)
                out["generate_s"] = timed(lambda: bench.policy.generate(bench.prompts, max_new_tokens=new,
                                                                        temperature=1.0), repeats)
            k = int(bench.data.micro_batch_size)

            def update():
                bench.optimizer.zero_grad()
                lp = bench.policy.log_probs(bench.prompts[:k], generation.response_ids[:k], with_entropy=True)
                (-(lp["log_probs"].sum()) / lp["response_mask"].sum()).backward()
                bench.optimizer.step()

            out["update_s"] = timed(update, repeats)
    return out


def start_load(kind: str) -> subprocess.Popen | None:
    clean = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    if kind == "quiet":
        return None
    if kind == "busy":
        code = "while True: pass\n"
    elif kind == "torch":
        code = DECODE_LOOP + "\nwhile True: step()\n"
    else:  # another run of this project: its entry point's thread settings, the threads re-read before each step
        code = ("from src.utils.threads import adapt_threads, configure_threads\nconfigure_threads()\n" + DECODE_LOOP
                + "\nwhile True:\n    adapt_threads()\n    step()\n")
    # a session of its own, as a job started elsewhere (not a descendant that src/utils/threads.py counts as ours)
    proc = subprocess.Popen([sys.executable, "-c", code], env={**clean, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                            start_new_session=True)
    time.sleep(3)  # torch loaded and spinning
    return proc


def measure(setting: str, load: str, workload: str, repeats: int, timeout_s: float) -> dict | None:
    """The child's figures, or None when it ran past ``timeout_s``."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    if SETTINGS[setting] is None:
        env["BENCH_EMPO2_DEFAULT"] = "1"
    else:
        env.update(SETTINGS[setting], EMPO2_ADAPT_THREADS="0")  # Policy's calls would adapt the threads too
    competitor = start_load(load)
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", "--workload", workload, "--repeats",
                               str(repeats)], env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"{setting}/{load}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    loads = ["quiet", "torch", "empo2", "busy"]
    ap.add_argument("--loads", nargs="+", default=loads, choices=loads)
    ap.add_argument("--workload", default="decode", choices=["decode", "steps"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=1200, help="seconds before a measurement is given up")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.workload, args.repeats)))
        return
    from src.utils.logging import cpu_model

    print(f"machine: {cpu_model()}, {os.cpu_count()} cores; workload {args.workload}; median of {args.repeats}")
    keys = ["decode_ms"] + (["warm_start_s", "generate_s", "update_s"] if args.workload == "steps" else [])
    print("| setting | threads | load | " + " | ".join(keys) + " |")
    print("|---|---|---|" + "---|" * len(keys))
    for load in args.loads:
        for setting in args.settings:
            r = measure(setting, load, args.workload, args.repeats, args.timeout)
            if r is None:
                print(f"| {setting} | | {load} | more than {args.timeout:.0f} s in all (stopped) |", flush=True)
                continue
            values = " | ".join(f"{r[k]:.1f}" if k == "decode_ms" else f"{r[k]:.2f}" for k in keys)
            print(f"| {setting} | {r['threads']} | {load} | {values} |", flush=True)


if __name__ == "__main__":
    main()
