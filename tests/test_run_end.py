"""How a `src/train.py` run ends, through the real CLI (Hydra, logging, signals, MLflow's sqlite store): a refused
setting prints one message and creates no tracker run; a log dir that cannot be written is one line; a run killed by
SIGTERM mid-iteration ends KILLED (not RUNNING, not FAILED), its log names the last checkpoint and the command that
resumes from it, and that command resumes; a run that fails after its MLflow run exists ends FAILED; Lightning's INFO
lines are printed once."""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import torch

from cli_report import failure_report, run_cli
from stub_envs import STUB_ENV_VARS

ROOT = Path(__file__).resolve().parents[1]
# tiny policy and the stub environment (2-step episodes), one optimizer step per iteration, MLflow tracking
RUN = ["experiment=scienceworld", "debug=default", "logger=mlflow", "trainer.precision=32-true",
       "env._target_=stub_envs.StubEnv", "+env.reward_per_char=0.01", "env.max_steps=2", "data.val=null",
       "data.num_mini_batches=1",
       "trainer.check_val_every_n_epoch=null", "algorithm=grpo", "~callbacks.rich_progress_bar",
       "trainer.enable_progress_bar=false", "log_checkpoint_artifact=false",
       "model.policy.rollout_precision=trainer"]  # as tests/conftest.py pins it in this process


def _runs(log_dir: Path) -> list:
    db = log_dir / "mlflow.db"
    if not db.exists():
        return []
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{db}")
    experiment = client.get_experiment_by_name("empo2")
    return client.search_runs([experiment.experiment_id]) if experiment else []


def test_a_refused_setting_prints_its_message_alone_and_creates_no_run(tmp_path):
    proc = run_cli(["src/train.py", *RUN, f"paths.log_dir={tmp_path}", "data.group_size=1",
                    "model.optimizer.lr=-0.001", f"hydra.run.dir={tmp_path / 'run'}"],
                   env={**STUB_ENV_VARS, "HYDRA_FULL_ERROR": ""}, timeout=300)
    assert not (tmp_path / "run").exists()  # no run directory is left behind
    assert proc.returncode != 0
    assert "data.group_size=1: GRPO's advantage compares the episodes" in proc.stderr
    assert "model.optimizer.lr=-0.001: expected a learning rate > 0" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout, failure_report(proc)
    assert _runs(tmp_path) == []  # refused before any tracker run was made


def test_a_log_dir_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    proc = run_cli(["src/train.py", *RUN, f"paths.log_dir={tmp_path / 'a_file' / 'logs'}"], env=STUB_ENV_VARS,
                   timeout=300)
    assert proc.returncode != 0
    assert re.search(r"paths.log_dir='.*a_file/logs': the run cannot write there \(\w+Error", proc.stderr), \
        failure_report(proc)
    assert "Traceback" not in proc.stderr, failure_report(proc)


def _last_step(path: Path) -> int | None:
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])
    except Exception:  # not there yet, or being replaced
        return None


def test_sigterm_mid_run_ends_killed_and_the_logged_command_resumes(tmp_path):
    run_dir = tmp_path / "run"
    args = ["src/train.py", *RUN, "trainer.max_epochs=6", f"paths.log_dir={tmp_path / 'logs'}",
            f"hydra.run.dir={run_dir}"]
    env = {**os.environ, **STUB_ENV_VARS}
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    last = run_dir / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline and (_last_step(last) or 0) < 2:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # iteration 2 (or 3) is running
    output = proc.communicate(timeout=120)[0]
    assert "\x1b[" not in output  # no colour codes where the output is not a terminal: the command pastes as it reads
    assert proc.returncode != 0, output[-3000:]
    saved = _last_step(last)
    assert saved is not None and 2 <= saved < 6, output[-3000:]
    [run] = _runs(tmp_path / "logs")
    assert run.info.status == "KILLED" and run.info.end_time is not None
    assert (run_dir / "train.log").read_text().count("GPU available:") == 1  # Lightning's INFO lines once, not twice
    assert "GPU available:" not in output  # the console shows warnings and the lines marked for it
    match = re.search(r"The last checkpoint is (\S+) \(iteration (\d+), global step (\d+)\)\. Resume with:\n\s+(.+)",
                      output)
    assert match, output[-3000:]
    assert Path(match.group(1)) == last and int(match.group(3)) == saved and int(match.group(2)) == saved - 1
    command = shlex.split(match.group(4))
    assert command[:2] == ["python", "src/train.py"] and command[-1] == f"ckpt_path={last}"
    assert command[-2] == f"+logger.mlflow.run_id={run.info.run_id}"  # the curves continue in the same run
    resumed = run_cli([*command[1:], f"hydra.run.dir={tmp_path / 'resumed'}"], env=STUB_ENV_VARS)
    assert resumed.returncode == 0, failure_report(resumed)
    assert _last_step(tmp_path / "resumed" / "checkpoints" / "last.ckpt") == 6
    [run] = _runs(tmp_path / "logs")
    assert run.info.status == "FINISHED"


def test_a_failure_after_the_run_is_made_ends_it_failed(tmp_path):
    """An error inside fit (here a crash injected in iteration 0) leaves the MLflow run FAILED with an end time and
    the log says there is no checkpoint to resume from."""
    proc = run_cli(["src/train.py", *RUN, "trainer.max_epochs=2", f"paths.log_dir={tmp_path}",
                    "+callbacks.crash._target_=probes.CrashAtIteration", "+callbacks.crash.iteration=0",
                    f"hydra.run.dir={tmp_path / 'run'}"], env=STUB_ENV_VARS)
    assert proc.returncode != 0
    assert "injected crash in iteration 0" in proc.stderr
    assert "This run wrote no checkpoint" in proc.stdout + proc.stderr, failure_report(proc)
    [run] = _runs(tmp_path)
    assert run.info.status == "FAILED" and run.info.end_time is not None
    # why it failed, in its log and on its tracker run
    error = "RuntimeError: injected crash in iteration 0 at global step 1"
    assert error in (tmp_path / "run" / "train.log").read_text() and run.data.tags["error"] == error


def test_a_run_whose_process_is_gone_is_marked_failed_at_the_next_start(tmp_path):
    """A run killed with SIGKILL stays RUNNING in MLflow; the next run on this host finds its process gone (tags host
    and pid) and marks it FAILED, saying why; a RUNNING run of a live process is left alone."""
    import socket

    dead = subprocess.Popen(["true"])
    dead.wait()
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.create_experiment("empo2", artifact_location=str(tmp_path / "mlartifacts"))
    stale = client.create_run(experiment, tags={"host": socket.gethostname(), "pid": str(dead.pid)}).info.run_id
    alive = client.create_run(experiment, tags={"host": socket.gethostname(), "pid": str(os.getpid())}).info.run_id
    proc = run_cli(["src/train.py", *RUN, "trainer.max_epochs=1", f"paths.log_dir={tmp_path}"], env=STUB_ENV_VARS)
    assert proc.returncode == 0, failure_report(proc)
    assert client.get_run(stale).info.status == "FAILED"
    assert f"its process {dead.pid}" in client.get_run(stale).data.tags["error"]
    assert client.get_run(alive).info.status == "RUNNING"
    assert f"MLflow run {stale}" in proc.stdout + proc.stderr
