"""Rollout pipeline on real ScienceWorld with a tiny policy: ids, masks and old log-probs line up with what was
generated; the off-policy update prompt has no tips while the rollout prompt had them (SPEC §2.1, §2.4)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from src.data.prompts import TIPS_HEADER
from src.data.rollout import RolloutConfig, run_episodes
from src.data.rollout_datamodule import RolloutDataModule, draw_mode
from src.envs.pool import EnvPool
from src.models.policy import pack_batch

ENV_CFG = {"_target_": "src.envs.scienceworld.ScienceWorldEnv", "task": "find-non-living-thing", "max_steps": 3}
TASK = {"task_name": "find-non-living-thing", "variation": 0}


class RecordingPolicy:
    """Wraps the real policy and keeps every Generation it returned (to compare against the batch)."""

    def __init__(self, policy):
        self.policy = policy
        self.generations = []

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def generate(self, *args, **kwargs):
        gen = self.policy.generate(*args, **kwargs)
        self.generations.append((args[0], gen))
        return gen


class _Module:
    """The two things the datamodule needs from the LightningModule, backed by the real EMPO2Module code."""

    def __init__(self, policy):
        from src.models.empo2_module import EMPO2Module

        self.policy = policy
        self.algorithm = {"temperature": 1.0}
        self.score_samples = EMPO2Module.score_samples.__get__(self)
        self._trainer = None

    import contextlib

    @contextlib.contextmanager
    def rollout_context(self):
        with torch.no_grad():
            yield


@pytest.fixture(scope="module")
def pool():
    with EnvPool(ENV_CFG, num_workers=2) as p:
        yield p


@pytest.fixture(scope="module")
def memory():
    import hydra
    from omegaconf import OmegaConf

    cfg = OmegaConf.load("configs/memory/empo2.yaml")
    cfg.novelty.coef = 1.0
    return hydra.utils.instantiate(cfg)


def _datamodule(mode_algorithm: dict) -> RolloutDataModule:
    return RolloutDataModule(env=ENV_CFG, algorithm=mode_algorithm, tasks_per_iteration=1, group_size=2,
                             micro_batch_size=3)


def test_batch_ids_masks_and_old_log_probs_line_up(pool, tiny_policy):
    torch.manual_seed(0)
    recorder = RecordingPolicy(tiny_policy)
    cfg = RolloutConfig(max_response_tokens=6, history_length=2)
    episodes, metrics = run_episodes(pool, recorder, [TASK, TASK], [0, 0], cfg)
    assert all(not e.failed and len(e.steps) == 3 for e in episodes)  # max_steps=3 cap (truncation)
    assert metrics["generated_tokens"] == sum(len(s.response_ids) for e in episodes for s in e.steps)
    # every step's response ids/log-probs are exactly those of the generate call that produced them
    for t in range(3):
        prompts, gen = recorder.generations[t]
        for i, episode in enumerate(episodes):
            step = episode.steps[t]
            assert step.rollout_prompt_ids is prompts[i] or step.rollout_prompt_ids == prompts[i]
            assert step.response_ids == gen.response_ids[i]
            assert step.sample_log_probs == gen.log_probs[i]
            assert step.response_text == gen.texts[i]
    dm = _datamodule({"norm_adv_by_std": True})
    samples, _ = dm.make_samples(episodes, "on_policy")
    assert len(samples) == 6
    _Module(tiny_policy).score_samples(samples, "on_policy", micro_batch_size=4)
    for s in samples:
        assert s["old_prompt_ids"] == s["prompt_ids"]  # on-policy: one prompt
        assert s["old_log_probs"].shape == (len(s["response_ids"]),)
        # recomputed old log-probs = the log-probs the tokens were sampled with (same weights)
        torch.testing.assert_close(s["old_log_probs"], torch.tensor(s["sample_log_probs"]), atol=1e-4, rtol=1e-4)
    # without recomputation the behaviour log-probs are the sampling log-probs themselves
    reused, _ = dm.make_samples(episodes, "on_policy")
    module = _Module(tiny_policy)
    module.algorithm["recompute_old_log_probs"] = False
    module.score_samples(reused, "on_policy")
    assert all(s["old_log_probs"].tolist() == pytest.approx(s["sample_log_probs"]) for s in reused)
    # micro-batches: the response mask marks exactly each sample's response tokens
    micro = list(dm.micro_batches(samples, {"iteration": 0, "mode": "on_policy", "rollout_global_step": 0}, {}, 0))
    assert [len(m["samples"]) for m in micro] == [3, 3]
    assert [m["last_micro"] for m in micro] == [False, True]
    total = sum(len(s["response_ids"]) for s in samples)
    assert all(m["global_token_count"] == total and m["global_seq_count"] == 6 for m in micro)
    for m in micro:
        b = pack_batch([s["prompt_ids"] for s in m["samples"]], [s["response_ids"] for s in m["samples"]], 0)
        assert b["response_mask"].sum(1).tolist() == [len(s["response_ids"]) for s in m["samples"]]


def test_off_policy_update_prompt_has_no_tips(pool, tiny_policy, memory):
    """Tips shown during the rollout are absent from the update prompt of an off-policy sample."""
    obs, info = pool.reset([(0, TASK)])[0]
    tip = "TIP-MARKER: look for a non-living object such as a chair, then focus on it."
    key = memory.embed([memory.state_text(info["instruction"], obs)])
    memory.tips.add(memory.partition_key(TASK), key, [tip], [100.0], [0])
    cfg = RolloutConfig(max_response_tokens=4, history_length=2, use_tips=True, strip_tips_for_update=True)
    episodes, _ = run_episodes(pool, tiny_policy, [TASK], [0], cfg, memory=memory)
    first = episodes[0].steps[0]
    assert tip in first.tips
    decode = tiny_policy.tokenizer.decode
    assert "TIP-MARKER" in decode(first.rollout_prompt_ids) and TIPS_HEADER in decode(first.rollout_prompt_ids)
    for step in episodes[0].steps:
        update_text = decode(step.update_prompt_ids)
        assert "TIP-MARKER" not in update_text and TIPS_HEADER not in update_text and "<memory>" not in update_text
    dm = _datamodule({"offpolicy_old_logprob": "with_tips"})
    samples, _ = dm.make_samples(episodes, "off_policy")
    assert samples[0]["old_prompt_ids"] == first.rollout_prompt_ids  # π_old(a|s, tips): true importance ratio
    assert samples[0]["prompt_ids"] == first.update_prompt_ids
    dm = _datamodule({"offpolicy_old_logprob": "without_tips"})
    samples, _ = dm.make_samples(episodes, "off_policy")
    assert samples[0]["old_prompt_ids"] == first.update_prompt_ids


def test_failed_episode_is_excluded_from_its_group(pool, tiny_policy):
    from src.data.rollout import Episode, StepRecord

    def ep(score, failed=False):
        step = StepRecord("o", [1], [1], [2], [-1.0], "a", "a", reward=score)
        return Episode(task=TASK, group=0, steps=[step], score=score, failed=failed)

    dm = _datamodule({"norm_adv_by_std": True})
    samples, metrics = dm.make_samples([ep(1.0), ep(3.0), ep(0.0, failed=True)], "on_policy")
    assert len(samples) == 2  # the failed episode contributes no sample
    assert metrics["adv/num_failed_episodes"] == 1
    # returns 1, 3 -> mean 2, Bessel std sqrt(2): advantages -+1/sqrt(2)
    assert samples[0]["advantage"] == pytest.approx(-1 / np.sqrt(2), abs=1e-5)
    assert samples[1]["advantage"] == pytest.approx(1 / np.sqrt(2), abs=1e-5)


def test_mode_draw_is_seeded_and_matches_p_q():
    modes = [draw_mode(0, i, 0.25, 2 / 3) for i in range(4000)]
    assert modes == [draw_mode(0, i, 0.25, 2 / 3) for i in range(4000)]
    freq = {m: modes.count(m) / len(modes) for m in set(modes)}
    assert freq["on_policy"] == pytest.approx(0.75, abs=0.03)
    assert freq["off_policy"] == pytest.approx(0.25 * 2 / 3, abs=0.03)
    assert freq["on_policy_with_tips"] == pytest.approx(0.25 / 3, abs=0.03)
    assert set(draw_mode(0, i, 0.0, 0.0) for i in range(100)) == {"on_policy"}


def test_reflection_continues_the_last_rollout_prompt_from_its_kept_keys_values(pool, tiny_policy, memory):
    """Tip writing after a rollout that kept each episode's last prompt: the reflection prompt is that prompt, its
    action, then a turn with the steps it did not show; only the new ids are computed (SPEC §2.7)."""
    calls = []

    class Recorder(RecordingPolicy):
        def generate(self, prompts, **kwargs):
            calls.append((prompts, kwargs))
            return self.policy.generate(prompts, **kwargs)

    torch.manual_seed(5)
    cfg = RolloutConfig(max_response_tokens=4, history_length=1, keep_reflection_prefix=True)
    episodes, _ = run_episodes(pool, tiny_policy, [TASK, TASK], [0, 0], cfg, memory=memory)
    assert all(e.reflection_prefix is not None and len(e.steps) == 3 for e in episodes)
    # a continuation that cannot fit the budget falls back to a fresh prompt of the whole trajectory
    budget = tiny_policy.max_prompt_tokens
    tiny_policy.max_prompt_tokens = len(episodes[0].steps[-1].rollout_prompt_ids) + 8
    try:
        ids, prefix, _ = memory.reflection_prompt(tiny_policy, pool.system_prompt, episodes[0])
    finally:
        tiny_policy.max_prompt_tokens = budget
    assert prefix is None and "Your trajectory (3 steps)" in tiny_policy.tokenizer.decode(ids)
    metrics = memory.write_tips(episodes, Recorder(tiny_policy), pool.system_prompt)
    prompts, kwargs = calls[-1]
    assert metrics["tip_prompts_continued"] == 2 and all(p is not None for p in kwargs["prefix_kv"])
    decode = tiny_policy.tokenizer.decode
    for episode, prompt, prefix in zip(episodes, prompts, kwargs["prefix_kv"]):
        last = episode.steps[-1]
        assert last.history_shown == 1 and prefix.length == len(last.rollout_prompt_ids)
        response = last.response_ids[:-1] if last.response_ids[-1] in tiny_policy.eos_token_ids else last.response_ids
        assert prompt[:len(last.rollout_prompt_ids) + len(response)] == last.rollout_prompt_ids + response
        turn = decode(prompt[len(last.rollout_prompt_ids) + len(response):])
        # step 1 was not in the last prompt (it showed step 2 only): the turn adds it, then the ending
        assert "Your first 1 steps (of 3), not shown above:" in turn and "[Step 2]" not in turn
        assert f"[Step 1] Action: {episode.steps[0].action}" in turn
        assert f"Final observation: {episode.final_observation.strip()[:30]}" in turn
        assert len(prompt) <= tiny_policy.max_prompt_tokens
        assert episode.reflection_prefix is None  # released
    assert metrics["tips_written"] > 0
