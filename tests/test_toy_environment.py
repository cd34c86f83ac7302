"""A new environment needs one file and one config (docs/extending.md): this file defines a toy environment and
nothing under src/ knows of it, yet training (with the imitation warm start and its reflection phase), the
adaptation protocol of src/eval.py and scripts/compare_runs.py run through it."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from src.envs.base import Environment, replay
from studies.episode_table import read_rows

ROOT = Path(__file__).resolve().parents[1]
CELLS = 4


class KeyCorridor(Environment):
    """A corridor of ``CELLS`` cells; the key lies in cell ``variation % CELLS``; ``right``/``left`` move, ``take key``
    ends the episode (score 1 where the key is, else 0)."""

    display_name = "Key corridor"
    score_unit = "score in [0, 1]"
    max_score = 1.0
    novelty_coef = 0.05
    bare_command = re.compile(r"(?:left|right|take key)")
    system_prompt = "You walk a corridor to find a key. Reply with one action: left, right or take key."

    def __init__(self, max_steps: int = 4, seed: int | None = None) -> None:
        self.max_steps = max_steps
        self.cell = self.key = self.steps = 0
        self.variation = 0

    def tasks(self, split: str) -> list[dict[str, Any]]:
        first = {"train": 0, "dev": 50, "test": 100}[split]
        return [{"task_name": "corridor", "variation": v} for v in range(first, first + 4)]

    def reset(self, task: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        self.variation, self.cell, self.steps = int(task["variation"]), 0, 0
        self.key = self.variation % CELLS
        return self._look(), self._info("", True, 0.0, False)

    def _look(self) -> str:
        return f"You are in cell {self.cell}." + (" A key lies here." if self.cell == self.key else "")

    def step(self, response: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        action = response.strip().lower()
        self.steps += 1
        valid = action in ("left", "right", "take key")
        if action in ("left", "right"):
            self.cell = min(max(self.cell + (1 if action == "right" else -1), 0), CELLS - 1)
        done = action == "take key"
        score = float(done and self.cell == self.key)
        info = self._info(action, valid, score, bool(score))
        return self._look(), score, done, not done and self.steps >= self.max_steps, info

    def _info(self, action: str, valid: bool, score: float, success: bool) -> dict[str, Any]:
        return {"score": score, "max_score": 1.0, "success": success, "won": success, "valid_action": valid,
                "action": action, "task_id": "corridor", "variation": self.variation,
                "instruction": "Find the key and take it.", "steps": self.steps}

    def demonstrations(self, tasks, env_cfg, data_dir):
        return [replay(self, t, ["right"] * (t["variation"] % CELLS) + ["take key"]) for t in tasks]

    def reflection_records(self, tasks, env_cfg, data_dir):
        return self.demonstrations(tasks, env_cfg, data_dir) + [replay(self, t, ["left"] * 4) for t in tasks]

    @staticmethod
    def hindsight_tip(record: dict[str, Any]) -> list[str]:
        seen = "the key" if any("key lies" in o for o in record["observations"]) else "no key"
        return [f"Score {record['score']:g}: I saw {seen}.", "Go right until the key lies here, then take key."]


ENV = {"_target_": "test_toy_environment.KeyCorridor", "max_steps": 4}


def _compose(config: str, tmp: Path, *overrides: str):
    base = ["model=tiny", "warm_start=imitation", "model.warm_start.epochs=1", "model.warm_start.num_tasks=4",
            "+model.warm_start.reflections={max_tokens: 8, continue_last_prompt: true, epochs: 1, lr: 1.0e-4, rehearsal: 0.5, show_tips: true}",
            f"paths.output_dir={tmp}/out", f"paths.log_dir={tmp}/logs", f"paths.data_dir={tmp}/data",
            "trainer.precision=32-true", "data.max_response_tokens=4", "memory.tip_max_tokens=8",
            "data.tasks_per_iteration=1", "data.group_size=2", "data.micro_batch_size=2", "data.val.num_tasks=2"]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name=config, overrides=base + list(overrides))
    with open_dict(cfg):
        cfg.env = OmegaConf.create(ENV)  # no config file either: the whole environment is this test file
    return cfg


@pytest.mark.slow  # ~80 s on 2 cores: trains, adapts and compares
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_toy_environment_trains_adapts_and_compares_without_changes_under_src(tmp_path):
    from scripts import compare_runs
    from src.evaluation.runner import run_eval
    from src.train import train

    cfg = _compose("train", tmp_path, "trainer.max_epochs=2", "trainer.check_val_every_n_epoch=2",
                   "~callbacks.rich_progress_bar", "trainer.enable_progress_bar=false")
    objs = train(cfg)
    ckpt = objs["last_checkpoint"]
    # the warm start imitated the toy's demonstrations and its reflections, then RL ran two iterations
    assert list((tmp_path / "data" / "models" / "warm_start").glob("keycorridor-*")), "no warm start was built"
    assert objs["trainer"].current_epoch == 2

    summary = run_eval(_compose("eval", tmp_path / "eval", "eval.protocol=adaptation", "eval.trials=2",
                                "eval.control=true", f"ckpt_path={ckpt}", "logger=none"))
    assert summary["protocol"] == "adaptation" and [t["trial"] for t in summary["trials"]] == [0, 1, 2]
    assert summary["weights_unchanged"] is True and len(summary["paired"]) == 3  # the memory-off control ran too

    run_id = objs["trainer"].logger.run_id
    result = compare_runs.main(["--tracking-uri", f"sqlite:///{tmp_path}/logs/mlflow.db", "--run-ids", run_id,
                                "--out-dir", str(tmp_path / "cmp"), "--no-log",
                                "--adaptation", str(tmp_path / "eval" / "out" / "eval_summary.json")])
    report = json.loads((tmp_path / "cmp" / "curves.json").read_text())
    assert report["env"] == "Key corridor" and "adaptation.png" in {f.name for f in result["files"]}
    assert "score in [0, 1]" in (tmp_path / "cmp" / "results.md").read_text()
    # the validation's episodes, one row each, came back from the run's MLflow artifact for paired differences
    copied = list((tmp_path / "cmp" / "episodes").glob("*.csv"))
    assert [f.name.split("-seed")[0] for f in copied] == [cfg.algorithm.name]
    rows = read_rows(copied[0])
    assert [r["iteration"] for r in rows] == [2] * len(rows) and len(rows) == objs["datamodule"].data.val.num_tasks
    assert rows == read_rows(Path(objs["trainer"].default_root_dir) / "validation_episodes.csv")
