"""What a resumed run may change (src/config_checks.py ``check_resume_settings``): a new learning rate is the one it
trains with, and a checkpoint resumed under another algorithm or environment is refused before anything is built,
naming each setting with its checkpoint value and its new value."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from src.train import train

ROOT = Path(__file__).resolve().parents[1]


def _cfg(tmp: Path, *overrides: str):
    base = ["experiment=scienceworld", "model=tiny", "model.warm_start=null", f"paths.output_dir={tmp}/run",
            f"paths.log_dir={tmp}/logs", "logger=csv", "trainer.precision=32-true", "data.tasks_per_iteration=1",
            "data.group_size=2", "env.max_steps=2", "data.micro_batch_size=2", "data.num_mini_batches=1",
            "data.val=null", "trainer.check_val_every_n_epoch=null", "data.max_response_tokens=4",
            "memory.tip_max_tokens=4", "algorithm.entropy_coef=0.01", "~callbacks.rich_progress_bar",
            "trainer.enable_progress_bar=false"]
    if any(o.startswith("experiment=") for o in overrides):  # another experiment in place of ScienceWorld's
        base = base[1:]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="train", overrides=base + list(overrides))


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """One EMPO² iteration at the experiment's lr 2e-5, its last.ckpt."""
    tmp = tmp_path_factory.mktemp("resume")
    objs = train(_cfg(tmp / "a", "trainer.max_epochs=1"))
    return {"ckpt": objs["last_checkpoint"], "tmp": tmp}


def test_a_resumed_run_trains_at_the_learning_rate_asked_for(first_run):
    ckpt = torch.load(first_run["ckpt"], map_location="cpu", weights_only=True)
    assert ckpt["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(2e-5)
    assert ckpt["run_config"]["model"]["optimizer"]["lr"] == pytest.approx(2e-5)  # the settings travel with it
    objs = train(_cfg(first_run["tmp"] / "b", "trainer.max_epochs=2", f"ckpt_path={first_run['ckpt']}",
                      "model.optimizer.lr=1e-3"))
    assert [g["lr"] for g in objs["trainer"].optimizers[0].param_groups] == [1e-3]
    rows = list(csv.DictReader(open(next(Path(objs["trainer"].default_root_dir).glob("csv/*/metrics.csv")))))
    logged = [float(r["train/lr"]) for r in rows if r.get("train/lr")]
    assert logged and logged[-1] == pytest.approx(1e-3)  # the update after the resume ran at the new rate


@pytest.mark.parametrize("overrides, expected", [
    (["algorithm=grpo"], ["algorithm.name: 'empo2' in the checkpoint, 'grpo' now",
                          "algorithm.use_memory: True in the checkpoint, False now"]),
    (["experiment=coin"], ["env._target_: 'src.envs.scienceworld.ScienceWorldEnv' in the checkpoint, "
                           "'src.envs.textworld_express.TextWorldExpressEnv' now"]),
    (["memory.partition=global"], ["memory.partition: 'variation' in the checkpoint, 'global' now"]),
], ids=["algorithm", "environment", "memory-layout"])
def test_a_resume_under_another_algorithm_or_environment_is_refused(first_run, monkeypatch, overrides, expected):
    import src.train
    from src.utils.config_error import ConfigError

    monkeypatch.setattr(src.train, "build", lambda cfg: pytest.fail("the run was built"))
    with pytest.raises(ConfigError) as err:
        train(_cfg(first_run["tmp"] / "c", "trainer.max_epochs=2", f"ckpt_path={first_run['ckpt']}", *overrides))
    for part in expected:
        assert part in str(err.value)
    assert "env.max_steps" not in str(err.value)  # a setting that may change is not named
