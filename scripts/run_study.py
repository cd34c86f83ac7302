"""Run the GRPO-vs-EMPO² study on CPU (same warm start, same seeds), then draw and tabulate the comparison.

    python scripts/run_study.py --experiment webshop --seeds 0 1 --iterations 10
    python scripts/run_study.py --experiment scienceworld --seeds 0 1 --iterations 6 -- env.task=find-living-thing
    python scripts/run_study.py --seeds 1 2 --iterations 2 --dry-run        # print the plan and the estimate

Each run is `python src/train.py experiment=<exp> algorithm=<algo> seed=<s> trainer.max_epochs=<N> tags=[...]`
plus the overrides after `--`; the runs get the extra Hydra tag `study-<id>` so that
`scripts/compare_runs.py --tag study-<id>` (called at the end) compares exactly this study's runs, writes the
learning curves and the results table (`results.md`). The imitation warm start (when the experiment has one) is
built once before any run starts, so that runs side by side never race to build it.

`--parallel K` runs K processes side by side, each limited to `--threads` threads (OMP/MKL/torch): on a small
CPU two single-threaded runs finish sooner than two two-threaded runs one after the other, because generation
and the environment steps leave cores idle. Timings are then per-process timings under that sharing. K runs must
fit in memory: before the first run starts, K is refused when K times the largest peak resident memory an earlier
run of the experiment logged (`system/peak_rss_gib`) exceeds 90% of the machine's (a WebShop run peaks at 10–11 GiB,
measured on a 2-core AMX Xeon in bf16-mixed: one at a time on 24 GB).

Before starting it prints an estimate of the total time: minutes per iteration measured from earlier finished
runs of the same experiment, algorithm and policy in the MLflow store when there are any, else
`--minutes-per-iteration` (default: the CPU measurement in DEFAULT_MINUTES_PER_ITERATION).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Minutes per training iteration with the embedded SmolLM2-135M on a 2-core CPU (2 tasks x 4 episodes, 8 env
# steps, validation every 2nd iteration amortised): ScienceWorld measured (a 2-iteration run: 7.5 min in MLflow);
# WebShop not measured by this script's author, assumed the same.
DEFAULT_MINUTES_PER_ITERATION = {"scienceworld": 4.0, "webshop": 4.0}
# Per run, before its MLflow run starts (imports, JVM / catalog, policy build): measured ~0.5 min on 2 cores.
STARTUP_MINUTES = 0.5


def compose(experiment: str, overrides: Sequence[str]):
    """The training config of ``experiment`` with ``overrides`` (Hydra compose, nothing instantiated)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    os.environ.setdefault("PROJECT_ROOT", str(ROOT))
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=[f"experiment={experiment}", *overrides])


# each run gets the study's rollout precision on its command line (trainer.precision's choice reaches it through the
# environment: src/utils/precision_choice.py)
ROLLOUT = "model.policy.rollout_precision="


def run_commands(experiment: str, algorithms: Sequence[str], seeds: Sequence[int], iterations: int,
                 tags: Sequence[str], overrides: Sequence[str]) -> list[list[str]]:
    """One `src/train.py` command line (argv list) per (algorithm, seed), seeds outermost (runs side by side
    then compare the algorithms under the same load)."""
    tag_list = "[" + ",".join(tags) + "]"
    return [[sys.executable, str(ROOT / "src" / "train.py"), f"experiment={experiment}", f"algorithm={algo}",
             f"seed={seed}", f"trainer.max_epochs={iterations}", f"tags={tag_list}", *overrides]
            for seed in seeds for algo in algorithms]


def _matching_runs(tracking_uri: str, experiment_name: str, algorithms: Sequence[str], env_target: str, model: str,
                   finished_only: bool = True) -> list:
    """The newest (at most 200) runs in the store with one of ``algorithms``, the same environment and policy."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment_name)
    if exp is None:
        return []
    runs = client.search_runs([exp.experiment_id], max_results=200, order_by=["attributes.start_time DESC"],
                              filter_string="attributes.status = 'FINISHED'" if finished_only else "")
    same = (env_target, model)
    return [r for r in runs if r.data.params.get("algorithm/name") in algorithms
            and (r.data.params.get("env/_target_"), r.data.params.get("model/policy/name_or_path")) == same]


def measured_minutes_per_iteration(tracking_uri: str, experiment_name: str, algorithm: str, env_target: str,
                                   model: str) -> tuple[float, int] | None:
    """Median minutes per iteration (MLflow run duration / iterations logged: validation included, the process
    start-up before the MLflow run starts not) over the finished runs in the store with the same algorithm,
    environment and policy, and their number; None if there are none."""
    import mlflow

    from studies.comparison.runs import run_info

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    per_iter = [m for run in _matching_runs(tracking_uri, experiment_name, [algorithm], env_target, model)
                if (m := run_info(client, run)["minutes_per_iteration"])]
    return (statistics.median(per_iter), len(per_iter)) if per_iter else None


def measured_peak_rss_gib(tracking_uri: str, experiment_name: str, algorithms: Sequence[str], env_target: str,
                          model: str) -> float | None:
    """The largest ``system/peak_rss_gib`` (a training process's peak resident memory, GiB) logged by earlier runs of
    ``algorithms`` with the same environment and policy, whatever their status (a run killed for memory logged its
    growth before it died); None if none logged it."""
    peaks = [run.data.metrics["system/peak_rss_gib"]
             for run in _matching_runs(tracking_uri, experiment_name, algorithms, env_target, model, False)
             if "system/peak_rss_gib" in run.data.metrics]
    return max(peaks) if peaks else None


def machine_memory_gib() -> float:
    """Physical memory of this machine, GiB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def check_parallel_fits(parallel: int, peak_gib: float | None, total_gib: float) -> str:
    """The line to print about memory; raises ValueError when ``parallel`` runs of the measured peak do not fit in
    90% of ``total_gib`` (the rest for the environment workers and the system).

    Of two WebShop runs side by side on a 24 GB machine, one was killed for memory (at 10.9 GB) 16 minutes into a
    study; refusing before the first run costs nothing.
    """
    if peak_gib is None:
        return f"memory: no earlier run logged its peak; {parallel} run(s) side by side on {total_gib:.0f} GiB"
    fits = max(int(0.9 * total_gib // peak_gib), 1)
    if parallel > fits:
        raise ValueError(f"--parallel {parallel}: earlier runs of this experiment peaked at {peak_gib:.1f} GiB "
                         f"each (system/peak_rss_gib in MLflow), and {parallel} of them do not fit in 90% of this "
                         f"machine's {total_gib:.0f} GiB; expected --parallel {fits} or less")
    return f"memory: earlier runs peaked at {peak_gib:.1f} GiB each; {parallel} side by side fit in {total_gib:.0f} GiB"


def _thread_env(threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    # glibc raises its mmap threshold after large frees, so freed activation/logit buffers stay in the heap and a
    # run's resident memory creeps up (measured: 4.7 -> 8 GB over 8 WebShop iterations); a fixed threshold
    # returns buffers over 4 MiB to the system. It does not lower a run's peak: two WebShop runs still do not fit
    # in 24 GB (each peaks at 10–11 GiB in its updates), which check_parallel_fits refuses.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(4 << 20))
    if threads:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[var] = str(threads)
    return env


def run_all(commands: list[list[str]], parallel: int, threads: int | None) -> list[str]:
    """Run ``commands`` (``parallel`` at a time, each with ``threads`` threads); return the failed ones."""
    if parallel > 1 and threads is None:
        threads = 1
    env = _thread_env(threads)
    failed, pending, running = [], list(enumerate(commands)), {}
    start = time.perf_counter()
    while pending or running:
        while pending and len(running) < max(parallel, 1):
            i, cmd = pending.pop(0)
            print(f"[{i + 1}/{len(commands)}] start {' '.join(cmd[2:6])}", flush=True)
            running[i] = (subprocess.Popen(cmd, cwd=ROOT, env=env), time.perf_counter(), cmd)
        time.sleep(2.0)
        for i, (proc, t0, cmd) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[i]
            print(f"[{i + 1}/{len(commands)}] exit {proc.returncode} after {(time.perf_counter() - t0) / 60:.1f} "
                  f"min (study so far {(time.perf_counter() - start) / 60:.1f} min)", flush=True)
            if proc.returncode != 0:
                failed.append(" ".join(cmd[2:6]))
    return failed


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment", default="scienceworld", help="configs/experiment/<name> (default: %(default)s)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--iterations", type=int, default=4, help="training iterations per run (trainer.max_epochs)")
    ap.add_argument("--algorithms", nargs="+", default=["grpo", "empo2"], help="configs/algorithm/<name>")
    ap.add_argument("--study-id", default=time.strftime("%Y%m%d-%H%M%S"), help="tag suffix (default: now)")
    ap.add_argument("--minutes-per-iteration", type=float, default=None,
                    help="for the estimate when the store has no earlier run to measure")
    ap.add_argument("--out-dir", default=None, help="comparison output (default: logs/comparison/study-<id>)")
    ap.add_argument("--adaptation", nargs="+", default=[], help="adaptation summaries to add to the comparison")
    ap.add_argument("--parallel", type=int, default=1, help="runs side by side (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None,
                    help="threads per run (OMP/MKL/torch); default: all cores when --parallel 1, else 1")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and the estimate, run nothing")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run (after --)")
    return ap


def estimate_minutes(args: argparse.Namespace, tracking_uri: str, exp_name: str, env_target: str, model: str) -> float:
    """Print each algorithm's minutes per iteration (measured in the store, else the default) and its runs' total;
    return the study's estimated wall-clock minutes with ``args.parallel`` runs side by side."""
    env_key = "webshop" if "webshop" in env_target.lower() else "scienceworld"
    total = 0.0
    for algo in args.algorithms:
        measured = measured_minutes_per_iteration(tracking_uri, exp_name, algo, env_target, model)
        if measured:
            per_iter, source = measured[0], f"measured on {measured[1]} earlier finished run(s)"
        else:
            per_iter = args.minutes_per_iteration or DEFAULT_MINUTES_PER_ITERATION[env_key]
            source = ("--minutes-per-iteration" if args.minutes_per_iteration
                      else "no earlier run in the store: default, measured with SmolLM2 on a 2-core CPU")
        minutes = (STARTUP_MINUTES + per_iter * args.iterations) * len(args.seeds)
        total += minutes
        print(f"  {algo}: {per_iter:.1f} min/iteration ({source}) + {STARTUP_MINUTES} min start-up per run -> "
              f"{minutes:.0f} min for {len(args.seeds)} runs")
    return total / max(args.parallel, 1)  # optimistic: side-by-side runs each slow down somewhat


def main(argv: Sequence[str] | None = None) -> int:
    """Run the study (or print it with ``--dry-run``); return the number of failed training runs."""
    from src.models.rollout_engine import resolve_rollout_precision
    from src.utils.precision_choice import resolve_precision

    ap = _parser()
    args = ap.parse_args(argv)
    if args.iterations < 1:
        ap.error(f"--iterations={args.iterations}: expected at least 1")
    if len(set(args.seeds)) != len(args.seeds):
        ap.error(f"--seeds {args.seeds}: expected distinct seeds")
    cfg = compose(args.experiment, [f"algorithm={args.algorithms[0]}", *args.overrides])
    if "mlflow" not in (cfg.get("logger") or {}):
        ap.error("the comparison reads MLflow: do not override the logger (logger=mlflow is the default)")
    study_tag = f"study-{args.study_id}"
    tags = [*cfg.tags, study_tag]
    tracking_uri, exp_name = cfg.logger.mlflow.tracking_uri, cfg.logger.mlflow.experiment_name
    env_target, model = cfg.env._target_, cfg.model.policy.name_or_path
    commands = run_commands(args.experiment, args.algorithms, args.seeds, args.iterations, tags, args.overrides)

    print(f"Study {study_tag}: {len(commands)} runs ({', '.join(args.algorithms)} x seeds {args.seeds}), "
          f"{args.iterations} iterations each, {args.parallel} at a time; policy {model}; MLflow {tracking_uri}")
    total = estimate_minutes(args, tracking_uri, exp_name, env_target, model)
    print(f"Estimated total: {total:.0f} min" + (f" (~{total / 60:.1f} h)" if total >= 60 else ""))
    try:
        print(check_parallel_fits(args.parallel, measured_peak_rss_gib(tracking_uri, exp_name, args.algorithms,
                                                                       env_target, model), machine_memory_gib()))
    except ValueError as e:
        ap.error(str(e))
    for cmd in commands:
        print("  python src/train.py " + " ".join(cmd[2:]))
    out_dir = args.out_dir or str(ROOT / "logs" / "comparison" / study_tag)
    # every algorithm of the study, not only this invocation's: a study run in parts (--algorithms grpo now,
    # empo2 in another session) is compared whole
    compare_argv = ["--tracking-uri", tracking_uri, "--experiment", exp_name, "--tag", study_tag, "--out-dir",
                    out_dir, "--name", f"comparison-{study_tag}"]
    if args.adaptation:
        compare_argv += ["--adaptation", *args.adaptation]
    print("then: python scripts/compare_runs.py " + " ".join(compare_argv))
    if args.dry_run:
        return 0

    # the timed probes decide once, for every run (two runs of a study once chose fp32, then bf16 prefill): ROLLOUT
    trainer, rollout = resolve_precision(cfg), resolve_rollout_precision(cfg)
    print(f"precision of every run: trainer {trainer}, rollout {rollout}")
    commands = [[*(a for a in c if not a.startswith(ROLLOUT)), f"{ROLLOUT}{rollout}"] for c in commands]
    if cfg.model.get("warm_start"):
        print("\nwarm start: python src/sft.py " + " ".join([f"experiment={args.experiment}", *args.overrides]),
              flush=True)
        rc = subprocess.run([sys.executable, str(ROOT / "src" / "sft.py"), f"experiment={args.experiment}",
                             *args.overrides], cwd=ROOT).returncode
        if rc != 0:
            print(f"building the warm start failed (exit {rc})", file=sys.stderr)
            return len(commands)
    failed = run_all(commands, args.parallel, args.threads)
    if failed:
        print(f"{len(failed)} run(s) failed: {failed}; comparing the finished ones", file=sys.stderr)
    if len(failed) < len(commands):  # a process of its own: it reads the source as it is now, not at our start
        subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_runs.py"), *compare_argv], cwd=ROOT,
                       check=True)
    return len(failed)


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
