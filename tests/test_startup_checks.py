"""Start-up checks of a training run: refused Lightning options, gold paths over the action cap, stale checkpoint
temp files left by a killed save."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from src.envs.scienceworld_tasks import TASK_NAMES, default_max_steps
from src.envs.scienceworld_gold_lengths import GOLD_PATH_LENGTHS, warn_gold_paths_over_cap
from src.train import train
from src.utils.startup_checks import clean_checkpoint_dirs

ROOT = Path(__file__).resolve().parents[1]


def _cfg(tmp_path: Path, *overrides: str):
    base = ["experiment=scienceworld", "model=tiny", f"paths.output_dir={tmp_path}/run",
            f"paths.log_dir={tmp_path}/logs"]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="train", overrides=base + list(overrides))


@pytest.mark.parametrize("override, reason", [
    ("+trainer.limit_train_batches=1", "limit_train_batches=1: one Lightning epoch is one training iteration"),
    ("+trainer.limit_train_batches=0.5", "a run of 0 updates"),
    ("+trainer.val_check_interval=3", "check_val_every_n_epoch"),
    ("+trainer.max_steps=4", r"data.num_mini_batches = 2 optimizer steps.*trainer.max_epochs=2\)"),
])
def test_batch_level_trainer_options_are_refused_at_start_up(tmp_path, override, reason):
    cfg = _cfg(tmp_path, override, "data.num_mini_batches=2")
    with pytest.raises(ValueError, match=reason):
        train(cfg)
    assert not (tmp_path / "run").exists()  # refused before anything was built or written


def test_gold_paths_longer_than_the_cap_are_warned_about(tmp_path, caplog):
    assert set(GOLD_PATH_LENGTHS) == set(TASK_NAMES)
    over = sorted(t for t, (_, longest) in GOLD_PATH_LENGTHS.items() if longest > default_max_steps(t))
    assert "mendelian-genetics-known-plant" in over and "inclined-plane-friction-unnamed-surfaces" in over
    assert "boil" not in over and "find-non-living-thing" not in over
    with caplog.at_level(logging.WARNING):
        # the CPU experiment caps find-non-living-thing (gold paths of 3-7 actions) at 6
        assert len(warn_gold_paths_over_cap(_cfg(tmp_path).env)) == 1
    assert "'find-non-living-thing'" in caplog.text and "3-7 actions" in caplog.text and "cap is 6" in caplog.text
    messages = warn_gold_paths_over_cap(_cfg(tmp_path, "env.task=[mendelian-genetics-known-plant,boil]",
                                             "env.max_steps=null").env)
    assert len(messages) == 1 and "mendelian-genetics-known-plant" in messages[0] and "cap is 30" in messages[0]
    assert warn_gold_paths_over_cap(_cfg(tmp_path, "env.task=boil", "env.max_steps=null").env) == []
    assert warn_gold_paths_over_cap(_cfg(tmp_path, "experiment=webshop").env) == []


_KILLED_SAVE = """
import os, signal, sys
import torch
from src.utils.checkpoint_io import AtomicCheckpointIO

# SIGKILL once the checkpoint bytes are written and before the rename (the moment is chosen by killing at fsync)
os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
AtomicCheckpointIO().save_checkpoint({"weights": torch.zeros(1_000_000)}, sys.argv[1])
"""


def test_temp_file_of_a_killed_checkpoint_save_is_removed_at_start_up(tmp_path):
    ckpt_dir = tmp_path / "run" / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    (ckpt_dir / "last.ckpt").write_bytes(b"previous checkpoint")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, str(ckpt_dir / "last.ckpt")], cwd=ROOT,
                            stderr=subprocess.PIPE)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, stderr.decode()[-2000:]
    stale = ckpt_dir / f".last.ckpt.tmp{proc.pid}"
    assert stale.stat().st_size > 4_000_000  # what a killed save leaves behind; last.ckpt is intact
    live = ckpt_dir / f".iter_0001.ckpt.tmp{os.getpid()}"  # a save in progress of a live process: kept
    live.write_bytes(b"partial")

    removed = clean_checkpoint_dirs(_cfg(tmp_path, f"ckpt_path={ckpt_dir}/last.ckpt"))
    assert removed == [stale] and not stale.exists() and live.exists()
    assert (ckpt_dir / "last.ckpt").read_bytes() == b"previous checkpoint"


def _fake_checkpoint(path: Path) -> Path:
    """A file with what a src/train.py checkpoint holds at the top (global step, policy.* weights)."""
    import torch

    torch.save({"epoch": 0, "global_step": 2, "pytorch-lightning_version": "2.6.6",
                "state_dict": {"policy.model.lm_head.weight": torch.zeros(64, 64)}}, path)
    return path


def test_a_truncated_checkpoint_is_refused_at_start_up_naming_the_file(tmp_path):
    """A last.ckpt cut short (a copy or save killed half-way) fails at start-up naming the file, not after the whole
    build with torch's 'PytorchStreamReader failed reading zip archive'."""
    ckpt = _fake_checkpoint(tmp_path / "last.ckpt")
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"ckpt_path='{ckpt}' is not a complete checkpoint.*{len(data) // 2} bytes"):
        train(_cfg(tmp_path, f"ckpt_path={ckpt}", "model.warm_start=null"))
    assert not (tmp_path / "run").exists()  # refused before anything was built or written


def test_ckpt_path_must_be_a_checkpoint_of_this_project(tmp_path, monkeypatch):
    import torch

    from src.utils.startup_checks import check_checkpoint_path

    good = _fake_checkpoint(tmp_path / "iter_0001.ckpt")
    assert check_checkpoint_path(_cfg(tmp_path, f"ckpt_path={good}")) == good
    monkeypatch.chdir(tmp_path)  # a relative path is taken from where the command runs
    assert check_checkpoint_path(_cfg(tmp_path, "ckpt_path=iter_0001.ckpt")) == good
    with pytest.raises(FileNotFoundError, match=r"ckpt_path='nope/last.ckpt' \(.*nope/last.ckpt\) does not exist"):
        check_checkpoint_path(_cfg(tmp_path, "ckpt_path=nope/last.ckpt"))
    torch.save({"weights": torch.zeros(3)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"'.*other.pt' is a torch file but not a checkpoint of this project"):
        check_checkpoint_path(_cfg(tmp_path, f"ckpt_path={tmp_path / 'other.pt'}"))
    sharded = tmp_path / "fsdp" / "last.ckpt"  # trainer=fsdp writes a directory per checkpoint
    sharded.mkdir(parents=True)
    with pytest.raises(ValueError, match=r"directory without a \.metadata file"):
        check_checkpoint_path(_cfg(tmp_path, f"ckpt_path={sharded}"))
    (sharded / ".metadata").write_bytes(b"")
    with pytest.raises(ValueError, match=r"distributed checkpoint without Lightning's meta\.pt"):
        check_checkpoint_path(_cfg(tmp_path, f"ckpt_path={sharded}"))
    (sharded / "meta.pt").write_bytes(b"")
    assert check_checkpoint_path(_cfg(tmp_path, f"ckpt_path={sharded}")) == sharded


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a GPU")
def test_a_gpu_trainer_without_a_gpu_says_how_to_run_on_the_cpu(tmp_path):
    """trainer=fsdp (accelerator gpu) on a machine without a GPU: not Lightning's bare 'No supported gpu backend
    found!' after the model is built, but the overrides that run it on the CPU."""
    with pytest.raises(ValueError, match=r"trainer.accelerator=gpu.*no GPU.*"
                                         r"trainer.accelerator=cpu trainer.devices=1 trainer.precision=32-true"):
        train(_cfg(tmp_path, "trainer=fsdp", "model.warm_start=null"))
    assert not (tmp_path / "run").exists()
