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
    ("data.mini_batch_rows=16", r"trainer.max_steps=4: .*one optimizer step per data.mini_batch_rows rows, a number "
                                r"that follows the rollout.*trainer.max_epochs"),
])
def test_batch_level_trainer_options_are_refused_at_start_up(tmp_path, override, reason):
    rule = ["data.num_mini_batches=null", "+trainer.max_steps=4"] if "mini_batch_rows" in override \
        else ["data.num_mini_batches=2"]
    cfg = _cfg(tmp_path, override, *rule)
    with pytest.raises(ValueError, match=reason):
        train(cfg)
    assert not (tmp_path / "run").exists()  # refused before anything was built or written


def test_gold_paths_longer_than_the_cap_are_warned_about(tmp_path, caplog):
    assert set(GOLD_PATH_LENGTHS) == set(TASK_NAMES)
    over = sorted(t for t, (_, longest) in GOLD_PATH_LENGTHS.items() if longest > default_max_steps(t))
    assert "mendelian-genetics-known-plant" in over and "inclined-plane-friction-unnamed-surfaces" in over
    assert "boil" not in over and "find-non-living-thing" not in over
    with caplog.at_level(logging.INFO):
        # the CPU experiment caps find-non-living-thing (gold paths of 3-7 actions) at 6: the longer ones are cut
        assert len(warn_gold_paths_over_cap(_cfg(tmp_path).env)) == 1
    assert "'find-non-living-thing'" in caplog.text and "3-7 actions" in caplog.text and "cap is 6" in caplog.text
    assert [r.levelname for r in caplog.records] == ["INFO"]  # some variations fit: not a warning
    caplog.clear()
    with caplog.at_level(logging.INFO):
        messages = warn_gold_paths_over_cap(_cfg(tmp_path, "env.task=[mendelian-genetics-known-plant,boil]",
                                                 "env.max_steps=null").env)
    assert len(messages) == 1 and "mendelian-genetics-known-plant" in messages[0] and "cap is 30" in messages[0]
    assert [r.levelname for r in caplog.records] == ["WARNING"]  # no gold path fits the cap
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


# Every setting the start-up checks refuse (src/config_checks.py), with what the message must say; each is also
# a row of docs/robustness.md's table (test_every_refused_setting_is_documented).
BAD_SETTINGS = [
    (["data.group_size=1"], r"data.group_size=1: GRPO's advantage compares the episodes.*expected an int >= 2"),
    (["seed=abc"], r"seed='abc': expected an int >= 0 \(it seeds every random stream of the run"),
    (["trainer.devices=2", "data.tasks_per_iteration=1"],
     r"data.tasks_per_iteration=1 with trainer.devices=2: 1 of the 2 ranks would play no episode in any iteration"),
    (["algorithm=grpo", "algorithm.use_memory=true"],
     r"algorithm.use_memory=true with algorithm=grpo: the GRPO baseline has no memory.*contaminated baseline"),
    (["algorithm=grpo", "algorithm.memory_rollout_prob=0.25"],
     r"algorithm.memory_rollout_prob=0.25 \(algorithm=grpo\) draws memory rollouts, but algorithm.use_memory=false"),
    (["algorithm.use_memory=false"],
     r"algorithm.memory_rollout_prob=0.25 \(algorithm=empo2\) draws memory rollouts, but algorithm.use_memory=false"),
    (["trainer.max_epochs=0"], r"trainer.max_epochs=0: the number of training iterations.*expected an int >= 1"),
    (["+trainer.max_epoch=3"], r"trainer.max_epoch: not an argument of Lightning's Trainer; did you mean "
                               r"trainer.max_epochs\?"),
    (["trainer.check_val_every_n_epoch=0"], r"trainer.check_val_every_n_epoch=0: expected an int >= 1"),
    (["data.val.temperature=0"], r"data.val.temperature=0: validation samples its actions; expected a number > 0"),
    (["data.temperature=0"], r"data.temperature=0: the rollout sampling temperature; expected a number > 0"),
    (["data.tasks_per_iteration=0"], r"data.tasks_per_iteration=0: expected an int >= 1"),
    (["data.micro_batch_size=0"], r"data.micro_batch_size=0: expected an int >= 1"),
    (["data.num_mini_batches=null", "data.mini_batch_rows=0"], r"data.mini_batch_rows=0: expected an int >= 1"),
    (["data.mini_batch_rows=64"], r"data.num_mini_batches=2 and data.mini_batch_rows=64 are both set: one rule per "
                                  r"run.*set the other to null"),
    (["data.history_action=corrected"], r"data.history_action='corrected': expected one of \('raw', 'executed'\)"),
    (["data.val.num_tasks=0"], r"data.val.num_tasks=0: expected an int >= 1"),
    (["model.optimizer.lr=-1e-6"], r"model.optimizer.lr=-1e-06: expected a learning rate > 0"),
    (["model.optimizer.weight_decay=-0.1"], r"model.optimizer.weight_decay=-0.1: expected a number >= 0"),
    (["model.gradient_clip_val=0"], r"model.gradient_clip_val=0: expected a max gradient norm > 0, or null"),
    (["model.policy.lora.enabled=true", "model.policy.lora.r=0"], r"model.policy.lora.r=0: expected an int >= 1"),
    (["algorithm.loss_agg_mode=token-sum"], r"algorithm.loss_agg_mode='token-sum': expected one of"),
    (["algorithm.gamma=1.5"], r"algorithm.gamma=1.5: expected a value in \[0, 1\]"),
    (["algorithm.clip_ratio_c=1"], r"algorithm.clip_ratio_low/high/c=0.2/0.3/1.0: expected 0 <= low < 1"),
    (["+algorithm.lr=1e-5"], r"algorithm.lr: not an algorithm setting; expected keys among"),
    (["+algorithm.kl_coeff=0.01"], r"algorithm.kl_coeff: not an algorithm setting \(did you mean algorithm.kl_coef\?\)"),
    (["memory.partition=goal"], r"memory.partition='goal': expected one of \('variation', 'task', 'global'\)"),
    (["memory.tips_scope=all"], r"memory.tips_scope='all': expected one of \('current', 'all_steps'\)"),
    (["memory.tip_memory.rank_by=recency"], r"memory.tip_memory.rank_by='recency': expected one of"),
    (["memory.tip_memory.top_k=0"], r"memory.tip_memory.top_k=0: expected an int >= 1"),
    (["memory.tip_memory.threshold=1.5"], r"memory.tip_memory.threshold=1.5: a cosine similarity"),
    (["memory.novelty.threshold=-2"], r"memory.novelty.threshold=-2: a cosine similarity"),
    (["memory.tip_max_tokens=0"], r"memory.tip_max_tokens=0: expected an int >= 1"),
    (["env.max_steps=0"], r"env.max_steps=0: expected an int >= 1 or null \(actions per episode"),
    (["env.task=bogus"], r"env.task='bogus': Unknown ScienceWorld task 'bogus'.*Valid tasks: 0=boil"),
    (["env.jvm_heap=lots"], r"env.jvm_heap='lots': expected a JVM heap size like '768m' or '2g'"),
    (["+env.max_step=3"], r"env.max_step: not a setting of ScienceWorldEnv \(expected one of \[.*'max_steps'"),
    (["experiment=coin", "env.game=zork"], r"env.game='zork': expected one of \['coin', 'cookingworld'\]"),
    (["experiment=coin", "env.max_steps=0"], r"env.max_steps=0: expected an int >= 1 \(actions per episode\)"),
    (["experiment=webshop", "env.real_data_dir=/no/such/dir"],
     r"env.real_data_dir='/no/such/dir' \(or WEBSHOP_DATA_DIR\): WebShop data dir '/no/such/dir' does not exist"),
    (["experiment=webshop", "env.reward_mode=points"], r"env.reward_mode='points': expected one of \['score', "),
    (["trainer.precision=fp16"], r"trainer.precision='fp16': expected auto or one of Lightning's \[.*'bf16-mixed'"),
    (["trainer.accelerator=cpu", "model.policy.cuda_graphs=true"],
     r"model.policy.cuda_graphs=true with trainer.accelerator=cpu: CUDA graphs need a CUDA device; expected false"),
    (["model.policy.cuda_graphs=yes"], r"model.policy.cuda_graphs='yes': expected true or false"),
    (["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=1", "trainer.precision=32-true",
      "model.policy.rollout_precision=bf16-decode"],
     r"model.policy.rollout_precision=bf16-decode with trainer.strategy=ModelParallelStrategy: bf16 decoding steps "
     r"run a bf16 copy"),
    (["trainer.accelerator=cpu", "trainer.precision=16-mixed"],
     r"trainer.precision='16-mixed' on a CPU: Lightning would run bf16-mixed instead"),
    (["env.task=null"], r"env.task=None: expected a task \(a name, a paper id like '4-2' or an index\) or a list"),
    (["env.num_train_variations=0"], r"env.num_train_variations=0: expected an int >= 1 \(training variations"),
    (["experiment=coin", "env.num_train_seeds=0"], r"env.num_train_seeds=0: expected an int >= 1 \(train seeds\)"),
    (["env.action_correction=no"], r"env.action_correction='no': expected true or false"),
    (["data.max_steps=0"], r"data.max_steps=0: the step budget the prompt shows; expected an int >= 1 or null"),
    (["trainer.strategy=dpp"], r"trainer.strategy='dpp': not a Lightning strategy; did you mean 'ddp'\?"),
    (["trainer.devices=0"], r"trainer.devices=0: expected an int >= 1 \(-1: all\), 'auto' or a list"),
    (["trainer.accelerator=tpu", "trainer.precision=32-true"], r"trainer.accelerator='tpu': expected one of \['auto', 'cpu', 'gpu', 'cuda'\]"),
    (["seed=99999999999"], r"seed=99999999999: NumPy and Lightning seed with 32 bits; expected an int <= 4294967295"),
    (["algorithm.kl_coef=-1"], r"algorithm.kl_coef=-1: the weight of the KL penalty.*expected a number >= 0"),
    (["algorithm.lowprob_log_threshold=5"], r"algorithm.lowprob_log_threshold=5: log δ, a log-probability \(-5 in the paper\); expected a number <= 0"),
    (["algorithm.no_signal_patience=2.5"], r"algorithm.no_signal_patience=2.5: expected an int$"),
    (["memory.novelty.enabled=no"], r"memory.novelty.enabled='no': expected true or false$"),
    (["algorithm.memory_rollout_prob=abc"], r"algorithm.memory_rollout_prob='abc': expected a number$"),
    (["algorithm.temperature=0.5"], r"algorithm.temperature=0.5 follows data.temperature=1.0; set data.temperature "
                                    r"instead"),
    (["env.jvm_heap=1m"], r"env.jvm_heap='1m': too small for a simulator's JVM \(it dies at start-up\); expected at least 128m"),
    (["memory.novelty.coef=1e300"], r"memory.novelty.coef=1e\+300: the bonus for a new state.*expected a number in \[0, 1000\]"),
    (["+memory.novelty.bogus=1"], r"memory.novelty.bogus: not a memory.novelty setting; expected keys among \['capacity', "),
    (["data.pool_timeout_s=0"], r"data.pool_timeout_s=0: the seconds an environment worker may take for one call before it is restarted; expected a number > 0"),
    (["data.num_env_workers=-3"], r"data.num_env_workers=-3: expected an int >= 1 or null"),
    (["data.num_env_workers=1"], r"data.num_env_workers=1: each rank plays 8 episodes at once .*expected null \(as many as needed\) or an int >= 8"),
    (["data.max_response_tokens=1000000"], r"data.max_response_tokens=1000000 with model.policy.max_prompt_tokens=\d+ "
                                           r"passes the model's context window of \d+ tokens.*expected "
                                           r"data.max_response_tokens <= \d+$"),
    (["logger.mlflow.tracking_uri=http://127.0.0.1:9"],
     r"logger.mlflow.tracking_uri='http://127.0.0.1:9': no MLflow server answers there \(Connection refused\)"),
    (["+logger.mlflow.run_id=0123abcd"], r"\+logger.mlflow.run_id=0123abcd: no such run in sqlite:///.*leave "
                                         r"\+logger.mlflow.run_id unset"),
    (["algorithm.semantics=authors", "data.micro_batch_tokens=2048"],
     r"data.micro_batch_tokens=2048 with algorithm.semantics=authors: the authors' loss is a token mean per "
     r"micro-batch of data.micro_batch_size samples"),
    (["data.tasks_per_iteration=50"], r"data.tasks_per_iteration=50 x data.group_size=4 starts 200 environment workers on this machine.*expected at most"),
]


@pytest.mark.parametrize("overrides, message", BAD_SETTINGS, ids=[" ".join(o) for o, _ in BAD_SETTINGS])
def test_an_impossible_setting_is_refused_before_anything_is_built(tmp_path, monkeypatch, overrides, message):
    import src.train
    from src.utils.config_error import ConfigError

    monkeypatch.setattr(src.train, "build", lambda cfg: pytest.fail("the run was built"))
    with pytest.raises(ConfigError, match=message) as err:
        train(_cfg(tmp_path, "model.warm_start=null", *overrides))
    assert all("\n" not in line for line in [str(err.value)])  # one line
    assert not (tmp_path / "run").exists() and not (tmp_path / "logs").exists()  # no run directory, no tracker run


def test_every_refused_setting_is_documented():
    table = (ROOT / "docs" / "robustness.md").read_text()
    missing = [" ".join(o) for o, _ in BAD_SETTINGS if f"`{' '.join(o)}`" not in table]
    assert missing == []


def test_resuming_onto_another_model_is_refused_naming_both(tmp_path, tiny_model_dir, model_cache_dir):
    """A checkpoint of the tiny policy resumed with a config that builds another model: refused at start-up from
    the checkpoint's tensor shapes and the other model's config.json (no weights loaded), naming both."""
    import torch

    from src.models.hub import build_tiny_model
    from src.models.policy import build_policy
    from src.utils.config_error import ConfigError

    policy = build_policy(name_or_path=tiny_model_dir, cache_dir=str(model_cache_dir))
    ckpt = tmp_path / "last.ckpt"
    torch.save({"global_step": 2, "hyper_parameters": {"policy": {"name_or_path": tiny_model_dir}},
                "state_dict": {f"policy.{k}": v for k, v in policy.state_dict().items()}}, ckpt)
    wider = build_tiny_model(tiny_model_dir, tmp_path / "tiny-wide", hidden_size=32, num_layers=3)
    with pytest.raises(ConfigError, match=rf"ckpt_path='{ckpt}' holds a policy with layers 2, hidden size 64, "
                                          rf"vocabulary 49152 \(trained from model.policy.name_or_path="
                                          rf"'{tiny_model_dir}'\), but this config builds model.policy.name_or_path="
                                          rf"'{wider}' with layers 3, hidden size 32, vocabulary 49152"):
        train(_cfg(tmp_path, "model.warm_start=null", f"model.policy.name_or_path={wider}", f"ckpt_path={ckpt}"))
    with pytest.raises(ConfigError, match=r"holds no LoRA adapters \(a full fine-tune\), but "
                                          r"model.policy.lora.enabled=true"):
        train(_cfg(tmp_path, "model.warm_start=null", "model.policy.lora.enabled=true", f"ckpt_path={ckpt}"))
    train_cfg = _cfg(tmp_path, "model.warm_start=null", f"ckpt_path={ckpt}")
    from src.utils.startup_checks import check_checkpoint_path

    assert check_checkpoint_path(train_cfg) == ckpt  # the model it was trained on passes


def test_trainer_fsdp_is_seen_as_sharded_by_the_generation_checks():
    """trainer=fsdp names its strategy as a ``_target_`` mapping (ModelParallelStrategy), not a string with 'fsdp'."""
    from omegaconf import OmegaConf

    from src.utils.startup_checks import generation_problems

    fsdp = OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "trainer" / "fsdp.yaml"))
    problems = generation_problems(fsdp, {"policy": {"cuda_graphs": True, "rollout_precision": "bf16"}})
    assert len(problems) == 2 and all("trainer.strategy=ModelParallelStrategy" in p for p in problems)
    assert generation_problems({**fsdp, "strategy": "ddp"}, {"policy": {"cuda_graphs": True}}) == []
