"""The compute dtype of each phase of a rollout (``model.policy.rollout_precision``), by measurement.

A rollout has two phases with opposite shapes: the prefill multiplies hundreds of prompt tokens at once (wide
products, where bf16 wins on CPUs with AVX512-BF16 or AMX), a decoding step a few rows (skinny products, where bf16
autocast loses: it casts every fp32 master weight at every step; a SmolLM2 step for 8 rows measured ~160 ms in fp32
against ~350 ms under bf16 autocast on a 2-core AVX512-BF16 EPYC). So each phase gets its own dtype:

- ``trainer``: both under the Trainer's precision context (autocast under ``bf16-mixed``), as the update computes;
- ``fp32``: no autocast in either phase (the weights' own dtype: fp32 master weights);
- ``bf16-prefill`` / ``bf16-decode``: bf16 autocast in that phase only; ``bf16``: in both;
- ``auto`` (default): on a CPU a timed probe of a prefill-shaped and a decode-shaped product, each phase bf16 only
  where it is ``MIN_BF16_SPEEDUP`` times faster; on a GPU ``trainer``. Chosen once per process tree (DDP ranks and
  workers inherit it through ``ENV_VAR``) and logged.

The log-probs the loss uses still come from the training forward; ``algorithm.rollout_is`` covers the mismatch.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable, ContextManager

log = logging.getLogger(__name__)

ROLLOUT_PRECISIONS = ("auto", "trainer", "fp32", "bf16-prefill", "bf16-decode", "bf16")
MIN_BF16_SPEEDUP = 1.25  # as trainer.precision=auto (src/utils/precision_choice.py)
ENV_VAR = "EMPO2_ROLLOUT_PRECISION"


def probe_phases(hidden: int = 576, ffn: int = 1536, prefill_rows: int = 128, decode_rows: int = 8,
                 max_seconds: float = 0.2) -> dict[str, float]:
    """bf16-autocast speed-up over fp32 (> 1: bf16 faster) of a ``[rows, hidden] @ [hidden, ffn]`` product with fp32
    weights on the CPU, for a prefill (``prefill_rows``) and a decoding step (``decode_rows``): ``{"prefill",
    "decode"}``, best of up to 6 repetitions after a warm-up. Bounded: a dtype stops once it has taken ``max_seconds``
    (an emulated bf16 product on an AVX2 CPU is ~50x slower, and one repetition shows it)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(ffn, hidden, generator=generator)
    out = {}
    for phase, rows in (("prefill", prefill_rows), ("decode", decode_rows)):
        x = torch.randn(rows, hidden, generator=generator)
        best = {}
        for bf16 in (False, True):
            times, start = [], time.perf_counter()
            for _ in range(7):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    tic = time.perf_counter()
                    torch.nn.functional.linear(x, weight)
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
    return choice, (f"bf16 autocast {probe['prefill']:.2f}x fp32's speed in a prefill product, "
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


def phase_contexts(value: str, device_type: str) -> tuple[Callable[[], ContextManager] | None,
                                                          Callable[[], ContextManager] | None]:
    """(prefill context, decoding-step context) factories for a resolved ``value``; (None, None) for ``trainer``
    (both phases inherit the caller's context)."""
    import torch

    if value == "trainer":
        return None, None

    def autocast(bf16: bool) -> Callable[[], ContextManager]:
        return lambda: torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16)

    return autocast(value in ("bf16", "bf16-prefill")), autocast(value in ("bf16", "bf16-decode"))


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
    from src.utils.startup_checks import on_cuda

    cuda = on_cuda(str((cfg.get("trainer") or {}).get("accelerator", "cpu")).lower())
    value = rollout_precision(str(policy.get("rollout_precision", "auto")), "cuda" if cuda else "cpu")
    with open_dict(policy):
        policy.rollout_precision = value
    return value
