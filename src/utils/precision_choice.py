"""``trainer.precision=auto``: bf16 compute only where this machine runs it faster than fp32.

A CPU without AMX or AVX512-BF16 emulates bf16 and runs it 10–70× *slower* than fp32, so at start-up a short timed
probe multiplies two matrices in both dtypes and the faster one wins. An explicit ``trainer.precision`` is never
changed. Trainable parameters stay fp32 master weights either way (``src/models/precision.py``).

The choice is made once per process tree and handed down in ``EMPO2_PRECISION_CHOICE``, not by a broadcast: every
rank builds its Trainer before the process group exists, and Lightning starts the ranks with the launcher's
environment.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from omegaconf import DictConfig, open_dict

log = logging.getLogger(__name__)

AUTO = "auto"
# bf16 must beat fp32 by this factor in the probe: autocast adds casts around every matmul, and the two
# outcomes seen on real CPUs (4-7x faster with AMX, 10-70x slower without) are far from this line.
MIN_BF16_SPEEDUP = 1.25
ENV_VAR = "EMPO2_PRECISION_CHOICE"
_announced: set[str] = set()


@dataclass(frozen=True)
class MatmulProbe:
    """Throughput of an ``n × n`` matmul on the CPU in each dtype (GFLOP/s)."""

    n: int
    fp32_gflops: float
    bf16_gflops: float

    @property
    def bf16_speedup(self) -> float:
        """bf16 throughput / fp32 throughput (> 1: bf16 is faster)."""
        return self.bf16_gflops / self.fp32_gflops


def cpu_features() -> str:
    """What torch reports of this CPU's bf16 support, e.g. ``"AVX512, AMX, AVX512-BF16"`` or ``"AVX2, no
    AVX512-BF16/AMX"``."""
    import torch

    capability = str(torch.backends.cpu.get_cpu_capability())
    amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    avx512_bf16 = bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
    found = [name for name, ok in (("AMX", amx), ("AVX512-BF16", avx512_bf16)) if ok]
    return f"{capability}, " + (", ".join(found) if found else "no AVX512-BF16/AMX")


def probe_cpu_matmul(n: int = 512, max_seconds: float = 0.5) -> MatmulProbe:
    """Time ``n × n`` matmuls in float32 and bfloat16 on the CPU (best of a few repetitions each, stopped after
    ``max_seconds``: one slow emulated repetition is enough to see it)."""
    import torch

    flops = 2.0 * n ** 3
    gflops = {}
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(n, n, generator=generator).to(dtype)
        b = torch.randn(n, n, generator=generator).to(dtype)
        best, start = float("inf"), time.perf_counter()
        for rep in range(6):
            tic = time.perf_counter()
            torch.mm(a, b)
            elapsed = time.perf_counter() - tic
            if rep > 0:  # the first call warms up (allocations, kernel selection)
                best = min(best, elapsed)
            if time.perf_counter() - start > max_seconds:
                best = min(best, elapsed)
                break
        gflops[dtype] = flops / best / 1e9
    return MatmulProbe(n, gflops[torch.float32], gflops[torch.bfloat16])


def decide_precision(accelerator: str, cuda_bf16: bool | None = None, probe: MatmulProbe | None = None,
                     features: str = "") -> tuple[str, str]:
    """The Lightning precision for ``trainer.precision=auto`` and the reason, from measured facts.

    ``cuda_bf16`` (``torch.cuda.is_bf16_supported()``) decides for ``"cuda"``, the ``probe`` for ``"cpu"``;
    ``features`` (``cpu_features``) only enters the reason. Returns (``"bf16-mixed"`` or ``"32-true"``, the reason).

    Raises:
        ValueError: an accelerator other than cpu/cuda, or the fact it needs is missing.
    """
    if accelerator == "cuda":
        if cuda_bf16 is None:
            raise ValueError("decide_precision('cuda') needs cuda_bf16 (torch.cuda.is_bf16_supported())")
        if cuda_bf16:
            return "bf16-mixed", "GPU with bf16 support; fp32 master weights"
        return "32-true", "this GPU has no bf16 support"
    if accelerator != "cpu":
        raise ValueError(f"decide_precision: accelerator {accelerator!r} is not 'cpu' or 'cuda'")
    if probe is None:
        raise ValueError("decide_precision('cpu') needs the matmul probe")
    speedup = probe.bf16_speedup
    where = f"on this CPU: {features}" if features else "on this CPU"
    if speedup >= MIN_BF16_SPEEDUP:
        return "bf16-mixed", (f"bf16 matmul {speedup:.1f}x faster than fp32 {where} "
                              f"({probe.bf16_gflops:.0f} vs {probe.fp32_gflops:.0f} GFLOP/s); fp32 master weights")
    slower = (f"{1 / speedup:.0f}x slower than" if speedup < 1 / 1.5 else f"only {speedup:.2f}x as fast as")
    return "32-true", (f"bf16 matmul {slower} fp32 {where} "
                       f"({probe.bf16_gflops:.1f} vs {probe.fp32_gflops:.0f} GFLOP/s)")


def _device_kind(accelerator: str) -> str:
    import torch

    accelerator = str(accelerator).lower()
    if accelerator in ("gpu", "cuda"):
        return "cuda"
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator == "cpu":
        return "cpu"
    raise ValueError(f"trainer.precision=auto supports trainer.accelerator cpu, gpu, cuda or auto; got {accelerator!r}"
                     f" (set trainer.precision explicitly)")


def resolve_precision(cfg: DictConfig) -> str | None:
    """Replace ``trainer.precision=auto`` in ``cfg`` by the choice of ``decide_precision`` and log it; an explicit
    value is left as it is (and logged once). Returns the precision, or None when ``cfg`` has no trainer group."""
    trainer = cfg.get("trainer")
    if trainer is None or trainer.get("precision") is None:
        return None
    precision = str(trainer.precision)
    if precision != AUTO:
        if precision not in _announced:  # entry points and the warm start all call this; say it once
            _announced.add(precision)
            log.info("Precision: %s (set by trainer.precision)", precision)
        return precision
    import torch

    kind = _device_kind(trainer.get("accelerator", "auto"))
    inherited = os.environ.get(ENV_VAR, "").split("|", 2)
    if len(inherited) == 3 and inherited[0] == kind:  # a DDP rank of a run that already chose
        choice, reason = inherited[1:]
    else:
        if kind == "cuda":
            choice, reason = decide_precision("cuda", cuda_bf16=torch.cuda.is_bf16_supported())
        else:
            choice, reason = decide_precision("cpu", probe=probe_cpu_matmul(), features=cpu_features())
        os.environ[ENV_VAR] = f"{kind}|{choice}|{reason}"
    with open_dict(cfg):
        trainer.precision = choice
    _announced.add(choice)
    log.info("Precision: %s (%s; trainer.precision=auto, override with e.g. trainer.precision=32-true)", choice, reason)
    return choice


def precision_problems(trainer: dict[str, Any]) -> list[str]:
    """``trainer.precision`` against Lightning's values and ``auto`` (this project's choice by measurement); fp16
    mixed precision on a CPU is refused (Lightning would run bf16 instead), as is Transformer Engine not installed."""
    import importlib.util
    import typing

    import torch
    from lightning.fabric.connector import _PRECISION_INPUT

    precision, accelerator = trainer.get("precision"), trainer.get("accelerator")
    allowed = [v for lit in typing.get_args(_PRECISION_INPUT) for v in typing.get_args(lit)]
    if precision not in allowed + ["auto", None] or isinstance(precision, bool):
        return [f"trainer.precision={precision!r}: expected auto or one of Lightning's "
                f"{[v for v in allowed if isinstance(v, str)]}"]
    on_cpu = accelerator == "cpu" or (accelerator in ("auto", None) and not torch.cuda.is_available())
    if str(precision) in ("16", "16-mixed") and on_cpu:
        return [f"trainer.precision={precision!r} on a CPU: Lightning would run bf16-mixed instead (fp16 autocast "
                "runs on GPUs); expected bf16-mixed, 32-true or auto"]
    if str(precision).startswith("transformer-engine") and importlib.util.find_spec("transformer_engine") is None:
        return [f"trainer.precision={precision!r}: transformer_engine is not installed"]
    return []
