"""``src/checkpoint_settings.py``: which settings an evaluation or export takes from the checkpoint's training run
and which stay the command's (known answers on a hand-made config)."""
from __future__ import annotations

from omegaconf import OmegaConf

from src.checkpoint_settings import apply_run_config

COMPOSED = {  # what src/eval.py composed: its own defaults and the command line's values
    "paths": {"data_dir": "/here/data"},
    "env": {"task": "boil", "max_steps": 30, "data_dir": "${paths.data_dir}/webshop", "num_train_variations": 5},
    "data": {"max_steps": "${env.max_steps}", "temperature": 1.0, "val": {"num_tasks": 20}},
    "model": {"policy": {"name_or_path": "embedded:SmolLM2-135M-Instruct", "lora": {"enabled": False},
                         "rollout_precision": "auto"}},
    "memory": {"partition": "variation"},
    "algorithm": {"name": "empo2"},
    "eval": {"num_tasks": "${data.val.num_tasks}", "seeds": [0]},
}
SAVED = {  # the training run's resolved config, as its checkpoint holds it
    "paths": {"data_dir": "/there/data"},
    "env": {"task": "find-non-living-thing", "max_steps": 3, "data_dir": "/there/data/webshop",
            "num_train_variations": 5, "seed": None},
    "data": {"max_steps": 3, "temperature": 0.7, "val": {"num_tasks": 1}},
    "model": {"policy": {"name_or_path": "embedded:tiny-random-llama", "lora": {"enabled": False},
                         "rollout_precision": "bf16"}},  # what the training machine resolved auto to
    "memory": {"partition": "task"},
    "algorithm": {"name": "empo2_authors"},
    "eval": {"num_tasks": 99},
}


def _apply(keys=(), groups=()):
    cfg = OmegaConf.create(COMPOSED)
    changed = apply_run_config(cfg, SAVED, set(keys), set(groups))
    return cfg, changed


def test_the_training_runs_settings_replace_the_composed_ones():
    cfg, changed = _apply()
    assert cfg.model.policy.name_or_path == "embedded:tiny-random-llama" and cfg.memory.partition == "task"
    assert (cfg.env.task, cfg.env.max_steps, cfg.algorithm.name) == ("find-non-living-thing", 3, "empo2_authors")
    assert cfg.data.max_steps == 3 and OmegaConf.to_container(cfg.data)["max_steps"] == "${env.max_steps}"  # follows
    assert cfg.eval.num_tasks == 1  # eval.* is the command's own group, its interpolation reads the run's data.val
    assert cfg.env.data_dir == "/here/data/webshop"  # a directory of this machine stays
    assert "seed" not in cfg.env  # a setting the code no longer has is left out
    assert cfg.model.policy.rollout_precision == "auto"  # this machine measures its own choice
    assert sorted(changed) == ["algorithm.name", "data.temperature", "data.val.num_tasks", "env.max_steps",
                               "env.task", "memory.partition", "model.policy.name_or_path"]


def test_the_command_lines_keys_and_groups_win():
    cfg, changed = _apply(keys={"env.max_steps"}, groups={"model"})
    assert cfg.env.max_steps == 30 and cfg.data.max_steps == 30  # the override, and what follows it
    assert cfg.model.policy.name_or_path == "embedded:SmolLM2-135M-Instruct"  # model= named on the command line
    assert cfg.env.task == "find-non-living-thing" and "env.max_steps" not in changed


def test_a_followed_setting_the_run_had_set_apart_takes_the_runs_value():
    saved = {**SAVED, "data": {**SAVED["data"], "max_steps": 5}}  # the run overrode data.max_steps itself
    cfg = OmegaConf.create(COMPOSED)
    apply_run_config(cfg, saved, set(), set())
    assert cfg.env.max_steps == 3 and cfg.data.max_steps == 5


def test_the_real_eval_config_follows_the_command_lines_action_cap(tmp_path):
    """``python src/eval.py ckpt_path=<smoke run> env.max_steps=2``: the composed eval config (no experiment) and a
    training run that capped episodes at 3; the prompt's budget (``data.max_steps``) is the command's 2."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    root = Path(__file__).resolve().parents[1]
    with initialize_config_dir(config_dir=str(root / "configs"), version_base="1.3"):
        saved = OmegaConf.to_container(compose(config_name="train", overrides=[
            "experiment=smoke", f"paths.output_dir={tmp_path}", f"paths.log_dir={tmp_path}"]), resolve=True)
        cfg = compose(config_name="eval", overrides=["env.max_steps=2", f"paths.output_dir={tmp_path}"])
    apply_run_config(cfg, saved, {"env.max_steps"}, set())
    assert (cfg.env.max_steps, cfg.data.max_steps) == (2, 2)
    assert cfg.model.policy.name_or_path == "embedded:tiny-random-llama" and cfg.env.action_correction is True
