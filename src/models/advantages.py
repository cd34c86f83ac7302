"""GRPO advantages: episode returns normalised within their group (docs/method.md#one-iteration, step 4)."""
from __future__ import annotations

import torch
from torch import Tensor

from src.models.core_algos import check_shape


def compute_grpo_advantages(
    returns: Tensor,
    group_index: Tensor,
    norm_adv_by_std: bool = True,
    eps: float = 1e-6,
    extrinsic_returns: Tensor | None = None,
    semantics: str = "paper",
) -> tuple[Tensor, dict[str, float]]:
    """``A_i = (R_i - mean_g) / (std_g + eps)`` over each group's valid episodes (Bessel-corrected std);
    ``norm_adv_by_std=False``: the Dr.GRPO form ``A_i = R_i - mean_g``. A group whose valid returns are all equal, or
    with fewer than two, gets exactly 0; a non-finite return (NaN: a failed episode; ±inf alike) is left out of its
    group and gets 0. ``semantics="authors"``: verl's GRPO advantage as the EMPO² authors run it, a one-episode group
    getting its raw return and a non-finite return making its group NaN (docs/reproducing.md, difference 7).

    Returns ``(advantages [E] in the dtype of returns, metrics)``; ``bonus_only_group_frac``: groups with non-zero
    advantages and equal ``extrinsic_returns`` (the bonus alone ranks them). Raises ValueError: ``returns`` not 1-D,
    ``group_index`` / ``extrinsic_returns`` of another shape, a non-integer ``group_index``."""
    if returns.ndim != 1:
        raise ValueError(f"returns must be 1-D [E], got shape {tuple(returns.shape)}")
    check_shape("group_index", group_index, returns.shape)
    if extrinsic_returns is not None:
        check_shape("extrinsic_returns", extrinsic_returns, returns.shape)
    if group_index.is_floating_point() or group_index.is_complex() or group_index.dtype == torch.bool:
        raise ValueError(f"group_index must be an integer tensor, got dtype {group_index.dtype}")
    out_dtype = returns.dtype if returns.is_floating_point() else torch.float32
    if returns.numel() == 0:
        metrics = dict(adv_mean=0.0, adv_std=0.0, return_mean=0.0, zero_var_group_frac=0.0,
                       bonus_only_group_frac=0.0, num_failed_episodes=0.0, num_groups=0.0)
        return returns.new_zeros(0, dtype=out_dtype), metrics

    _, gid = torch.unique(group_index, return_inverse=True)
    num_groups = int(gid.max()) + 1
    # float64 so that group sums of large returns keep their precision.
    r = returns.double()
    valid = torch.isfinite(r)
    zeros = r.new_zeros(num_groups)
    n = zeros.index_add(0, gid, valid.double())
    mean = zeros.index_add(0, gid, torch.where(valid, r, 0.0)) / n.clamp(min=1)
    dev = torch.where(valid, r - mean[gid], 0.0)
    std = (zeros.index_add(0, gid, dev.square()) / (n - 1).clamp(min=1)).sqrt()
    # equality on the raw returns: mean([3.7]*3) need not be 3.7, and R - mean / (std + eps) would be large
    degenerate = (n < 2) | _all_equal(r, valid, gid, num_groups)
    bonus_only = torch.zeros_like(degenerate)
    if extrinsic_returns is not None:
        bonus_only = ~degenerate & _all_equal(extrinsic_returns.double(), valid, gid, num_groups)
    adv = dev / (std[gid] + eps) if norm_adv_by_std else dev
    adv = torch.where(valid & ~degenerate[gid], adv, 0.0)
    if semantics == "authors":
        size = zeros.index_add(0, gid, torch.ones_like(r))
        poisoned = zeros.index_add(0, gid, (~valid).double()) > 0
        adv = torch.where((size == 1)[gid], r / (1.0 + eps), adv)
        adv = torch.where(poisoned[gid], torch.nan, adv)

    n_valid = int(valid.sum())
    adv_valid, r_valid = adv[valid], r[valid]
    metrics = dict(
        adv_mean=float(adv_valid.mean()) if n_valid else 0.0,
        adv_std=float(adv_valid.std()) if n_valid > 1 else 0.0,
        return_mean=float(r_valid.mean()) if n_valid else 0.0,
        zero_var_group_frac=float(degenerate.double().mean()),
        bonus_only_group_frac=float(bonus_only.double().mean()),
        num_failed_episodes=float(returns.numel() - n_valid),
        num_groups=float(num_groups),
    )
    return adv.to(out_dtype), metrics


def _all_equal(values: Tensor, valid: Tensor, gid: Tensor, num_groups: int) -> Tensor:
    """``[num_groups]`` bool: the group's valid ``values`` are all equal (True for a group without one)."""
    v_max = values.new_full((num_groups,), -torch.inf).scatter_reduce(
        0, gid, torch.where(valid, values, -torch.inf), "amax")
    v_min = values.new_full((num_groups,), torch.inf).scatter_reduce(
        0, gid, torch.where(valid, values, torch.inf), "amin")
    return v_max <= v_min
