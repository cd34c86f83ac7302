"""``algorithm.semantics=authors``: one known-answer test per difference between the paper (our default) and the
EMPO² authors' released code (docs/reproducing.md, "The authors' code, difference by difference"), each on
hand-made inputs, each against the default's answer on the same inputs."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from src.data.iteration import group_advantages
from src.data.prompts import HistoryItem
from src.data.rollout import Episode, StepRecord
from src.data.rollout_config import RolloutConfig
from src.data.samples import MicroBatch
from src.data.step_prompt import step_prompt
from src.memory.tip_memory import TipMemory
from src.models.advantages import compute_grpo_advantages
from src.models.algorithm_config import AlgorithmConfig
from src.models.core_algos import compute_policy_loss
from src.models.empo2_module import EMPO2Module

SEMANTICS = ("paper", "authors")


def _update_prompt(policy, semantics: str, tips_scope: str = "current") -> str:
    cfg = RolloutConfig(use_tips=True, strip_tips_for_update=True, strip_current_tips=semantics == "paper",
                        tips_scope=tips_scope)
    history = [HistoryItem("You are in the hall.", "go north", tips=["the hall is empty"])]
    prompt = step_prompt(policy, cfg, "You are an agent.", "Find the red key.", history, "You are in the kitchen.",
                         None, 1, 5, tips=["the key is in the drawer"])
    assert "the key is in the drawer" in policy.tokenizer.decode(prompt.rollout_ids)
    return policy.tokenizer.decode(prompt.update_ids)


@pytest.mark.parametrize("semantics", SEMANTICS)
def test_difference_1_the_current_steps_tips_stay_in_the_authors_off_policy_prompt(tiny_policy, semantics):
    current = _update_prompt(tiny_policy, semantics)
    assert ("the key is in the drawer" in current) == (semantics == "authors")
    past_and_current = _update_prompt(tiny_policy, semantics, tips_scope="all_steps")
    assert "the hall is empty" not in past_and_current  # a past step's block leaves in both
    assert ("the key is in the drawer" in past_and_current) == (semantics == "authors")


def _module(semantics: str, mask_modes: tuple[str, ...] = ("off_policy",)) -> SimpleNamespace:
    """What ``EMPO2Module._mask_and_denominators`` reads of the module, without a policy or a Trainer."""
    return SimpleNamespace(algorithm=AlgorithmConfig(semantics=semantics, mask_modes=list(mask_modes)), _trainer=None)


def _batch(tokens: int, mode: str = "off_policy", num_micro: int = 1, global_tokens: float | None = None):
    return MicroBatch(samples=[], loss_scale=1.0, batch_num_tokens=global_tokens or tokens, global_batch_size=1.0,
                      mode=mode, iteration=0, rollout_global_step=0, ppo_epoch=0, mini_batch=0, last_micro=True,
                      num_micro=num_micro)


@pytest.mark.parametrize("semantics, dropped", [("paper", 1), ("authors", 20)])
def test_difference_2_one_token_below_the_threshold_drops_the_whole_response_for_the_authors(semantics, dropped):
    """A 20-token response with one token at -6 (log δ = -5) under π_θ and π_old alike: ours masks that token,
    theirs (whole response, on π_old) all 20."""
    log_probs = torch.full((1, 20), -1.0)
    log_probs[0, 7] = -6.0
    mask = torch.ones(1, 20)
    keep, _ = EMPO2Module._mask_and_denominators(_module(semantics), _batch(20), log_probs, log_probs.clone(), mask)
    assert int((~keep).sum()) == dropped


def test_difference_2_the_authors_mask_reads_pi_old_in_every_mode_and_keeps_a_nan_row():
    old, current = torch.full((1, 4), -1.0), torch.full((1, 4), -1.0)
    old[0, 2] = -6.0  # only π_old is below the threshold
    mask = torch.ones(1, 4)
    keep, _ = EMPO2Module._mask_and_denominators(_module("authors"), _batch(4, mode="on_policy"), current, old, mask)
    assert not keep.any()  # on-policy too, from π_old
    keep, _ = EMPO2Module._mask_and_denominators(_module("paper"), _batch(4), current, old, mask)
    assert keep.all()  # ours reads π_θ
    old[0, 2] = float("nan")
    keep, _ = EMPO2Module._mask_and_denominators(_module("authors"), _batch(4), current, old, mask)
    assert keep.all()  # NaN < -5 is false in their rule


def _token_grads(semantics: str, mask_modes=("off_policy",)) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token gradients of the policy loss in two micro-batches of one mini-batch (43 and 6 response tokens,
    advantage 1, π_θ = π_old)."""
    grads = []
    for tokens in (43, 6):
        log_prob = torch.zeros(1, tokens, requires_grad=True)
        mask = torch.ones(1, tokens)
        keep, agg = EMPO2Module._mask_and_denominators(_module(semantics, mask_modes), _batch(
            tokens, num_micro=2, global_tokens=49.0), log_prob.detach(), log_prob.detach(), mask)
        loss, _ = compute_policy_loss(old_log_prob=log_prob.detach(), log_prob=log_prob, advantages=torch.ones(1),
                                      response_mask=mask, clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_c=10.0,
                                      keep_mask=keep, **agg)
        loss.backward()
        grads.append(log_prob.grad[0, 0].abs())
    return grads[0], grads[1]


@pytest.mark.parametrize("semantics, ratio", [("paper", 1.0), ("authors", 43 / 6)])
def test_difference_4_a_short_micro_batchs_tokens_weigh_more_for_the_authors(semantics, ratio):
    big, small = _token_grads(semantics)
    assert float(small / big) == pytest.approx(ratio, rel=1e-6)  # 7.2x for theirs
    if semantics == "paper":
        assert float(big) == pytest.approx(1 / 49)  # one token mean over the mini-batch's 49 tokens


@pytest.mark.parametrize("semantics, denominator", [("paper", 20), ("authors", 19)])
def test_difference_3_masked_tokens_leave_the_authors_token_mean(semantics, denominator):
    """One masked token of 20 (the authors' rule needs a row: two rows, one dropped), advantage 1: the kept tokens'
    gradient is 1 / (the denominator)."""
    log_prob = torch.zeros(2, 20, requires_grad=True)
    old = torch.zeros(2, 20)
    mask = torch.zeros(2, 20)
    mask[0, :19] = 1  # row 0: 19 tokens, kept
    mask[1, 0] = 1  # row 1: 1 token, below the threshold under π_θ and π_old
    old[1, 0] = -6.0
    current = log_prob.detach().clone()
    current[1, 0] = -6.0
    keep, agg = EMPO2Module._mask_and_denominators(_module(semantics), _batch(20), current, old, mask)
    loss, _ = compute_policy_loss(old_log_prob=log_prob.detach(), log_prob=log_prob, advantages=torch.ones(2),
                                  response_mask=mask, clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_c=10.0,
                                  keep_mask=keep, **agg)
    loss.backward()
    assert float(log_prob.grad[0, 0].abs()) == pytest.approx(1 / denominator)


@pytest.mark.parametrize("semantics", SEMANTICS)
def test_difference_5_equal_scores_the_authors_take_the_oldest_we_take_the_most_similar(semantics):
    """30 entries with equal stored scores, all above the threshold: the authors' ten are the ten oldest, ours the
    ten most similar (here the ten newest). Scores 0.46-0.54 all round to 0.5: a tie for the authors."""
    rng = np.random.default_rng(0)
    query = np.zeros(8, dtype=np.float32)
    query[0] = 1.0
    keys = []
    for i in range(30):  # cosine with the query grows with age: 0.6 .. 0.89
        v = rng.normal(size=8).astype(np.float32)
        v[0] = 0
        v = v / np.linalg.norm(v) * np.sqrt(1 - (0.6 + 0.01 * i) ** 2)
        v[0] = 0.6 + 0.01 * i
        keys.append(v / np.linalg.norm(v))
    memory = TipMemory(dim=8, embedder_name="test", threshold=0.5, top_k=10, semantics=semantics)
    memory.add("p", np.stack(keys), [f"tip {i}" for i in range(30)], [0.5] * 30, list(range(30)))
    got = [e.content for e in memory.retrieve(["p"], query[None])[0]]
    expected = range(10) if semantics == "authors" else range(29, 19, -1)
    assert got == [f"tip {i}" for i in expected]
    scores = [0.54 - 0.01 * (i % 9) for i in range(30)]  # 0.46..0.54: rounded, all 0.5
    rounded = TipMemory(dim=8, embedder_name="test", threshold=0.5, top_k=10, semantics=semantics)
    rounded.add("p", np.stack(keys), [f"tip {i}" for i in range(30)], scores, list(range(30)))
    got = [e.content for e in rounded.retrieve(["p"], query[None])[0]]
    if semantics == "paper":  # the highest unrounded scores first (0.54: tips 0, 9, 18, 27), the newest among them
        expected = [27, 18, 9, 0, 28, 19, 10, 1, 29, 20]
    assert got == [f"tip {i}" for i in expected]


def test_difference_5_a_cosine_of_exactly_the_threshold_is_in_for_the_authors():
    key = np.array([[0.5, np.sqrt(0.75)]], dtype=np.float32)
    query = np.array([[1.0, 0.0]], dtype=np.float32)
    found = {}
    for semantics in SEMANTICS:
        memory = TipMemory(dim=2, embedder_name="test", threshold=float(key[0, 0]), top_k=1, semantics=semantics)
        memory.add("p", key, ["tip"], [1.0], [0])
        found[semantics] = len(memory.retrieve(["p"], query)[0])
    assert found == {"paper": 0, "authors": 1}


def _episode(group: int, reward: float, bonus: float, eid: int) -> Episode:
    step = StepRecord(observation="o", rollout_prompt_ids=[1], update_prompt_ids=[1], response_ids=[2],
                      rollout_log_probs=[-1.0], response_text="a", action="a", reward=reward, intrinsic=bonus)
    return Episode(task={"task_name": "t", "variation": group}, group=group, id=eid, steps=[step])


def test_difference_6_the_novelty_bonus_is_not_in_the_authors_advantage():
    """Two episodes with the same environment return, one with a novelty bonus: ours ranks them by it, theirs
    does not (both advantages 0)."""
    episodes = [_episode(0, 1.0, 0.0, 0), _episode(0, 1.0, 0.5, 1)]
    ours, _ = group_advantages(episodes, AlgorithmConfig(semantics="paper"), rank=0)
    theirs, _ = group_advantages(episodes, AlgorithmConfig(semantics="authors"), rank=0)
    assert ours[1] > 0 > ours[0]
    assert theirs.tolist() == [0.0, 0.0]


def test_difference_7_a_one_episode_group_gets_its_raw_return_and_a_nan_poisons_its_group():
    returns = torch.tensor([3.0, 1.0, 2.0, float("nan"), 5.0], dtype=torch.float64)
    groups = torch.tensor([0, 1, 1, 2, 2])
    ours, _ = compute_grpo_advantages(returns, groups)
    theirs, _ = compute_grpo_advantages(returns, groups, semantics="authors")
    assert ours[0] == 0.0 and theirs[0] == pytest.approx(3.0, rel=1e-5)  # the singleton
    assert ours[3:].tolist() == [0.0, 0.0] and torch.isnan(theirs[3:]).all()  # the failed episode's group
    assert torch.equal(ours[1:3], theirs[1:3])  # an ordinary group: the same


def test_the_preset_runs_the_authors_semantics_with_their_shipped_values():
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    ROOT = Path(__file__).resolve().parents[1]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["algorithm=empo2_authors"])
    algo = AlgorithmConfig(**cfg.algorithm)
    assert (algo.semantics, algo.mask_modes, algo.clip_ratio_low, algo.clip_ratio_high, algo.clip_ratio_c) == (
        "authors", [], 0.2, 0.3, 10.0)
    assert cfg.data.tips_header == "Here are some memories you collected in your previous exploration:"
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        assert compose(config_name="train").algorithm.semantics == "paper"
