"""The losses of GRPO / EMPO² (docs/method.md#one-iteration, step 8), plain torch. Shapes: ``B`` rows, ``T``
right-padded response tokens (``response_mask`` marks real ones).

The loss is a partial sum (docs/design.md#why-it-is-shaped-this-way): with the denominators counted once on the
global batch (:func:`loss_denominators`, all-reduced), the SUM of micro-batch losses over ranks is the full-batch
loss, whatever the micro-batching; DDP averages gradients, so the caller multiplies by the world size."""
from __future__ import annotations

import torch
from torch import Tensor

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_KINDS = ("kl", "abs", "mse", "low_var_kl")
MASK_LEVELS = ("token", "sequence")
ROLLOUT_IS_LEVELS = ("none", "token", "sequence")  # rollout importance-sampling correction (TIS)
UPDATE_MODES = ("on_policy", "on_policy_with_tips", "off_policy")


# exp() of a float32 log-ratio overflows above ~88, and inf * 0 (a zero advantage) is NaN. |log ρ| = 20 is far
# outside every clip range: the clamp changes no loss value that matters (such tokens are clipped or have ρ·A ≈ 0).
_MAX_LOG_RATIO = 20.0


def check_shape(name: str, t: Tensor, shape: torch.Size | tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def _check_count(name: str, count: int | float | Tensor | None) -> None:
    # Tensors (e.g. all-reduced counts) are not checked here, to avoid a device sync.
    if count is not None and not isinstance(count, Tensor) and count <= 0:
        raise ValueError(f"{name} must be > 0, got {count}")


def low_prob_token_mask(
    log_probs: Tensor,
    response_mask: Tensor,
    log_threshold: float = -5.0,
    level: str = "token",
) -> Tensor:
    """Keep-mask ``[B, T]`` (bool, False on padding) of low-probability token masking
    (docs/method.md#low-probability-token-masking): ``token`` keeps tokens with ``log_prob >= log_threshold`` (log δ;
    -5: δ ≈ 0.0067), ``sequence`` whole rows whose minimum is. Raises ValueError (unknown level, shapes differ)."""
    if level not in MASK_LEVELS:
        raise ValueError(f"unknown mask level {level!r}; expected one of {MASK_LEVELS}")
    check_shape("response_mask", response_mask, log_probs.shape)
    lp = log_probs.detach()
    resp = response_mask.bool()
    if level == "token":
        return resp & (lp >= log_threshold)
    row_min = torch.where(resp, lp, torch.inf).amin(dim=-1, keepdim=True)
    return resp & (row_min >= log_threshold)


def authors_low_prob_mask(old_log_probs: Tensor, response_mask: Tensor, log_threshold: float = -5.0) -> Tensor:
    """Keep-mask of the EMPO² authors' masking (docs/reproducing.md, difference 2): a whole response is dropped when its
    minimum π_old log-prob (``[B, T]``, under the rollout prompt) is below ``log_threshold``. Equal to
    ``low_prob_token_mask(old_log_probs, response_mask, log_threshold, "sequence")`` except that a NaN log-prob keeps
    its row here (NaN < threshold is false), as in their code."""
    check_shape("response_mask", response_mask, old_log_probs.shape)
    resp = response_mask.bool()
    row_min = torch.where(resp, old_log_probs.detach(), torch.inf).amin(dim=-1, keepdim=True)
    return resp & ~(row_min < log_threshold)


def loss_denominators(response_mask: Tensor) -> tuple[int, int]:
    """``(response tokens, rows with at least one)`` of ``response_mask`` ``[B, T]``, as :func:`aggregate_loss` counts
    them; summed over micro-batches and ranks they are ``batch_num_tokens`` / ``global_batch_size``."""
    resp = response_mask.bool()
    return int(resp.sum()), int(resp.any(dim=-1).sum())


def aggregate_loss(
    loss_mat: Tensor,
    mask: Tensor,
    loss_agg_mode: str = "token-mean",
    batch_num_tokens: int | float | Tensor | None = None,
    global_batch_size: int | float | Tensor | None = None,
) -> Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar in its dtype: ``token-mean``, sum / token count;
    ``seq-mean-token-mean`` / ``-token-sum``, each row's mean / sum, summed / row count. Counts default to the local
    ones (an empty row adds 0, never NaN); values outside ``mask`` (even NaN) are ignored.
    Raises ValueError for an unknown mode, differing shapes or a python-number count ``<= 0``."""
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; expected one of {LOSS_AGG_MODES}")
    check_shape("mask", mask, loss_mat.shape)
    _check_count("batch_num_tokens", batch_num_tokens)
    _check_count("global_batch_size", global_batch_size)
    m = mask.bool()
    masked = torch.where(m, loss_mat, 0.0)
    if loss_agg_mode == "token-mean":
        denom = m.sum().clamp(min=1) if batch_num_tokens is None else batch_num_tokens
        return masked.sum() / denom
    tokens_per_row = m.sum(dim=-1)
    row_loss = masked.sum(dim=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        row_loss = row_loss / tokens_per_row.clamp(min=1)
    denom = (tokens_per_row > 0).sum().clamp(min=1) if global_batch_size is None else global_batch_size
    return row_loss.sum() / denom


def compute_policy_loss(
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    loss_agg_mode: str = "token-mean",
    keep_mask: Tensor | None = None,
    token_weights: Tensor | None = None,
    batch_num_tokens: int | float | Tensor | None = None,
    global_batch_size: int | float | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip policy loss with asymmetric clipping and dual clip (docs/method.md#one-iteration, step 8): per response
    token ``ρ = exp(logπ - logπ_old)``, ``L = -min(ρA, clip(ρ, 1 - clip_ratio_low, 1 + clip_ratio_high) A)``, for
    ``A < 0`` also ``L = min(L, -clip_ratio_c · A)``. Tokens with ``keep_mask`` False get ``L = 0`` but stay in the
    denominator, so the global counts can be computed before the forward pass.

    ``advantages`` is ``[B]`` (broadcast over tokens) or ``[B, T]``; ``token_weights`` ``[B, T]`` (e.g.
    :func:`rollout_is_weights`; None multiplies by nothing, not even 1). Returns ``(loss [], metrics)``, metrics over
    response tokens (``approx_kl`` is k3). Raises ValueError (shapes, clip parameters, ``loss_agg_mode``)."""
    if not 0.0 <= clip_ratio_low < 1.0 or clip_ratio_high < 0.0:
        raise ValueError(f"need 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, got "
                         f"{clip_ratio_low}, {clip_ratio_high}")
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
    if log_prob.ndim != 2:
        raise ValueError(f"log_prob must be [B, T], got shape {tuple(log_prob.shape)}")
    check_shape("old_log_prob", old_log_prob, log_prob.shape)
    check_shape("response_mask", response_mask, log_prob.shape)
    if advantages.shape == log_prob.shape[:1]:
        advantages = advantages.unsqueeze(-1)
    elif advantages.shape != log_prob.shape:
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected "
                         f"{tuple(log_prob.shape[:1])} or {tuple(log_prob.shape)}")
    advantages = advantages.detach()
    resp = response_mask.bool()

    log_ratio = (log_prob - old_log_prob.detach()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    pg_dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(pg, pg_dual_bound), pg)

    if token_weights is not None:
        check_shape("token_weights", token_weights, log_prob.shape)
        pg_losses = pg_losses * token_weights.detach()
    if keep_mask is not None:
        check_shape("keep_mask", keep_mask, log_prob.shape)
    keep = resp if keep_mask is None else resp & keep_mask.bool()
    loss = aggregate_loss(torch.where(keep, pg_losses, 0.0), resp, loss_agg_mode,
                          batch_num_tokens, global_batch_size)

    md = torch.promote_types(log_prob.dtype, torch.float32)
    return loss, _policy_loss_metrics(loss, ratio, log_ratio, pg, pg_clipped, pg_unclipped, pg_dual_bound,
                                      negative, resp, keep, md)


@torch.no_grad()
def _policy_loss_metrics(loss: Tensor, ratio: Tensor, log_ratio: Tensor, pg: Tensor, pg_clipped: Tensor,
                         pg_unclipped: Tensor, pg_dual_bound: Tensor, negative: Tensor, resp: Tensor,
                         keep: Tensor, md: torch.dtype) -> dict[str, float]:
    """The metrics of :func:`compute_policy_loss`, computed in ``md``."""
    n = resp.sum().clamp(min=1)

    def masked_mean(x: Tensor) -> Tensor:
        return torch.where(resp, x.to(md), 0.0).sum() / n

    # ratio > 0, so 0 on padding never wins the max; amax of an empty tensor raises.
    ratio_max = torch.where(resp, ratio, 0.0).amax() if ratio.numel() else ratio.new_zeros(())
    # one .tolist(): one device sync
    values = torch.stack([
        loss.detach().to(md),
        masked_mean(pg_clipped > pg_unclipped),
        masked_mean(negative & (pg > pg_dual_bound)),
        masked_mean(ratio - 1.0 - log_ratio),
        masked_mean(ratio),
        ratio_max.to(md),
        masked_mean(resp & ~keep),
    ]).tolist()
    names = ("pg_loss", "clip_frac", "dual_clip_frac", "approx_kl", "ratio_mean", "ratio_max", "masked_frac")
    return dict(zip(names, values))


@torch.no_grad()
def rollout_is_weights(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    level: str = "token",
    cap: float = 2.0,
) -> tuple[Tensor, dict[str, float]]:
    """Truncated importance weights of the trainer's π_old against the distribution that sampled the tokens (TIS;
    docs/method.md#rollout-importance-sampling-correction): rollout and trainer forwards differ (KV cache, precision,
    kernels), by ``Δ = old_log_prob − rollout_log_prob`` (``[B, T]`` each, nats). ``token``:
    ``w_t = min(exp(Δ_t), C)``; ``sequence``: ``w = min(exp(Σ_t Δ_t), C)`` for every token of the row.

    Returns ``(weights [B, T], metrics)``: weights at least float32, 1 outside ``response_mask``; metrics over the
    masked tokens (0 when none). Raises ValueError for an unknown ``level``, ``cap < 1`` or differing shapes."""
    if level not in ROLLOUT_IS_LEVELS[1:]:
        raise ValueError(f"unknown rollout importance-sampling level {level!r}; expected one of "
                         f"{ROLLOUT_IS_LEVELS[1:]}")
    if not cap >= 1.0:
        raise ValueError(f"the rollout importance-weight cap must be >= 1, got {cap!r}")
    check_shape("rollout_log_prob", rollout_log_prob, old_log_prob.shape)
    check_shape("response_mask", response_mask, old_log_prob.shape)
    dtype = torch.promote_types(torch.promote_types(old_log_prob.dtype, rollout_log_prob.dtype), torch.float32)
    m = response_mask.bool()
    diff = torch.where(m, old_log_prob.to(dtype) - rollout_log_prob.to(dtype), 0.0)
    log_w = diff if level == "token" else diff.sum(dim=-1, keepdim=True).expand_as(diff)
    raw = torch.exp(log_w.clamp(max=_MAX_LOG_RATIO))  # the clamp only keeps exp finite: e^20 is far above any cap
    weights = torch.where(m, raw.clamp(max=cap), 1.0)
    names = ("rollout_is_weight_mean", "rollout_is_weight_max", "rollout_is_truncated_frac", "rollout_log_prob_diff",
             "rollout_log_prob_diff_max")
    if not bool(m.any()):
        return weights, dict.fromkeys(names, 0.0)
    w, d = weights[m], diff[m].abs()
    values = torch.stack([w.mean(), w.amax(), (raw[m] > cap).to(dtype).mean(), d.mean(), d.amax()]).tolist()
    return weights, dict(zip(names, values))


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, kind: str = "low_var_kl") -> Tensor:
    """Per-token KL estimate ``[B, T]`` between the current and reference log-probs (nats; the reference detached):
    Schulman's k1 ``kl`` (``logp - ref``), ``abs`` (``|logp - ref|``), k2 ``mse`` (``½ (logp - ref)²``) or k3
    ``low_var_kl`` (``exp(ref - logp) - (ref - logp) - 1``, clamped to [-10, 10] as verl does). Raises ValueError."""
    if kind not in KL_KINDS:
        raise ValueError(f"unknown kl kind {kind!r}; expected one of {KL_KINDS}")
    check_shape("ref_log_probs", ref_log_probs, log_probs.shape)
    diff = log_probs - ref_log_probs.detach()
    if kind == "kl":
        return diff
    if kind == "abs":
        return diff.abs()
    if kind == "mse":
        return 0.5 * diff.square()
    # the final clamp bounds the penalty (and its gradient) where the two policies disagree wildly
    log_ratio = (-diff).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)


def compute_kl_loss(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    response_mask: Tensor,
    kind: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    batch_num_tokens: int | float | Tensor | None = None,
    global_batch_size: int | float | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """:func:`kl_penalty` aggregated like the policy loss. Returns ``(loss [], {"kl_loss": float})``;
    the caller adds ``β · loss`` (β = ``algorithm.kl_coef``)."""
    loss = aggregate_loss(kl_penalty(log_probs, ref_log_probs, kind), response_mask, loss_agg_mode,
                          batch_num_tokens, global_batch_size)
    return loss, {"kl_loss": float(loss.detach())}
