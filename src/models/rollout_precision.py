"""The compute dtype of each phase of a rollout (``model.policy.rollout_precision``), by measurement.

A rollout has two phases with opposite shapes: the prefill multiplies hundreds of prompt tokens at once (wide
products, compute-bound, where bf16 wins on CPUs with AVX512-BF16 or AMX), a decoding step a few rows (skinny
products, bound by the bytes of the weights). So each phase gets its own dtype, each in the form that phase gains from:

- a bf16 prefill runs under bf16 autocast (each weight is cast once per call, against hundreds of tokens);
- bf16 decoding steps run a bf16 copy of the weights (``src/models/inference_copy.py``; the weights themselves
  where they are bf16 already): autocast casts frozen fp32 weights again at every step, and caches the casts of
  trainable ones only inside one enclosing autocast region; the copy reads bf16 bytes in training and evaluation.

The values: ``trainer`` (both phases under the Trainer's precision context, as the update computes), ``fp32`` (no
autocast, the fp32 weights), ``bf16-prefill``, ``bf16-decode``, ``bf16`` (both), and ``auto`` (default): on a CPU a
timed probe of a prefill-shaped product (bf16 autocast against fp32) and a decode-shaped one (bf16 weights against
fp32 weights), each phase bf16 only where it is ``MIN_BF16_SPEEDUP`` times faster; on a GPU ``trainer``. Chosen once
per process tree (DDP ranks and workers inherit it through ``ENV_VAR``) and logged. Under FSDP, whose sharded weights
cannot be copied, ``auto`` keeps the decoding steps in fp32 and an explicit bf16 decoding is refused at start-up.

The log-probs the loss uses still come from the training forward; ``algorithm.rollout_is`` covers the mismatch.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

log = logging.getLogger(__name__)

ROLLOUT_PRECISIONS = ("auto", "trainer", "fp32", "bf16-prefill", "bf16-decode", "bf16")
MIN_BF16_SPEEDUP = 1.25  # as trainer.precision=auto (src/utils/precision_choice.py)
ENV_VAR = "EMPO2_ROLLOUT_PRECISION"
BF16_DECODE = ("bf16", "bf16-decode")  # the values whose decoding steps run the bf16 inference copy


def probe_phases(hidden: int = 576, ffn: int = 1536, prefill_rows: int = 128, decode_rows: int = 8,
                 decode_matrices: int = 48, max_seconds: float = 0.2) -> dict[str, float]:
    """bf16's speed-up over fp32 (> 1: bf16 faster) on the CPU of each phase's products in the form it would run
    them: a prefill, ``[prefill_rows, hidden] @ [hidden, ffn]`` under bf16 autocast over fp32 weights; a decoding
    step, ``[decode_rows, hidden]`` through ``decode_matrices`` weights ``[hidden, ffn]`` in bf16 (the inference
    copy), 170 MB in fp32 by default: a step streams its weights from memory, and one small matrix that stays in
    the caches does not show it (on the Xeon of docs/performance.md one such product measured 0.9-1.5x, 48 of them
    2.1x, SmolLM2's whole step 1.8x). ``{"prefill", "decode"}``, best of up to 6 repetitions after a warm-up.
    Bounded: a dtype stops once it has taken ``max_seconds`` (an emulated bf16 product on an AVX2 CPU is ~50x
    slower, and one repetition shows it)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    out = {}
    for phase, rows, count in (("prefill", prefill_rows, 1), ("decode", decode_rows, decode_matrices)):
        weight = torch.randn(ffn, hidden, generator=generator)
        weights = [weight] + [weight.clone() for _ in range(count - 1)]  # distinct memory, as a model's layers
        x = torch.randn(rows, hidden, generator=generator)
        best = {}
        for bf16 in (False, True):
            copied = bf16 and phase == "decode"
            inputs, ws = (x.bfloat16(), [w.bfloat16() for w in weights]) if copied else (x, weights)
            times, start = [], time.perf_counter()
            for _ in range(7):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16 and not copied):
                    tic = time.perf_counter()
                    for w in ws:
                        torch.nn.functional.linear(inputs, w)
                    times.append(time.perf_counter() - tic)
                if time.perf_counter() - start > max_seconds:
                    break
            best[bf16] = min(times[1:] or times)  # the first call warms up
        out[phase] = best[False] / best[True]
    return out


def decide_rollout_precision(device_type: str, probe: dict[str, float] | None = None) -> tuple[str, str]:
    """(the phases' precision for ``auto``, a one-line reason) from measured facts: ``probe_phases`` on a CPU.

    Raises:
        ValueError: a CPU without its probe.
    """
    if device_type != "cpu":
        return "trainer", "a GPU: the Trainer's precision in both phases"
    if probe is None:
        raise ValueError("decide_rollout_precision('cpu') needs probe_phases()")
    fast = {phase: probe[phase] >= MIN_BF16_SPEEDUP for phase in ("prefill", "decode")}
    choice = {(False, False): "fp32", (True, False): "bf16-prefill", (False, True): "bf16-decode",
              (True, True): "bf16"}[fast["prefill"], fast["decode"]]
    return choice, (f"bf16 autocast {probe['prefill']:.2f}x fp32's speed in a prefill product, bf16 weights "
                    f"{probe['decode']:.2f}x in a decoding one, on this CPU")


def rollout_precision(value: str, device_type: str) -> str:
    """``value`` with ``auto`` replaced by this process tree's choice (``decide_rollout_precision``, logged once).

    Raises:
        ValueError: a value not in ``ROLLOUT_PRECISIONS``.
    """
    if value not in ROLLOUT_PRECISIONS:
        raise ValueError(f"model.policy.rollout_precision={value!r}: expected one of {ROLLOUT_PRECISIONS}")
    if value != "auto":
        return value
    inherited = os.environ.get(ENV_VAR, "").split("|", 1)
    if len(inherited) == 2 and inherited[0] == device_type:
        return inherited[1]
    choice, reason = decide_rollout_precision(device_type, probe_phases() if device_type == "cpu" else None)
    os.environ[ENV_VAR] = f"{device_type}|{choice}"
    log.info("Rollout precision: %s (%s; model.policy.rollout_precision=auto, override with e.g. "
             "model.policy.rollout_precision=fp32)", choice, reason)
    return choice


def phase_settings(value: str, device_type: str, model, inference_copy, synced: bool = False) -> dict[str, Any]:
    """``rollout_engine.decode``'s keyword arguments for a resolved ``value``: the prefill's and the decoding steps'
    context factories, the keys/values' dtype for the steps and, with bf16 decoding, the model the steps run
    (``inference_copy.refreshed(model)``: ``src/models/inference_copy.py``). ``{}`` for ``trainer`` (both phases
    inherit the caller's context, the steps run ``model``).

    Raises:
        ValueError: bf16 decoding steps with ``synced`` (FSDP: sharded weights cannot be copied).
    """
    import torch

    if value == "trainer":
        return {}
    bf16_prefill, bf16_decode = value in ("bf16", "bf16-prefill"), value in BF16_DECODE
    if bf16_decode and synced:
        raise ValueError(f"model.policy.rollout_precision={value} under FSDP: expected fp32, bf16-prefill or trainer")
    step_model = inference_copy.refreshed(model) if bf16_decode else model
    # no cast cache in the prefill: inside the Trainer's autocast it would keep a second bf16 copy of the trainable
    # weights for the whole rollout, and a prefill casts each weight once per call anyway
    return {"prefill_context": lambda: torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16_prefill,
                                                      cache_enabled=False),
            # the steps' weights carry their dtype: autocast off, also inside the Trainer's
            "step_context": lambda: torch.autocast(device_type, enabled=False),
            "cache_dtype": next(step_model.parameters()).dtype, "step_model": step_model}


def resolve_rollout_precision(cfg) -> str | None:
    """Replace ``model.policy.rollout_precision=auto`` in ``cfg`` by this machine's choice (``rollout_precision`` for
    the device ``trainer.accelerator`` names), so the logged config says what ran. Returns it (None without a policy).

    Raises:
        ValueError: an unknown value.
    """
    from omegaconf import open_dict

    policy = (cfg.get("model") or {}).get("policy")
    if policy is None:
        return None
    from src.utils.startup_checks import on_cuda, sharded

    trainer = cfg.get("trainer") or {}
    requested = str(policy.get("rollout_precision", "auto"))
    value = rollout_precision(requested, "cuda" if on_cuda(str(trainer.get("accelerator", "cpu")).lower()) else "cpu")
    if requested == "auto" and value in BF16_DECODE and sharded(trainer):
        value = {"bf16": "bf16-prefill", "bf16-decode": "fp32"}[value]
        log.info("Rollout precision under FSDP: %s (its sharded weights cannot be copied for bf16 decoding steps)",
                 value)
    with open_dict(policy):
        policy.rollout_precision = value
    return value
