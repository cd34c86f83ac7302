"""What a resume, an evaluation or an export is refused before anything is built: a checkpoint whose bytes changed,
whose weights are not finite, that holds pickled objects or is an exported agent; a resume that would train nothing;
a tracker run of another algorithm, a live one or one past the checkpoint; a run directory another run uses."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient

import src.train
from src.evaluation.runner import run_eval
from src.model_export import run_export
from src.train import train
from src.utils.config_error import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def _cfg(tmp_path: Path, config: str, *overrides: str):
    base = ["experiment=scienceworld", "model=tiny", "model.warm_start=null", f"paths.output_dir={tmp_path}/run",
            f"paths.log_dir={tmp_path}/logs"]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name=config, overrides=base + list(overrides))


def _checkpoint(path: Path, weight: torch.Tensor | None = None, iteration: int = 2) -> Path:
    weight = torch.zeros(64, 64) if weight is None else weight
    torch.save({"epoch": iteration, "global_step": 2 * (iteration + 1), "iteration": iteration,
                "pytorch-lightning_version": "2.6.6", "state_dict": {"policy.model.lm_head.weight": weight}}, path)
    return path


@pytest.fixture
def unbuilt(monkeypatch):
    """Training stops where it would build the run: the checks before it passed."""
    class Built(Exception):
        pass

    monkeypatch.setattr(src.train, "build", lambda cfg: (_ for _ in ()).throw(Built()))
    return Built


def _refused_everywhere(tmp_path: Path, ckpt: Path, message: str) -> None:
    """train, eval and export each refuse ``ckpt`` with ``message``, in one line, before building anything."""
    for config, run in (("train", train), ("eval", run_eval), ("export", run_export)):
        extra = [f"export.out_dir={tmp_path / 'agent'}"] if config == "export" else []
        with pytest.raises(ConfigError, match=message) as err:
            run(_cfg(tmp_path, config, f"ckpt_path={ckpt}", *extra))
        assert "\n" not in str(err.value), config
    assert not (tmp_path / "agent").exists() and not (tmp_path / "logs").exists()


def test_a_noise_corrupted_checkpoint_is_refused_by_train_eval_and_export(tmp_path, unbuilt):
    ckpt = _checkpoint(tmp_path / "last.ckpt", torch.randn(64, 64))
    data = bytearray(ckpt.read_bytes())
    middle = len(data) // 2  # inside the 16 KiB of the weight's record
    data[middle - 2048: middle + 2048] = os.urandom(4096)
    ckpt.write_bytes(bytes(data))
    torch.load(ckpt, map_location="cpu", mmap=True, weights_only=True)  # torch itself loads it without a word
    _refused_everywhere(tmp_path, ckpt, r"ckpt_path='.*last.ckpt' is corrupt: its record \S+/data/0 differs from what "
                                        r"torch.save wrote \(CRC-32 mismatch")


def test_a_checkpoint_with_nan_weights_is_refused_when_loaded(tmp_path, unbuilt):
    weight = torch.zeros(64, 64)
    weight[3, 5] = float("nan")
    ckpt = _checkpoint(tmp_path / "last.ckpt", weight)
    _refused_everywhere(tmp_path, ckpt, r"holds NaN or inf in 1 policy weights \(e.g. policy.model.lm_head.weight\)")


def test_pickled_objects_and_an_exported_agent_are_named_as_such(tmp_path, unbuilt):
    pickled = tmp_path / "pickled.ckpt"
    torch.save({"global_step": 1, "state_dict": {}, "callback": socket.AF_INET}, pickled)
    _refused_everywhere(tmp_path, pickled, r"holds pickled Python objects besides tensors and plain values")
    agent = tmp_path / "exported"
    agent.mkdir()
    (agent / "export_info.json").write_text("{}")
    _refused_everywhere(tmp_path, agent, rf"is an exported agent, not a training checkpoint: evaluate it with "
                                         rf"ckpt_path=null model.policy.name_or_path={agent}")


def test_a_resume_that_would_train_nothing_is_refused(tmp_path, unbuilt):
    ckpt = _checkpoint(tmp_path / "iter_0002.ckpt", iteration=2)  # iterations 0, 1, 2 trained
    with pytest.raises(ConfigError, match=r"trainer.max_epochs=3, but ckpt_path='.*' has trained 3 iterations "
                                          r"already: the resume would train nothing. Set trainer.max_epochs above 3"):
        train(_cfg(tmp_path, "train", f"ckpt_path={ckpt}", "trainer.max_epochs=3"))
    with pytest.raises(unbuilt):
        train(_cfg(tmp_path, "train", f"ckpt_path={ckpt}", "trainer.max_epochs=4"))


def _tracker_run(store: Path, algorithm: str, *, steps: int = 3, live: bool = False) -> str:
    """A run in a real MLflow store as ``log_config`` and the iterations leave it."""
    client = MlflowClient(f"sqlite:///{store}")
    experiment = client.get_experiment_by_name("empo2") or client.get_experiment(client.create_experiment("empo2"))
    run = client.create_run(experiment.experiment_id)
    run_id = run.info.run_id
    client.log_param(run_id, "algorithm/name", algorithm)
    client.log_param(run_id, "env/_target_", "src.envs.scienceworld.ScienceWorldEnv")
    for step in range(steps):
        client.log_metric(run_id, "rollout/score", 0.1 * step, step=step)
    client.set_tag(run_id, "host", socket.gethostname())
    client.set_tag(run_id, "pid", str(os.getppid() if live else 2 ** 22 + 17))  # a live process / none
    if not live:
        client.set_terminated(run_id, "KILLED")
    return run_id


def test_a_resume_into_a_tracker_run_checks_its_algorithm_liveness_and_last_step(tmp_path, unbuilt):
    (tmp_path / "logs").mkdir()
    store = tmp_path / "logs" / "mlflow.db"
    ckpt = _checkpoint(tmp_path / "iter_0002.ckpt", iteration=2)
    resume = ["train", f"ckpt_path={ckpt}", "trainer.max_epochs=5"]
    cases = [(_tracker_run(store, "grpo"), r"logged algorithm.name='grpo', this run has algorithm.name='empo2': its "
                                           r"curves would mix two runs"),
             (_tracker_run(store, "empo2", live=True), rf"is live: process {os.getppid()} on this host is logging"),
             (_tracker_run(store, "empo2", steps=10), r"has logged iterations up to 9, but ckpt_path='.*' ends at "
                                                      r"iteration 2: iterations 3-9 would be logged twice")]
    for run_id, message in cases:
        with pytest.raises(ConfigError, match=rf"\+logger.mlflow.run_id={run_id} {message}") as err:
            train(_cfg(tmp_path, *resume, f"+logger.mlflow.run_id={run_id}"))
        assert "\n" not in str(err.value)
    with pytest.raises(unbuilt):  # its own run, stopped during iteration 3: continued
        train(_cfg(tmp_path, *resume, f"+logger.mlflow.run_id={_tracker_run(store, 'empo2', steps=4)}"))


def test_a_run_directory_holding_a_run_is_not_shared(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "train.log").write_text("the first run's log\n")
    proc = subprocess.run([sys.executable, "src/train.py", "experiment=smoke", f"paths.log_dir={tmp_path / 'logs'}",
                           f"hydra.run.dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"hydra.run.dir='{run_dir}' already holds a run (checkpoints, train.log): two runs in one directory mix their "
        "checkpoints, tips and logs. Choose a new directory (or leave hydra.run.dir unset); to continue that run, "
        f"resume from its checkpoint: ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}"]
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "train.log"]  # nothing written into it
    assert (run_dir / "train.log").read_text() == "the first run's log\n"


SAVE_WITH_A_FILE_SIZE_CAP = """
import resource, signal, sys, torch
from src.utils.checkpoint_io import AtomicCheckpointIO
from src.utils.config_error import RunError
path = sys.argv[1]
io = AtomicCheckpointIO()
io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.zeros(1000)}}, path)  # the previous checkpoint
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the cap fails (EFBIG), as on a full disk (ENOSPC)
resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))
try:
    io.save_checkpoint({"global_step": 2, "state_dict": {"w": torch.zeros(2**20)}}, path)  # 4 MiB
except RunError as err:
    print(err)
"""


def test_a_checkpoint_the_disk_cannot_hold_keeps_the_previous_one_and_says_the_space_needed(tmp_path):
    path = tmp_path / "last.ckpt"
    proc = subprocess.run([sys.executable, "-c", SAVE_WITH_A_FILE_SIZE_CAP, str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [line] = proc.stdout.strip().splitlines()
    assert re.fullmatch(rf"The checkpoint {path} could not be written \(RuntimeError: .*\); it needs about 4.0 MiB "
                        r"and its disk has [\d.]+ [MG]iB free; the previous one there is kept\. Free space .* and resume "
                        r"from the last checkpoint", line), line
    assert torch.load(path, weights_only=True)["global_step"] == 1  # intact
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary file left
