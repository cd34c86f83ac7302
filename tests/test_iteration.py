"""One RL iteration without a Trainer (``src/data/iteration.py``), on the toy environment of test_toy_environment.py:
called directly with the tiny policy and its collaborators it gives the micro-batches (samples, advantages, old
log-probs) the same iteration gives through the Trainer; the off-policy update prompt holds no tips; and a checkpoint
written in the format of today's memory callback and datamodule resumes."""
from __future__ import annotations

import copy
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from src.data.iteration import Collaborators, run_iteration, SignalGuard
from src.data.prompts import TIPS_HEADER
from src.envs.pool import EnvPool

ROOT = Path(__file__).resolve().parents[1]
ENV = {"_target_": "test_toy_environment.KeyCorridor", "max_steps": 3}
TIP = "TIP-CORRIDOR: the key lies to the right."
# p = q = 1: every iteration is an off-policy one, retrieving tips for the rollout and stripping them for the update
OFF_POLICY = ("algorithm.memory_rollout_prob=1.0", "algorithm.off_policy_prob=1.0")


def _cfg(tmp: Path, *overrides: str):
    base = ["model=tiny", "model.warm_start=null", "logger=none", "seed=5", f"paths.output_dir={tmp}/run",
            f"paths.log_dir={tmp}/logs", "trainer.precision=32-true", "trainer.max_epochs=1", "data.val=null",
            "trainer.check_val_every_n_epoch=null", "data.tasks_per_iteration=2", "data.group_size=2",
            "data.micro_batch_size=3", "data.max_response_tokens=4", "data.max_steps=3", "memory.tip_max_tokens=4",
            "~callbacks.rich_progress_bar", "trainer.enable_progress_bar=false",
            "+callbacks.recorder._target_=probes.BatchRecorder"]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=base + list(overrides))
    with open_dict(cfg):
        cfg.env = OmegaConf.create(ENV)
    return cfg


def _seed_tips(memory, tasks: list[dict]) -> None:
    """One tip per training task, keyed by the task's first state, so the off-policy rollout shows it."""
    with EnvPool(ENV, num_workers=1) as pool:
        for task in tasks:
            obs, info = pool.reset([(0, task)])[0]
            key = memory.embed([memory.state_text(info["instruction"], obs)])
            memory.tips.add(memory.partition_key(task), key, [TIP], [1.0], [0])


def _recorder(trainer):
    return next(c for c in trainer.callbacks if type(c).__name__ == "BatchRecorder")


def _sample_view(batch) -> list[tuple]:
    return [(s.key, s.rollout_prompt_ids, s.update_prompt_ids, s.old_prompt_ids, s.response_ids, s.rollout_log_probs,
             s.advantage, s.old_log_probs.tolist()) for s in batch.samples]


@pytest.fixture(scope="module")
def iteration_pair(tmp_path_factory):
    """Iteration 0 of one built run, twice from the same state: called directly (no Trainer, its own pool), then
    through ``trainer.fit``; the memory holds one seeded tip per task both times."""
    from src.train import build

    tmp = tmp_path_factory.mktemp("iteration")
    cfg = _cfg(tmp, *OFF_POLICY)
    objs = build(cfg)
    dm, memory, policy = objs["datamodule"], objs["memory"], objs["module"].policy
    with EnvPool(ENV, num_workers=1) as pool:
        tasks = pool.tasks("train")
    _seed_tips(memory, tasks)
    seeded = copy.deepcopy(memory.state_dict())
    weights = copy.deepcopy(policy.state_dict())
    with EnvPool(ENV, num_workers=cfg.data.tasks_per_iteration * cfg.data.group_size) as pool:
        parts = Collaborators(policy=policy, pool=pool, tasks=tasks, memory=memory)
        direct = list(run_iteration(dm.settings, parts, iteration=0, global_step=0,
                                    guard=SignalGuard(dm.settings.algorithm)))
    written = len(memory.tips)
    memory.load_state_dict(seeded)  # the Trainer's iteration starts from the same memory
    objs["trainer"].fit(objs["module"], datamodule=dm)
    return {"direct": direct, "trainer": _recorder(objs["trainer"]).batches, "policy": policy, "weights": weights,
            "written": written, "memory": memory, "objs": objs, "cfg": cfg, "tmp": tmp}


def test_the_iteration_without_a_trainer_gives_what_the_trainer_trains_on(iteration_pair):
    direct, through = iteration_pair["direct"], iteration_pair["trainer"]
    assert [(b.mode, b.iteration, b.mini_batch, b.last_micro, b.loss_scale) for b in direct] == \
        [(b.mode, b.iteration, b.mini_batch, b.last_micro, b.loss_scale) for b in through]
    assert [_sample_view(b) for b in direct] == [_sample_view(b) for b in through]
    # the same rollout metrics (the memory logs its own timings from its Lightning hook, not through the batch)
    assert set(through[0].metrics) == set(direct[0].metrics)
    assert len(iteration_pair["memory"].tips) == iteration_pair["written"]  # the same tips written both times


def test_the_off_policy_iteration_trains_tip_free_prompts_with_grpo_advantages(iteration_pair):
    """Known answers on the direct iteration: tips shown in the rollout and gone from the update prompt; π_old under
    the rollout prompt (``off_policy_old_log_prob: with_tips``), recomputed with the rollout's weights; advantages
    centred and std-normalised within each group of 2 (±1/√2 or 0)."""
    batches, policy = iteration_pair["direct"], copy.deepcopy(iteration_pair["policy"])
    policy.load_state_dict(iteration_pair["weights"])  # the weights the rollout ran with (the fit moved them)
    decode = policy.tokenizer.decode
    samples = [s for b in batches for s in b.samples]
    assert {b.mode for b in batches} == {"off_policy"} and samples
    shown = [s for s in samples if TIP in decode(s.rollout_prompt_ids)]
    assert shown, "no rollout prompt showed the seeded tip"
    for s in samples:
        update = decode(s.update_prompt_ids)
        assert TIP not in update and TIPS_HEADER not in update
        assert s.old_prompt_ids == s.rollout_prompt_ids
        with torch.no_grad():
            expected = policy.log_probs([s.rollout_prompt_ids], [s.response_ids])["log_probs"][0]
        torch.testing.assert_close(s.old_log_probs, expected, atol=1e-5, rtol=1e-5)
    by_episode = {s.key[0]: s.advantage for s in samples}
    assert all(len({s.advantage for s in samples if s.key[0] == e}) == 1 for e in by_episode)  # one per episode
    groups = {}
    for episode, advantage in by_episode.items():
        groups.setdefault(episode // 2, []).append(advantage)  # episode ids k·n + j: group k of n = 2
    for advantages in groups.values():
        assert abs(sum(advantages)) < 1e-6
        assert all(a == 0.0 or abs(abs(a) - 1 / np.sqrt(2)) < 1e-5 for a in advantages), advantages


def test_a_checkpoint_in_todays_format_resumes(iteration_pair):
    """The run's last.ckpt with its memory and datamodule state replaced by literal dicts in the format of
    ``MemoryCallback.state_dict`` and ``RolloutDataModule.state_dict`` as written today: the resumed run restores the
    tips and novelty visits, continues at the saved iteration and keeps the no-signal count."""
    from src.train import train
    from src.utils.rng import global_rng_state

    last = iteration_pair["objs"]["trainer"].checkpoint_callback.last_model_path
    ckpt = torch.load(last, map_location="cpu", weights_only=True)
    key = torch.zeros(1, 384)
    key[0, 0] = 1.0
    entry = {"content": "LITERAL-TIP; At that step the action taken was right; the episode's final score was 1/1.",
             "score": 1.0, "step": 0, "created_at": 0.0, "iteration": 0}
    ckpt["callbacks"]["MemoryCallback"] = {
        "tips": {"format": "empo2.tip_memory.v1", "embedder_name": "embedded:all-MiniLM-L6-v2", "dim": 384,
                 "counters": {}, "partitions": {"corridor/0": {"keys": key, "entries": [entry]}}},
        "novelty": {"format": "empo2.novelty.v2", "dim": 384, "states": {"corridor": key.clone()},
                    "counts": {"corridor": torch.tensor([3], dtype=torch.int64)}},
        "key": "instruction_observation"}
    ckpt["RolloutDataModule"] = {"rng": [global_rng_state()], "no_signal_iterations": 1, "iteration": 4}
    path = iteration_pair["tmp"] / "todays_format.ckpt"
    torch.save(ckpt, path)
    cfg = _cfg(iteration_pair["tmp"] / "resumed", *OFF_POLICY, f"ckpt_path={path}", "trainer.max_epochs=2")
    objs = train(cfg)
    memory = objs["memory"]
    assert any(e.content.startswith("LITERAL-TIP") for e in memory.tips.entries("corridor/0"))
    assert memory.novelty.visits()["corridor"][0] >= 3
    assert {b.iteration for b in _recorder(objs["trainer"]).batches} == {4}
    assert objs["datamodule"].iteration == 5


def test_replies_cut_at_the_token_cap_are_counted(iteration_pair):
    """Issue 59: the share of the iteration's replies that hit data.max_response_tokens (4 here: no EOS among the
    reply's tokens) and of the reflections that hit memory.tip_max_tokens are rollout metrics."""
    batches, policy = iteration_pair["direct"], iteration_pair["policy"]
    metrics, eos = batches[0].metrics, set(policy.eos_token_ids)
    replies = {s.key: s.response_ids for b in batches for s in b.samples}  # every step of every episode, once
    cut = [not eos.intersection(r) for r in replies.values()]
    assert all(len(r) == 4 for r, c in zip(replies.values(), cut) if c)
    assert metrics["rollout/replies_cut_frac"] == pytest.approx(sum(cut) / len(cut))
    assert 0.0 <= metrics["rollout/tips_cut_frac"] <= 1.0


def test_most_replies_cut_is_warned_once_per_run():
    from src.models.algorithm_config import AlgorithmConfig

    guard = SignalGuard(AlgorithmConfig.from_dict({}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guard.warn_cut_replies(0.5, 8)  # half: not most
    with pytest.warns(UserWarning, match=r"75% of this iteration's replies .*data\.max_response_tokens=8"):
        guard.warn_cut_replies(0.75, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guard.warn_cut_replies(1.0, 8)  # warned once already
