"""Rollout pipeline on real ScienceWorld with a tiny policy: ids, masks and old log-probs line up with what was
generated; the off-policy update prompt has no tips while the rollout prompt had them
(docs/method.md#tip-stripping-for-the-off-policy-update)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from src.data.iteration import (Collaborators, IterationSettings, SignalGuard, draw_mode, group_advantages,
                                make_samples, run_iteration)
from src.data.minibatches import mini_batch_count, micro_batches
from src.data.prompts import AUTHORS_TIPS_HEADER, TIPS_HEADER
from src.data.rollout import Episode, StepRecord, episode_metrics, run_episodes
from src.data.rollout_config import DataConfig, RolloutConfig
from src.data.rollout_datamodule import RolloutDataModule
from src.data.samples import StepSample
from src.envs.pool import EnvPool
from src.models.algorithm_config import AlgorithmConfig
from src.models.old_log_probs import score_samples
from src.models.policy import Generation, Policy, pack_batch
from src.utils.rng import global_rng_state

ROOT = Path(__file__).resolve().parents[1]
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


@pytest.fixture(scope="module")
def module(tiny_model_dir, model_cache_dir):
    """The real LightningModule around the tiny policy (the datamodule scores samples with it)."""
    from src.models.empo2_module import EMPO2Module

    return EMPO2Module(policy={"name_or_path": tiny_model_dir, "cache_dir": str(model_cache_dir), "dtype": "float32",
                               "max_response_tokens": 8, "max_prompt_tokens": 1024},
                       algorithm={"temperature": 1.0}, optimizer=None, gradient_clip_val=None)


@pytest.fixture(scope="module")
def pool():
    with EnvPool(ENV_CFG, num_workers=2) as p:
        yield p


@pytest.fixture(scope="module")
def memory():
    from src.callbacks.memory import MemoryCallback

    return MemoryCallback.from_config({"novelty": {"coef": 1.0}})


def _datamodule(mode_algorithm: dict) -> RolloutDataModule:
    return RolloutDataModule(env=ENV_CFG, algorithm=mode_algorithm, tasks_per_iteration=1, group_size=2,
                             micro_batch_size=3)


def _make_samples(episodes: list[Episode], mode: str = "on_policy", **algorithm) -> tuple[list[StepSample], dict]:
    """The iteration's steps 4-5 (``group_advantages`` then ``make_samples``) and its ``adv/*`` metrics."""
    algo = AlgorithmConfig.from_dict(algorithm)
    advantages, metrics = group_advantages(episodes, algo, rank=0)
    samples, counts = make_samples(episodes, advantages, mode, algo)
    return samples, {f"adv/{k}": v for k, v in {**metrics, **counts}.items()}


def _micro_batches(samples: list[StepSample], micro_batch_size: int = 3, **sizes) -> list:
    """The iteration's step 7 (``micro_batches``) at iteration 0, seed 0."""
    info = {"iteration": 0, "mode": "on_policy", "rollout_global_step": 0}
    return list(micro_batches(samples, info, {}, seed=0, iteration=0, ppo_epochs=sizes.pop("ppo_epochs", 1),
                              micro_batch_size=micro_batch_size, padding=lambda: StepSample.padding(0), **sizes))


@pytest.fixture(scope="module")
def recorded(pool, module):
    """Two episodes of 3 steps with the real policy, and every generation the policy returned."""
    torch.manual_seed(0)
    recorder = RecordingPolicy(module.policy)
    cfg = RolloutConfig(max_response_tokens=6, history_length=2)
    episodes, metrics = run_episodes(pool, recorder, [TASK, TASK], [0, 0], cfg)
    assert all(not e.failed and len(e.steps) == 3 for e in episodes)  # max_steps=3 cap (truncation)
    return recorder.generations, episodes, metrics


def test_steps_hold_exactly_what_was_generated(recorded):
    generations, episodes, metrics = recorded
    assert metrics["generated_tokens"] == sum(len(s.response_ids) for e in episodes for s in e.steps)
    # replies and those cut at max_response_tokens (no EOS within it), as rollout/replies_cut_frac counts them
    assert metrics["replies"] == 6 and metrics["replies_cut"] == sum(sum(gen.truncated) for _, gen in generations)
    for t in range(3):
        prompts, gen = generations[t]
        for i, episode in enumerate(episodes):
            step = episode.steps[t]
            assert step.rollout_prompt_ids is prompts[i] or step.rollout_prompt_ids == prompts[i]
            assert step.response_ids == gen.response_ids[i]
            assert step.rollout_log_probs == gen.log_probs[i]
            assert step.response_text == gen.texts[i]


def test_recomputed_old_log_probs_are_the_rollout_log_probs(recorded, module):
    samples, _ = _make_samples(recorded[1], norm_adv_by_std=True)
    assert len(samples) == 6
    score_samples(samples, module.policy, None, module.algorithm, chunk_size=4)
    for s in samples:
        assert s.old_prompt_ids == s.update_prompt_ids  # on-policy: one prompt
        assert s.old_log_probs.shape == (len(s.response_ids),)
        # recomputed with the same weights: the log-probs the tokens were sampled with
        torch.testing.assert_close(s.old_log_probs, torch.tensor(s.rollout_log_probs), atol=1e-4, rtol=1e-4)


def test_without_recomputation_old_log_probs_are_the_rollout_log_probs(recorded, module):
    samples, _ = _make_samples(recorded[1], norm_adv_by_std=True)
    score_samples(samples, module.policy, None, dataclasses.replace(module.algorithm, recompute_old_log_probs=False))
    assert all(s.old_log_probs.tolist() == pytest.approx(s.rollout_log_probs) for s in samples)


def test_micro_batch_response_masks_mark_each_response(recorded):
    samples, _ = _make_samples(recorded[1], norm_adv_by_std=True)
    micro = _micro_batches(samples)
    assert [len(m.samples) for m in micro] == [3, 3]
    assert [m.last_micro for m in micro] == [False, True]
    total = sum(len(s.response_ids) for s in samples)
    assert all(m.batch_num_tokens == total and m.global_batch_size == 6 for m in micro)
    for m in micro:
        b = pack_batch([s.update_prompt_ids for s in m.samples], [s.response_ids for s in m.samples], 0)
        assert b["response_mask"].sum(1).tolist() == [len(s.response_ids) for s in m.samples]


def test_micro_batches_group_similar_lengths():
    """Each mini-batch is cut into micro-batches of similar lengths (less padding), keeping its samples and counts."""
    lengths = [10, 100, 12, 98, 50, 11, 99, 52]
    samples = [StepSample(rollout_prompt_ids=[1] * n, update_prompt_ids=[1] * n, old_prompt_ids=[1] * n,
                          response_ids=[2, 3], rollout_log_probs=[-1.0, -1.0], advantage=float(k))
               for k, n in enumerate(lengths)]
    micro = _micro_batches(samples, micro_batch_size=3, num_mini_batches=2)
    for mb in (0, 1):
        parts = [[len(s.update_prompt_ids) for s in m.samples] for m in micro if m.mini_batch == mb]
        flat = [n for part in parts for n in part]
        assert flat == sorted(flat) and len(flat) == 4, parts
        assert all(m.global_batch_size == 4 for m in micro if m.mini_batch == mb)
    assert sorted(s.advantage for m in micro for s in m.samples) == list(range(8))


def test_mini_batch_rows_set_the_optimizer_steps_by_the_rollouts_rows():
    """verl's ppo_mini_batch_size in rows: ⌈N / R⌉ optimizer steps per PPO epoch. The paper's ScienceWorld iteration
    (16 tasks x 8 episodes x 30 steps = 3,840 rows, 128 rows per step) takes 30; 1,024 rows take 8, one more row 9."""
    assert mini_batch_count(3840, mini_batch_rows=128) == 30
    assert mini_batch_count(16 * 64, mini_batch_rows=128) == 8
    assert mini_batch_count(16 * 64 + 1, mini_batch_rows=128) == 9
    assert mini_batch_count(0, mini_batch_rows=128) == 1  # the iteration's one (skipped) step
    assert mini_batch_count(3840, num_mini_batches=4) == mini_batch_count(7, num_mini_batches=4) == 4
    assert mini_batch_count(3840) == 1
    with pytest.raises(ValueError, match="data.num_mini_batches=2 and data.mini_batch_rows=128 are both set"):
        mini_batch_count(10, num_mini_batches=2, mini_batch_rows=128)
    with pytest.raises(ValueError, match="data.mini_batch_rows=0: expected an int >= 1"):
        mini_batch_count(10, mini_batch_rows=0)
    # 10 rows at 4 per step, 2 PPO epochs: 3 mini-batches of 4, 3, 3 rows per epoch, each row once per epoch, each
    # mini-batch's loss over its own rows (global_batch_size) and tokens
    samples = [StepSample(rollout_prompt_ids=[1, k], update_prompt_ids=[1, k], old_prompt_ids=[1, k],
                          response_ids=[2] * (1 + k % 3), rollout_log_probs=[-1.0] * (1 + k % 3), advantage=float(k),
                          key=(k, 0)) for k in range(10)]
    micro = _micro_batches(samples, micro_batch_size=2, mini_batch_rows=4, ppo_epochs=2)
    for epoch in (0, 1):
        rows = {mb: [s for m in micro if (m.ppo_epoch, m.mini_batch) == (epoch, mb) for s in m.samples]
                for mb in range(3)}
        assert sorted(len(r) for r in rows.values()) == [3, 3, 4]
        assert {(m.ppo_epoch, m.mini_batch) for m in micro if m.ppo_epoch == epoch} == {(epoch, b) for b in range(3)}
        assert sorted(s.advantage for r in rows.values() for s in r) == list(range(10))
        for mb, r in rows.items():
            parts = [m for m in micro if (m.ppo_epoch, m.mini_batch) == (epoch, mb)]
            assert all(m.global_batch_size == len(r) for m in parts)
            assert all(m.batch_num_tokens == sum(len(s.response_ids) for s in r) for m in parts)
            assert sum(m.last_micro for m in parts) == 1


def test_the_iteration_count_is_kept_with_the_checkpoint():
    """The next iteration is saved with the datamodule's state (the steps per iteration may follow the rollout); a
    checkpoint from before it was saved derives it from the global step."""
    dm = RolloutDataModule(env=ENV_CFG, algorithm={}, mini_batch_rows=4)
    dm.iteration = 7
    state = {"rng": [global_rng_state()], "no_signal_iterations": 0, "iteration": 7}
    fresh = RolloutDataModule(env=ENV_CFG, algorithm={}, mini_batch_rows=4)
    fresh.load_state_dict(state)
    assert fresh.iteration == 7 and fresh._next_iteration(global_step=100) == 7
    old = RolloutDataModule(env=ENV_CFG, algorithm={}, num_mini_batches=2)
    old.load_state_dict({k: v for k, v in state.items() if k != "iteration"})
    assert old.iteration is None and old._next_iteration(global_step=5) == 2  # 2 optimizer steps per iteration
    rows = RolloutDataModule(env=ENV_CFG, algorithm={}, mini_batch_rows=4)
    rows.load_state_dict({k: v for k, v in state.items() if k != "iteration"})
    with pytest.raises(ValueError, match="resume it with data.num_mini_batches"):
        rows._next_iteration(global_step=5)


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
    samples, _ = _make_samples(episodes, "off_policy", off_policy_old_log_prob="with_tips")
    assert samples[0].old_prompt_ids == first.rollout_prompt_ids  # π_old(a|s, tips): true importance ratio
    assert samples[0].update_prompt_ids == first.update_prompt_ids
    samples, _ = _make_samples(episodes, "off_policy", off_policy_old_log_prob="without_tips")
    assert samples[0].old_prompt_ids == first.update_prompt_ids


def test_the_paper_configs_show_tips_under_the_authors_header(tiny_policy):
    """``data.tips_header``: the paper configs use the authors' line above the tips, the CPU experiments ours; the
    tip-free update prompt has neither."""
    from hydra import compose, initialize_config_dir

    from src.data.step_prompt import step_prompt

    for experiment, header in (("scienceworld_paper", AUTHORS_TIPS_HEADER), ("webshop_paper", AUTHORS_TIPS_HEADER),
                               ("scienceworld", TIPS_HEADER), ("webshop", TIPS_HEADER)):
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
            data = compose("train", overrides=[f"experiment={experiment}"]).data
        cfg = RolloutConfig.from_data(data, use_tips=True, strip_tips_for_update=True)
        prompt = step_prompt(tiny_policy, cfg, "System.", "Find a chair.", [], "You see a chair.", None, 0, 5,
                             ["TIP-MARKER: focus on the chair."])
        text, update = (tiny_policy.tokenizer.decode(ids) for ids in (prompt.rollout_ids, prompt.update_ids))
        other = TIPS_HEADER if header == AUTHORS_TIPS_HEADER else AUTHORS_TIPS_HEADER
        assert header in text and other not in text and "TIP-MARKER" in text, experiment
        assert header not in update and "TIP-MARKER" not in update, experiment


def test_failed_episode_is_excluded_from_its_group():
    def ep(score, failed=False):
        step = StepRecord("o", [1], [1], [2], [-1.0], "a", "a", reward=score)
        return Episode(task=TASK, group=0, steps=[step], score=score, failed=failed)

    episodes = [ep(1.0), ep(3.0), ep(0.0, failed=True)]
    samples, metrics = _make_samples(episodes, norm_adv_by_std=True)
    assert len(samples) == 2  # the failed episode contributes no sample
    assert episode_metrics(episodes)["failed_episodes"] == 1  # the one count of failed episodes
    assert not any("failed" in k for k in metrics)
    # returns 1, 3 -> mean 2, Bessel std sqrt(2): advantages -+1/sqrt(2)
    assert samples[0].advantage == pytest.approx(-1 / np.sqrt(2), abs=1e-5)
    assert samples[1].advantage == pytest.approx(1 / np.sqrt(2), abs=1e-5)


def test_mode_draw_is_seeded_and_matches_p_q():
    modes = [draw_mode(0, i, 0.25, 2 / 3) for i in range(4000)]
    assert modes == [draw_mode(0, i, 0.25, 2 / 3) for i in range(4000)]
    # the seed matters: another seed gives another sequence (known answers: the experiments rely on seed 8)
    assert [draw_mode(1, i, 0.25, 2 / 3) for i in range(4000)] != modes
    assert [draw_mode(8, i, 0.25, 2 / 3) for i in range(2)] == ["on_policy", "off_policy"]
    assert [draw_mode(3, i, 0.25, 2 / 3) for i in range(4)] == ["off_policy", "on_policy", "on_policy_with_tips",
                                                                "off_policy"]
    freq = {m: modes.count(m) / len(modes) for m in set(modes)}
    assert freq["on_policy"] == pytest.approx(0.75, abs=0.03)
    assert freq["off_policy"] == pytest.approx(0.25 * 2 / 3, abs=0.03)
    assert freq["on_policy_with_tips"] == pytest.approx(0.25 / 3, abs=0.03)
    assert set(draw_mode(0, i, 0.0, 0.0) for i in range(100)) == {"on_policy"}


@pytest.fixture(scope="module")
def admissible_pool():
    with EnvPool({**ENV_CFG, "include_admissible_actions": True, "max_steps": 2}, num_workers=1) as p:
        yield p


def test_fitted_prompt_keeps_head_and_observation_of_the_kitchen(admissible_pool, tiny_policy):
    """The real kitchen state with its ~1,000 admissible actions (~6,700 tokens) against a 1,024-token budget:
    the action list is shortened, while system prompt, task, current observation, history and tips stay."""
    from src.data.prompts import HistoryItem, build_step_messages
    from src.data.step_prompt import fit_prompt

    first, info = admissible_pool.reset([(0, TASK)])[0]
    admissible_pool.step([(0, "go to kitchen")])
    kitchen, _, _, _, info = admissible_pool.step([(0, "look around")])[0]
    actions = info["admissible_actions"]
    assert len(actions) > 900 and "This room is called the kitchen" in kitchen
    tips = ["TIP-ONE: the red box is in the kitchen.", "TIP-TWO: focus on a chair first."]
    common = dict(system_prompt=admissible_pool.system_prompt, instruction=info["instruction"],
                  history=[HistoryItem(first, "go to kitchen")], observation=kitchen, admissible_actions=actions,
                  history_length=3, tips_scope="current", step=1, max_steps=30)
    full = tiny_policy.encode(build_step_messages(tips=tips, **common), truncate=False)
    assert len(full) > 4 * tiny_policy.max_prompt_tokens
    truncated_before, cuts = tiny_policy.num_prompts_truncated, {}
    shown_tips, fitted = fit_prompt(tiny_policy, common, tips, cuts)
    assert fitted["history_length"] == 1  # the one past step stays shown
    ids = tiny_policy.encode(build_step_messages(tips=shown_tips, **{**common, **fitted}))
    assert len(ids) <= tiny_policy.max_prompt_tokens and tiny_policy.num_prompts_truncated == truncated_before
    text = tiny_policy.tokenizer.decode(ids)
    for piece in (admissible_pool.system_prompt, info["instruction"], kitchen, *tips, "[Step 1] Action: go to kitchen"):
        assert piece in text, piece[:60]
    kept = fitted["admissible_shown"]
    assert 0 < kept < len(actions) and f"({kept} of {len(actions)} shown)" in text
    assert cuts == {"prompts_fitted": 1.0, "admissible_actions_cut": len(actions) - kept, "history_steps_cut": 0.0,
                    "tips_cut": 0.0}
    # Without the list, an observation too long for the budget is cut at its end; the head still survives.
    common = dict(common, admissible_actions=None, observation=kitchen * 20)
    _, fitted = fit_prompt(tiny_policy, common, None, cuts)
    text = tiny_policy.tokenizer.decode(tiny_policy.encode(build_step_messages(tips=None, **{**common, **fitted})))
    assert admissible_pool.system_prompt in text and info["instruction"] in text and kitchen in text
    assert cuts["observation_chars_cut"] > 0 and cuts["history_steps_cut"] == 1.0
    assert tiny_policy.num_prompts_truncated == truncated_before


def test_rollout_counts_what_prompt_fitting_cut(admissible_pool, tiny_policy):
    truncated_before, budget = tiny_policy.num_prompts_truncated, tiny_policy.max_prompt_tokens
    tiny_policy.max_prompt_tokens = 700  # the hallway prompt with its 114 actions is ~950 tokens
    try:
        episodes, metrics = run_episodes(admissible_pool, tiny_policy, [TASK], [0],
                                         RolloutConfig(max_response_tokens=4))
    finally:
        tiny_policy.max_prompt_tokens = budget
    assert metrics["prompt_fit/prompts_fitted"] == len(episodes[0].steps) == 2
    assert metrics["prompt_fit/admissible_actions_cut"] > 0
    assert tiny_policy.num_prompts_truncated == truncated_before


# ---------------------------------------------------------------------------- returns, failed episodes, history
def _step(reward: float, intrinsic: float = 0.0) -> StepRecord:
    return StepRecord("o", [1], [1], [2], [-1.0], "a", "a", reward=reward, intrinsic=intrinsic)


def test_intrinsic_reward_enters_the_discounted_return():
    """R = Σ_t γ^t (r_t + r_int_t), by hand with γ = 0.5, and the group advantages made from it."""
    with_bonus = Episode(task=TASK, group=0, steps=[_step(1.0, 0.5), _step(0.0, 0.25), _step(2.0)])
    without = Episode(task=TASK, group=0, steps=[_step(1.0), _step(0.0), _step(2.0)])
    # 1.5 + 0.5 · 0.25 + 0.25 · 2 = 2.125;  1 + 0 + 0.25 · 2 = 1.5
    assert with_bonus.discounted_return(0.5) == 2.125 and without.discounted_return(0.5) == 1.5
    assert with_bonus.discounted_return(0.5, bonus=False) == 1.5  # the environment's part, discounted the same way
    samples, _ = _make_samples([with_bonus, without], norm_adv_by_std=False, gamma=0.5)
    assert [s.advantage for s in samples] == [0.3125] * 3 + [-0.3125] * 3  # R - mean(R), mean 1.8125
    m = episode_metrics([with_bonus, without])
    assert (m["intrinsic_return"], m["extrinsic_return"], m["return"]) == (0.375, 3.0, 3.375)


def test_nan_reward_fails_the_episode_and_is_counted_once(tiny_policy):
    """An environment that returns a NaN reward (without crashing) fails that episode: one definition, one count."""
    from stub_envs import STUB_CFG

    cfg = {**STUB_CFG, "reward": 1.0, "max_steps": 3, "nan_variation": 1, "nan_step": 2}
    tasks = [{"task_name": "stub", "variation": v} for v in (0, 1, 0)]
    with EnvPool(cfg, num_workers=3) as stub_pool:
        episodes, _ = run_episodes(stub_pool, tiny_policy, tasks, [0, 0, 0], RolloutConfig(max_response_tokens=2))
    assert [e.failed for e in episodes] == [False, True, False]
    assert "non-finite reward nan at step 2" in episodes[1].error
    m = episode_metrics(episodes)
    assert m["failed_episodes"] == 1 and m["return"] == 3.0 and m["episodes"] == 3
    samples, adv = _make_samples(episodes)
    assert len(samples) == 6 and adv["adv/steps"] == 6 and not any("failed" in k for k in adv)


@pytest.fixture(scope="module")
def corrected_pool():
    with EnvPool({**ENV_CFG, "max_steps": 2, "action_correction": True}, num_workers=1) as p:
        yield p


class ScriptedPolicy(Policy):
    """The real policy (real ``encode``) whose replies are scripted texts, encoded to ids as generation would."""

    def __init__(self, base: Policy, replies: list[str]):
        super().__init__(base.model, base.tokenizer, base.max_response_tokens, base.max_prompt_tokens)
        self.replies = list(replies)

    def generate(self, prompt_ids, **kwargs) -> Generation:
        texts = [self.replies.pop(0) for _ in prompt_ids]
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        return Generation(ids, [[0.0] * len(i) for i in ids], texts, [False] * len(ids))


@pytest.mark.parametrize("history_action", ["raw", "executed"])
def test_history_shows_the_raw_output_or_the_executed_action(corrected_pool, tiny_policy, history_action):
    """With action correction the model's text and the executed action differ; the next prompt's history shows
    the raw output (default, the authors' record_original_action) or, as an option, the corrected action."""
    raw = "look aroundd"  # rejected by the parser, repaired to the valid "look around"
    policy = ScriptedPolicy(tiny_policy, [raw, "look around"])
    cfg = RolloutConfig(max_response_tokens=6, history_length=2, history_action=history_action)
    (episode,), _ = run_episodes(corrected_pool, policy, [TASK], [0], cfg)
    first, second = episode.steps
    assert first.response_text == raw and first.action == "look around" and first.valid_action
    prompt = tiny_policy.tokenizer.decode(second.rollout_prompt_ids)
    shown, hidden = (raw, first.action) if history_action == "raw" else (first.action, raw)
    assert f"[Step 1] Action: {shown}\n" in prompt and f"[Step 1] Action: {hidden}\n" not in prompt


@pytest.mark.parametrize("old_log_prob", ["with_tips", "without_tips"])
def test_off_policy_iteration_old_log_probs_end_to_end(pool, module, memory, old_log_prob, monkeypatch):
    """One off_policy iteration (``run_iteration``: real env, memory and policy, recomputed old log-probs): π_old is
    evaluated under the rollout prompt with its tips, or under the tip-free update prompt."""
    monkeypatch.setattr(memory, "tip_max_tokens", 4)  # the reflections are not under test
    obs, info = pool.reset([(0, TASK)])[0]
    key = memory.embed([memory.state_text(info["instruction"], obs)])
    memory.tips.add(memory.partition_key(TASK), key, ["TIP-OLD-LOG-PROB: focus on a chair."], [100.0], [0])
    algorithm = AlgorithmConfig.from_dict({"memory_rollout_prob": 1.0, "off_policy_prob": 1.0,
                                           "off_policy_old_log_prob": old_log_prob})
    settings = IterationSettings(algorithm=algorithm, rollout=RolloutConfig(max_response_tokens=6, history_length=2),
                                 data=DataConfig(tasks_per_iteration=1, group_size=2))
    parts = Collaborators(policy=module.policy, pool=pool, tasks=[TASK], memory=memory)
    batches = list(run_iteration(settings, parts, 0, 0, SignalGuard(algorithm)))
    assert {b.mode for b in batches} == {"off_policy"}
    samples = [s for b in batches for s in b.samples]
    assert len(samples) == sum(len(s.response_ids) > 0 for s in samples) > 0
    gaps = []
    for s in samples:
        with torch.no_grad():
            under = {name: module.policy.log_probs([getattr(s, name)], [s.response_ids])["log_probs"][0]
                     for name in ("rollout_prompt_ids", "update_prompt_ids")}
        expected = under["rollout_prompt_ids" if old_log_prob == "with_tips" else "update_prompt_ids"]
        torch.testing.assert_close(s.old_log_probs, expected, atol=1e-5, rtol=1e-5)
        if s.rollout_prompt_ids != s.update_prompt_ids:  # this step was shown tips
            gaps.append(float((under["rollout_prompt_ids"] - under["update_prompt_ids"]).abs().max()))
            torch.testing.assert_close(under["rollout_prompt_ids"], torch.tensor(s.rollout_log_probs),
                                       atol=1e-4, rtol=1e-4)
    # tips were shown, and they move the log-probs far beyond the tolerance: the wrong prompt could not pass
    assert gaps and max(gaps) > 1e-3


def test_pad_equal_to_eos_keeps_the_eos_in_the_loss_mask(tiny_policy):
    """With pad = EOS (many chat models) a response ending in EOS keeps that EOS: cut after it, mask 1, its
    log-prob trained. The stop token is one the tiny model really emits, declared EOS and pad."""
    import copy

    from src.models.policy import Policy

    prompts = [tiny_policy.encode([{"role": "user", "content": f"Say something about {w}."}]) for w in ("cats", "rain")]
    torch.manual_seed(0)
    sampled = tiny_policy.generate(prompts, max_new_tokens=8).response_ids[0]
    stop = next(t for k, t in enumerate(sampled) if k > 0 and t not in sampled[:k])  # a response of >= 2 tokens
    tokenizer = copy.deepcopy(tiny_policy.tokenizer)
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(stop)
    tokenizer.pad_token = tokenizer.eos_token
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == stop
    policy = Policy(tiny_policy.model, tokenizer, max_response_tokens=8)
    torch.manual_seed(0)
    gen = policy.generate(prompts)  # the same draws as above, up to the new EOS
    first = gen.response_ids[0]
    assert len(first) >= 2 and first[-1] == stop and stop not in first[:-1]
    out = policy.log_probs(prompts, gen.response_ids)
    assert out["response_mask"].sum(1).tolist() == [len(r) for r in gen.response_ids]
    assert out["response_mask"][0, len(first) - 1] == 1 and out["log_probs"][0, len(first) - 1] < 0
    torch.testing.assert_close(out["log_probs"][0, : len(first)], torch.tensor(gen.log_probs[0]), atol=1e-4, rtol=1e-4)


def test_datamodule_checkpoint_state_restores_the_global_generators():
    """Exact resume, the rest: the global Python/NumPy/torch generators and the no-signal counter round-trip through
    a checkpoint (``torch.load(weights_only=True)``, as Lightning resumes)."""
    import io
    import random

    dm = _datamodule({})
    dm.guard.no_signal_iterations = 2
    buf = io.BytesIO()
    torch.save(dm.state_dict(), buf)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    buf.seek(0)
    fresh = _datamodule({})
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected
    assert fresh.guard.no_signal_iterations == 2


def test_write_tips_stores_each_step_under_its_state_key(pool, tiny_policy, memory, monkeypatch):
    """After a rollout, every step of every episode is one memory entry in its episode's partition: key = the
    embedding of the state the step acted on, content = `<tip>; At that step the action taken was <a_k>; the
    episode's final score was <R>/<max>.` with one tip per episode, step = k (docs/method.md#memory, "Entries")."""
    from src.memory.tip_entry import format_entry

    monkeypatch.setattr(memory, "tip_max_tokens", 6)
    tasks = [{"task_name": TASK["task_name"], "variation": v} for v in (2, 3)]  # partitions no other test uses
    torch.manual_seed(0)
    episodes, _ = run_episodes(pool, tiny_policy, tasks, [0, 1], RolloutConfig(max_response_tokens=4), memory=memory)
    assert not any(e.failed for e in episodes)
    written = memory.write_tips(episodes, tiny_policy, pool.system_prompt)["tips_written"]
    assert written == sum(len(e.steps) for e in episodes)
    partitions = memory.tips.state_dict()["partitions"]
    for episode in episodes:
        part = partitions[memory.partition_key(episode.task)]
        stored = list(zip(part["entries"], torch.as_tensor(part["keys"]).numpy()))
        assert len(stored) == len(episode.steps)
        tips = set()
        for k, step in enumerate(episode.steps):
            suffix = format_entry("x", step.action, episode.score, episode.max_score)[1:]
            (entry, key), = [(e, key) for e, key in stored if e["step"] == k]
            assert entry["content"].endswith(suffix) and entry["score"] == episode.score
            np.testing.assert_array_equal(key, step.key)
            tips.add(entry["content"][: -len(suffix)])
        assert len(tips) == 1  # one reflection per episode, shared by its steps
    # the key is the state's embedding: instruction + the observation the step acted on
    first = episodes[0].steps[0]
    np.testing.assert_allclose(first.key, memory.embed([memory.state_text(episodes[0].instruction, first.observation)])[0],
                               atol=1e-6)


def test_reflection_continues_the_last_rollout_prompt_from_its_kept_keys_values(pool, tiny_policy, memory):
    """Tip writing after a rollout that kept each episode's last prompt: the reflection prompt is that prompt, its
    action, then a turn with the steps it did not show; only the new ids are computed (docs/method.md#memory)."""
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


def test_a_reflection_example_is_the_prompt_the_memory_reflects_under(pool, tiny_policy, memory):
    """The warm start's reflection examples (src/data/reflections.py) are rendered from a trajectory exactly as the
    memory renders the reflection on the same episode after a rollout: continued and fresh, token for token."""
    from src.data.reflections import reflection_examples
    from src.envs.scienceworld_demos import scienceworld_tip

    torch.manual_seed(7)
    cfg = RolloutConfig(max_response_tokens=4, history_length=1, keep_reflection_prefix=True)
    episodes, _ = run_episodes(pool, tiny_policy, [TASK, TASK], [0, 0], cfg, memory=memory)
    for continue_last in (True, False):
        for episode in episodes:
            steps = episode.steps
            record = {"task": episode.task, "instruction": episode.instruction,
                      "initial_observation": steps[0].observation, "actions": [s.action for s in steps],
                      "responses": [s.response_text for s in steps], "response_ids": [s.response_ids for s in steps],
                      "observations": [s.observation for s in steps[1:]] + [episode.final_observation],
                      "score": episode.score, "max_score": episode.max_score}
            (example,) = reflection_examples(tiny_policy, [record], pool.system_prompt, cfg, None, scienceworld_tip,
                                             48, continue_last)
            kept = episode.reflection_prefix
            episode.reflection_prefix = kept if continue_last else None
            ids, prefix, _ = memory.reflection_prompt(tiny_policy, pool.system_prompt, episode)
            episode.reflection_prefix = kept
            assert (prefix is not None) == continue_last
            assert example.prompt_ids == ids


@pytest.mark.parametrize("raise_in, raise_type", [("step", "ValueError"), ("reset", "ValueError"),
                                                  ("step", "RuntimeError")])
def test_an_environment_exception_fails_that_episode_only(tiny_policy, caplog, raise_in, raise_type):
    """An exception from an environment's ``step`` or ``reset`` fails that episode, counted once as a failed episode
    and warned about once per kind; the other episodes of the batch finish and give samples."""
    import logging

    from stub_envs import STUB_CFG

    cfg = {**STUB_CFG, "reward": 1.0, "max_steps": 2, "raise_variation": 1, "raise_in": raise_in,
           "raise_type": raise_type}
    tasks = [{"task_name": "stub", "variation": v} for v in (0, 1, 1, 0)]
    with EnvPool(cfg, num_workers=4) as stub_pool, caplog.at_level(logging.DEBUG, logger="src.data.rollout"):
        episodes, _ = run_episodes(stub_pool, tiny_policy, tasks, [0, 0, 1, 1], RolloutConfig(max_response_tokens=2))
        restarts = stub_pool.num_restarts
    assert [e.failed for e in episodes] == [False, True, True, False]
    assert all(f"{raise_type}: injected in {raise_in} of variation 1" in e.error for e in episodes if e.failed)
    assert restarts == (2 if raise_type == "RuntimeError" else 0)  # a ValueError leaves the worker as it is
    m = episode_metrics(episodes)
    assert m["failed_episodes"] == 2 and m["episodes"] == 4
    samples, adv = _make_samples(episodes)
    assert len(samples) == 4 and adv["adv/steps"] == 4
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "failed" in r.getMessage()]
    assert len(warnings) <= 1  # the second failure of the same kind is not warned again
