"""Known-answer tests for src/models/advantages.py and src/models/core_algos.py (docs/method.md#one-iteration, steps
4–5; the rollout importance weights). Expected values are worked out by hand in the comments; float64 is used where
the arithmetic is compared tightly."""
from __future__ import annotations

import math

import pytest
import torch

from src.models.advantages import compute_grpo_advantages
from src.models.core_algos import (
    aggregate_loss,
    compute_kl_loss,
    compute_policy_loss,
    kl_penalty,
    loss_denominators,
    low_prob_token_mask,
    rollout_is_weights,
)

EPS = 1e-6
CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.3, "clip_ratio_c": 10.0}  # the paper's, as in the YAML
F64 = torch.float64


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


# ------------------------------------------------------------------------------------------- advantages


def test_grpo_single_group_known_answer():
    # [1, 2, 3]: mean 2, Bessel var ((1)² + 0 + (1)²) / 2 = 1, std 1 -> [-1, 0, 1] / (1 + 1e-6)
    adv, m = compute_grpo_advantages(t([1.0, 2.0, 3.0]), torch.tensor([0, 0, 0]))
    torch.testing.assert_close(adv, t([-1.0, 0.0, 1.0]) / (1 + EPS), rtol=0, atol=1e-15)
    assert m["num_failed_episodes"] == 0 and m["num_groups"] == 1 and m["zero_var_group_frac"] == 0


def test_grpo_interleaved_groups_with_arbitrary_ids():
    # group 7: [1, 2, 3] -> [-1, 0, 1]/(1+eps); group 3: [10, 20, 30]: mean 20, var (100+0+100)/2 = 100,
    # std 10 -> [-10, 0, 10]/(10+eps)
    returns = t([1.0, 10.0, 2.0, 20.0, 3.0, 30.0])
    adv, _ = compute_grpo_advantages(returns, torch.tensor([7, 3, 7, 3, 7, 3]))
    expected = t([-1 / (1 + EPS), -10 / (10 + EPS), 0.0, 0.0, 1 / (1 + EPS), 10 / (10 + EPS)])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize("value", [-100.0, 3.7])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_grpo_all_equal_group_is_exactly_zero(value, dtype):
    adv, m = compute_grpo_advantages(torch.full((4,), value, dtype=dtype), torch.zeros(4, dtype=torch.long))
    assert torch.equal(adv, torch.zeros(4, dtype=dtype))
    assert m["zero_var_group_frac"] == 1.0
    adv, _ = compute_grpo_advantages(torch.full((4,), value, dtype=dtype), torch.zeros(4, dtype=torch.long),
                                     norm_adv_by_std=False)
    assert torch.equal(adv, torch.zeros(4, dtype=dtype))


def test_grpo_bonus_only_groups_known_answer():
    # Four groups of two. g0: environment returns 1, 1, bonuses 0.002, 0.001 -> ranked by the bonus alone, and
    # the std normalisation makes it the full scale: std = 0.001 / sqrt(2), A = ±(0.0005 / (0.000707.. + eps)).
    # g1: 1 and 0 (the environment ranks them); g2: equal returns with equal bonuses (no signal);
    # g3: one episode failed (NaN, left out), the other alone -> no signal; g4: a failed episode (left out) beside
    # two that earned 1 with different bonuses -> bonus-only. bonus-only: 2 of 5 groups.
    returns = t([1.002, 1.001, 1.003, 0.001, 0.5, 0.5, float("nan"), 1.0, float("nan"), 1.002, 1.001])
    extrinsic = t([1.0, 1.0, 1.0, 0.0, 0.5, 0.5, float("nan"), 1.0, float("nan"), 1.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 4])
    adv, m = compute_grpo_advantages(returns, groups, extrinsic_returns=extrinsic)
    half, std = 0.0005, 0.001 / math.sqrt(2)
    torch.testing.assert_close(adv[:2], t([half, -half]) / (std + EPS), rtol=1e-9, atol=0)
    assert 0.70 < float(adv[0]) < 0.71  # a 1e-3 bonus difference gets an advantage of ~0.71
    torch.testing.assert_close(adv[8:], adv.new_tensor([0.0, float(adv[0]), float(adv[1])]), rtol=0, atol=0)
    assert m["bonus_only_group_frac"] == 0.4 and m["zero_var_group_frac"] == 0.4
    _, m = compute_grpo_advantages(returns, groups)
    assert m["bonus_only_group_frac"] == 0.0  # without the environment's part it cannot be told
    with pytest.raises(ValueError, match="extrinsic_returns"):
        compute_grpo_advantages(returns, groups, extrinsic_returns=extrinsic[:3])


def test_grpo_nan_episode_excluded():
    # valid [1, 3, 5]: mean 3, var (4 + 0 + 4)/2 = 4, std 2 -> [-2, 0, 2]/(2+eps); the NaN one -> 0
    returns = t([1.0, float("nan"), 3.0, 5.0])
    adv, m = compute_grpo_advantages(returns, torch.zeros(4, dtype=torch.long))
    assert torch.isfinite(adv).all()
    torch.testing.assert_close(adv, t([-2 / (2 + EPS), 0.0, 0.0, 2 / (2 + EPS)]), rtol=0, atol=1e-15)
    assert m["num_failed_episodes"] == 1
    assert all(math.isfinite(v) for v in m.values())


def test_grpo_dr_grpo_mode():
    # R - mean: group 0 [1, 2, 3] - 2 = [-1, 0, 1]; group 1 [0, 4] - 2 = [-2, 2] (interleaved)
    adv, _ = compute_grpo_advantages(t([1.0, 0.0, 2.0, 4.0, 3.0]), torch.tensor([0, 1, 0, 1, 0]),
                                     norm_adv_by_std=False)
    assert torch.equal(adv, t([-1.0, -2.0, 0.0, 2.0, 1.0]))


def test_grpo_single_valid_episode_groups_are_zero():
    # group 0: one episode; group 1: one valid + one NaN; group 2: [4, 4]; group 3: [0, 2] -> ±1/(√2 + eps)
    # (mean 1, var (1 + 1)/1 = 2)
    returns = t([5.0, 1.0, float("nan"), 4.0, 4.0, 0.0, 2.0])
    adv, m = compute_grpo_advantages(returns, torch.tensor([0, 1, 1, 2, 2, 3, 3]))
    s = 1 / (math.sqrt(2) + EPS)
    torch.testing.assert_close(adv, t([0.0, 0.0, 0.0, 0.0, 0.0, -s, s]), rtol=0, atol=1e-15)
    assert m["zero_var_group_frac"] == 0.75  # groups 0, 1, 2 of 4
    assert m["num_failed_episodes"] == 1


def test_grpo_bad_input():
    with pytest.raises(ValueError, match="1-D"):
        compute_grpo_advantages(torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        compute_grpo_advantages(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="group_index"):
        compute_grpo_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))


# ------------------------------------------------------------------------------------------- policy loss


def _lp(ratios):
    """log_probs, old_log_probs [1, T] (float64) with the given ratios; log_probs requires grad."""
    old = t([[-1.0] * len(ratios)])
    lp = (old + torch.log(t([ratios]))).requires_grad_()
    return lp, old


def test_policy_loss_clip_cases_known_answer():
    # ε_low 0.2, ε_high 0.3, c 10; per token L:
    # ρ=1.1, A=+1: -min(1.1, 1.1) = -1.1                       (not clipped)
    # ρ=1.5, A=+1: -min(1.5, 1.3) = -1.3                       (clipped)
    # ρ=0.5, A=-1: -min(-0.5, -0.8) = 0.8; min(0.8, 10) = 0.8  (clipped)
    # ρ=20,  A=-1: -min(-20, -1.3) = 20; min(20, -c·A = 10) = 10  (dual clip, plain clip not active)
    # ρ=0.5, A=+2: -min(1.0, 0.8·2 = 1.6) = -1.0               (not clipped)
    # token-mean = (-1.1 - 1.3 + 0.8 + 10 - 1.0) / 5 = 7.4 / 5 = 1.48
    ratios = [1.1, 1.5, 0.5, 20.0, 0.5]
    lp, old = _lp(ratios)
    adv = t([[1.0, 1.0, -1.0, -1.0, 2.0]])
    mask = torch.ones(1, 5, dtype=torch.bool)
    loss, m = compute_policy_loss(old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask, **CLIP)
    assert loss.item() == pytest.approx(1.48, abs=1e-12)
    assert m["pg_loss"] == pytest.approx(1.48, abs=1e-12)
    assert m["clip_frac"] == pytest.approx(2 / 5)
    assert m["dual_clip_frac"] == pytest.approx(1 / 5)
    # k3 per token: (ρ - 1) - ln ρ
    kl = [(r - 1) - math.log(r) for r in ratios]
    assert m["approx_kl"] == pytest.approx(sum(kl) / 5, abs=1e-12)
    assert m["ratio_mean"] == pytest.approx(23.6 / 5) and m["ratio_max"] == pytest.approx(20.0)
    assert m["masked_frac"] == 0.0
    # dL/dlogp = -A·ρ/5 on the unclipped tokens (1 and 5), 0 on clipped / dual-clipped ones
    loss.backward()
    torch.testing.assert_close(lp.grad, t([[-1.1 / 5, 0.0, 0.0, 0.0, -2 * 0.5 / 5]]), rtol=0, atol=1e-12)


def test_policy_loss_asymmetric_clip():
    # A=+1: ρ=1.25 < 1.3 -> L=-1.25 (not clipped); ρ=1.35 -> L=-1.3 (clipped)
    # A=-1: ρ=0.85 > 0.8 -> -min(-0.85, -0.8) = 0.85 (not clipped); ρ=0.75 -> -min(-0.75, -0.8) = 0.8
    for ratio, a, expected, clipped in [(1.25, 1.0, -1.25, 0.0), (1.35, 1.0, -1.3, 1.0),
                                        (0.85, -1.0, 0.85, 0.0), (0.75, -1.0, 0.8, 1.0)]:
        lp, old = _lp([ratio])
        loss, m = compute_policy_loss(old_log_prob=old, log_prob=lp, advantages=t([a]), response_mask=torch.ones(1, 1),
                                      clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_c=10.0)
        assert loss.item() == pytest.approx(expected, abs=1e-12), ratio
        assert m["clip_frac"] == clipped, ratio


def test_policy_loss_broadcast_advantages_and_padding():
    # rows: A=+1 with ρ=[1.1, pad], A=-1 with ρ=[1.0, 1.2]; padding has a NaN log-prob (ignored)
    # L: row0 [-1.1], row1 [-min(-1, -1) = 1, -min(-1.2, -1.2) = 1.2] -> token-mean (-1.1 + 1 + 1.2)/3 = 1.1/3
    old = t([[-1.0, -1.0], [-1.0, -1.0]])
    lp = old + torch.log(t([[1.1, 1.0], [1.0, 1.2]]))
    lp[0, 1] = float("nan")
    mask = t([[1, 0], [1, 1]])
    loss_b, m = compute_policy_loss(old_log_prob=old, log_prob=lp, advantages=t([1.0, -1.0]), response_mask=mask, **CLIP)
    loss_bt, _ = compute_policy_loss(old_log_prob=old, log_prob=lp, advantages=t([[1.0, 1.0], [-1.0, -1.0]]),
                                     response_mask=mask, **CLIP)
    assert loss_b.item() == pytest.approx(1.1 / 3, abs=1e-12)
    assert loss_bt.item() == loss_b.item()
    assert all(math.isfinite(v) for v in m.values())


def test_policy_loss_bad_input():
    lp = torch.zeros(2, 3)
    args = dict(old_log_prob=lp, log_prob=lp, response_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="advantages"):
        compute_policy_loss(**args, advantages=torch.zeros(3), **CLIP)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss(**args, advantages=torch.zeros(2), **{**CLIP, "clip_ratio_c": 1.0})
    with pytest.raises(ValueError, match="loss_agg_mode"):
        compute_policy_loss(**args, advantages=torch.zeros(2), loss_agg_mode="mean", **CLIP)
    # keyword-only: old and new log-probs can never be swapped by position
    with pytest.raises(TypeError):
        compute_policy_loss(lp, lp, torch.zeros(2), torch.ones(2, 3), **CLIP)


# ------------------------------------------------------------------------------------------------ masking


def test_low_prob_mask_token_and_sequence():
    lp = t([[-1.0, -6.0, -5.0], [-0.1, -4.99, -5.01]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # token: keep >= -5 (so -5 itself is kept); padding always False
    expected_tok = torch.tensor([[True, False, True], [True, True, False]])
    assert torch.equal(low_prob_token_mask(lp, mask, -5.0, "token"), expected_tok)
    # sequence: row 0 min -6 < -5 -> dropped; row 1 min over real tokens is -4.99 (the -5.01 is padding)
    expected_seq = torch.tensor([[False, False, False], [True, True, False]])
    assert torch.equal(low_prob_token_mask(lp, mask, -5.0, "sequence"), expected_seq)
    with pytest.raises(ValueError, match="'step'"):
        low_prob_token_mask(lp, mask, level="step")


def test_masked_tokens_zero_gradient_denominator_unchanged():
    # ρ = 1, A = +1 -> L = -1 per token; token 1 masked -> 0; token-mean over all 4 response tokens:
    # (-1 + 0 - 1 - 1) / 4 = -0.75 (not -1: the masked token stays in the denominator)
    lp, old = _lp([1.0, 1.0, 1.0, 1.0])
    keep = torch.tensor([[True, False, True, True]])
    loss, m = compute_policy_loss(old_log_prob=old, log_prob=lp, advantages=t([1.0]), response_mask=torch.ones(1, 4),
                                  keep_mask=keep, **CLIP)
    assert loss.item() == pytest.approx(-0.75, abs=1e-12)
    assert m["masked_frac"] == pytest.approx(0.25)
    loss.backward()
    # dL/dlogp = -A·ρ/4 = -0.25 on kept tokens, exactly 0 on the masked one
    torch.testing.assert_close(lp.grad, t([[-0.25, 0.0, -0.25, -0.25]]), rtol=0, atol=1e-12)
    assert lp.grad[0, 1].item() == 0.0


def test_low_prob_mask_through_policy_loss():
    # current log-probs [-1, -7] (ρ = 1 each, A = +1), threshold -5 -> token 1 masked; loss = (-1 + 0)/2
    lp = t([[-1.0, -7.0]]).requires_grad_()
    keep = low_prob_token_mask(lp, torch.ones(1, 2))
    loss, m = compute_policy_loss(old_log_prob=lp.detach(), log_prob=lp, advantages=t([1.0]),
                                  response_mask=torch.ones(1, 2), keep_mask=keep, **CLIP)
    assert loss.item() == pytest.approx(-0.5) and m["masked_frac"] == 0.5


# -------------------------------------------------------------------------------------------- aggregation

LOSS = t([[1.0, 2.0, 3.0], [4.0, 5.0, float("nan")]])  # the NaN sits on padding: must be ignored
RAGGED = torch.tensor([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 2.5),            # (1 + 2 + 3 + 4) / 4
    ("seq-mean-token-mean", 3.0),   # (6/3 + 4/1) / 2 = (2 + 4) / 2
    ("seq-mean-token-sum", 5.0),    # (6 + 4) / 2
])
def test_aggregate_modes_known_answer(mode, expected):
    assert aggregate_loss(LOSS, RAGGED, mode).item() == pytest.approx(expected)


def test_aggregate_global_counts():
    # token-mean: 10 / 8; seq modes: (2 + 4) / 4 and (6 + 4) / 5
    assert aggregate_loss(LOSS, RAGGED, "token-mean", batch_num_tokens=8).item() == pytest.approx(1.25)
    assert aggregate_loss(LOSS, RAGGED, "seq-mean-token-mean", global_batch_size=4).item() == pytest.approx(1.5)
    assert aggregate_loss(LOSS, RAGGED, "seq-mean-token-sum", global_batch_size=5).item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="batch_num_tokens"):
        aggregate_loss(LOSS, RAGGED, batch_num_tokens=0)


def test_aggregate_empty_rows():
    # row 1 has no response token: it is not counted as a sequence and yields no NaN
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    assert aggregate_loss(LOSS, mask, "token-mean").item() == pytest.approx(2.0)           # 6 / 3
    assert aggregate_loss(LOSS, mask, "seq-mean-token-mean").item() == pytest.approx(2.0)  # (6/3) / 1
    assert aggregate_loss(LOSS, mask, "seq-mean-token-sum").item() == pytest.approx(6.0)   # 6 / 1
    assert loss_denominators(mask) == (3, 1)
    empty = torch.zeros(2, 3)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        assert aggregate_loss(LOSS, empty, mode).item() == 0.0
    with pytest.raises(ValueError, match="token-mean"):
        aggregate_loss(LOSS, RAGGED, "sum")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batching_invariance(mode):
    g = torch.Generator().manual_seed(0)
    B, T = 6, 5
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3
    lp = (old + 0.4 * torch.randn(B, T, generator=g, dtype=F64)).requires_grad_()
    adv = torch.randn(B, generator=g, dtype=F64)
    lengths = torch.tensor([5, 1, 3, 0, 4, 2])  # ragged, with one empty row
    mask = torch.arange(T) < lengths[:, None]
    keep = low_prob_token_mask(lp, mask, log_threshold=-2.5)

    full, _ = compute_policy_loss(old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask, loss_agg_mode=mode,
                                  keep_mask=keep, **CLIP)
    (grad_full,) = torch.autograd.grad(full, lp)

    n_tok, n_seq = loss_denominators(mask)
    assert (n_tok, n_seq) == (15, 5)
    total = 0.0
    for sl in (slice(0, 2), slice(2, 3), slice(3, 6)):  # uneven micro-batches
        part, _ = compute_policy_loss(old_log_prob=old[sl], log_prob=lp[sl], advantages=adv[sl], response_mask=mask[sl],
                                      loss_agg_mode=mode, keep_mask=keep[sl], batch_num_tokens=n_tok,
                                      global_batch_size=n_seq, **CLIP)
        total = total + part
    (grad_micro,) = torch.autograd.grad(total, lp)
    torch.testing.assert_close(total, full, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad_micro, grad_full, rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------------------------------ KL


def test_kl_kinds_known_answer():
    # token 0: logp = ln .5, ref = ln .25 -> d = logp - ref = ln 2; token 1: d = -ln 2
    # k1 = d; abs = |d|; k2 = ½ d² ; k3 = exp(-d) + d - 1: 0.5 + ln2 - 1, 2 - ln2 - 1
    lp, ref = t([[math.log(0.5), math.log(0.25)]]), t([[math.log(0.25), math.log(0.5)]])
    ln2 = math.log(2)
    expected = {
        "kl": [ln2, -ln2],
        "abs": [ln2, ln2],
        "mse": [0.5 * ln2 ** 2, 0.5 * ln2 ** 2],
        "low_var_kl": [0.5 + ln2 - 1, 2 - ln2 - 1],
    }
    for kind, values in expected.items():
        torch.testing.assert_close(kl_penalty(lp, ref, kind), t([values]), rtol=0, atol=1e-12)
    # k3 mean = (0.5 + ln2 - 1 + 2 - ln2 - 1) / 2 = 0.25
    loss, m = compute_kl_loss(lp, ref, torch.ones(1, 2))
    assert loss.item() == pytest.approx(0.25) and m["kl_loss"] == pytest.approx(0.25)
    # ref - logp = 30: exp(20) - 20 - 1 after the log-ratio clamp, then clamped to 10
    assert kl_penalty(t([[-30.0]]), t([[0.0]])).item() == 10.0
    with pytest.raises(ValueError, match="'k3'"):
        kl_penalty(lp, ref, "k3")


def test_algorithm_config_refuses_bad_choices():
    from src.models.algorithm_config import AlgorithmConfig

    AlgorithmConfig.from_dict({"loss_agg_mode": "token-mean", "mask_modes": ["off_policy"], "memory_rollout_prob": 0.25})
    AlgorithmConfig.from_dict({"skip_zero_advantage": True, "kl_coef": 0.0})
    for bad, match in [({"loss_agg_mode": "foo"}, "loss_agg_mode='foo'"),
                       ({"off_policy_old_log_prob": "nope"}, "off_policy_old_log_prob='nope'"),
                       ({"mask_level": "word"}, "mask_level='word'"),
                       ({"kl_type": "x"}, "kl_type='x'"),
                       ({"mask_modes": ["sometimes"]}, "sometimes"),
                       ({"memory_rollout_prob": 1.5}, "memory_rollout_prob=1.5"),
                       ({"no_signal_patience": 0}, "no_signal_patience=0"),
                       ({"clip_ratio_c": 1.0}, "clip_ratio_low/high/c=0.2/0.3/1.0"),
                       # a typo would silently fall back to the default
                       ({"clip_ratio_hgh": 0.28},
                        r"algorithm.clip_ratio_hgh: not an algorithm setting \(did you mean algorithm.clip_ratio_high\?"),
                       # a skipped zero-advantage step would silently lose its KL term
                       ({"skip_zero_advantage": True, "kl_coef": 0.01}, "skip_zero_advantage=true with .*kl_coef=0.01")]:
        with pytest.raises(ValueError, match=match):
            AlgorithmConfig.from_dict(bad)


def test_algorithm_config_one_default_per_field():
    """Missing keys take the dataclass defaults (plain GRPO); YAML integers become the field's float."""
    from src.models.algorithm_config import AlgorithmConfig

    a = AlgorithmConfig.from_dict({"kl_coef": 0, "mask_modes": None})
    assert (a.kl_coef, type(a.kl_coef), a.mask_modes, a.clip_ratio_high, a.memory_rollout_prob) == (0.0, float, [], 0.3, 0.0)


# ------------------------------------------------------------------------------ rollout importance weights
# Δ = old − rollout per token: row 0 [0.5, −1, 0], row 1 [1, −0.5, (padding)]
IS_OLD = [[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]]
IS_ROLLOUT = [[-1.5, -1.0, -0.5], [-2.0, -0.5, -9.0]]
IS_MASK = [[1, 1, 1], [1, 1, 0]]


def test_rollout_is_token_weights_known_values():
    w, m = rollout_is_weights(t(IS_OLD), t(IS_ROLLOUT), t(IS_MASK), level="token", cap=2.0)
    e = math.exp
    # min(e^Δ, 2): e^1 = 2.718 is truncated to 2; padding gets 1
    torch.testing.assert_close(w, t([[e(0.5), e(-1.0), 1.0], [2.0, e(-0.5), 1.0]]), atol=1e-12, rtol=0)
    assert m["rollout_is_weight_mean"] == pytest.approx((e(0.5) + e(-1.0) + 1.0 + 2.0 + e(-0.5)) / 5, abs=1e-12)
    assert m["rollout_is_weight_max"] == 2.0
    assert m["rollout_is_truncated_frac"] == pytest.approx(1 / 5)
    assert m["rollout_log_prob_diff"] == pytest.approx((0.5 + 1.0 + 0.0 + 1.0 + 0.5) / 5)  # mean |Δ|
    assert m["rollout_log_prob_diff_max"] == 1.0
    assert not w.requires_grad


def test_rollout_is_sequence_weights_known_values():
    e = math.exp
    # row sums of Δ: −0.5 and 0.5 → e^−0.5 and e^0.5 on every real token of the row
    w, m = rollout_is_weights(t(IS_OLD), t(IS_ROLLOUT), t(IS_MASK), level="sequence", cap=2.0)
    torch.testing.assert_close(w, t([[e(-0.5)] * 3, [e(0.5), e(0.5), 1.0]]), atol=1e-12, rtol=0)
    assert m["rollout_is_weight_mean"] == pytest.approx((3 * e(-0.5) + 2 * e(0.5)) / 5, abs=1e-12)
    assert m["rollout_is_weight_max"] == pytest.approx(e(0.5), abs=1e-12)
    assert m["rollout_is_truncated_frac"] == 0.0
    # cap 1.5 < e^0.5: row 1 is truncated to exactly 1.5
    w, m = rollout_is_weights(t(IS_OLD), t(IS_ROLLOUT), t(IS_MASK), level="sequence", cap=1.5)
    assert w[1, :2].tolist() == [1.5, 1.5] and m["rollout_is_truncated_frac"] == pytest.approx(2 / 5)


def test_rollout_is_weights_are_exactly_one_for_equal_log_probs_and_never_overflow():
    lp = torch.randn(3, 5, dtype=torch.float32)
    for level in ("token", "sequence"):
        w, m = rollout_is_weights(lp, lp.clone(), torch.ones(3, 5), level=level, cap=1.0)
        assert torch.equal(w, torch.ones(3, 5)) and m["rollout_log_prob_diff_max"] == 0.0
        assert m["rollout_is_truncated_frac"] == 0.0
    # Δ = 500 nats: e^500 overflows float32, the weight is the cap
    w, _ = rollout_is_weights(t([[0.0, 0.0]], torch.float32), t([[-500.0, 0.0]], torch.float32), torch.ones(1, 2),
                              level="sequence", cap=3.0)
    assert w.tolist() == [[3.0, 3.0]]
    _, m = rollout_is_weights(torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2))
    assert set(m.values()) == {0.0}  # no compared token


@pytest.mark.parametrize("kwargs, match", [({"level": "none"}, "unknown rollout importance-sampling level"),
                                           ({"cap": 0.5}, "cap must be >= 1")])
def test_rollout_is_weights_refuse_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rollout_is_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), **kwargs)


def test_policy_loss_with_token_weights_known_values():
    # ρ = 1 (log_prob = old), A = 1: L_t = −w_t; token-mean over 2 tokens: −(2 + 0.5) / 2 = −1.25;
    # dL/dlogπ_t = −w_t · A · ρ / 2 = [−1, −0.25]
    log_prob = t([[-1.0, -2.0]]).requires_grad_()
    loss, _ = compute_policy_loss(old_log_prob=t([[-1.0, -2.0]]), log_prob=log_prob, advantages=t([1.0]),
                                  response_mask=t([[1, 1]]), token_weights=t([[2.0, 0.5]]), **CLIP)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-1.25)
    torch.testing.assert_close(log_prob.grad, t([[-1.0, -0.25]]))
