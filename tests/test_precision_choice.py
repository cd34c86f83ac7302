"""trainer.precision=auto: bf16 only where this machine runs it faster than fp32; explicit values untouched."""
from __future__ import annotations

import logging

import pytest
from omegaconf import OmegaConf

from src.utils import precision_choice
from src.utils.precision_choice import MatmulProbe, decide_precision, resolve_precision

# Figures measured on two real CPUs (1024² matmul, GFLOP/s): an AVX2-only AMD EPYC and an Intel Xeon with AMX.
AVX2_EPYC = MatmulProbe(1024, fp32_gflops=33.0, bf16_gflops=0.5)
AMX_XEON = MatmulProbe(1024, fp32_gflops=178.0, bf16_gflops=1247.0)


def test_a_cpu_whose_bf16_is_slow_gets_fp32_with_the_reason():
    precision, reason = decide_precision("cpu", probe=AVX2_EPYC, features="AVX2, no AVX512-BF16/AMX")
    assert precision == "32-true"
    assert reason == "bf16 matmul 66x slower than fp32 on this CPU: AVX2, no AVX512-BF16/AMX (0.5 vs 33 GFLOP/s)"


def test_a_cpu_whose_bf16_is_fast_gets_bf16_mixed():
    precision, reason = decide_precision("cpu", probe=AMX_XEON, features="AVX512, AMX, AVX512-BF16")
    assert precision == "bf16-mixed"
    assert reason.startswith("bf16 matmul 7.0x faster than fp32 on this CPU: AVX512, AMX, AVX512-BF16")


def test_bf16_barely_faster_than_fp32_is_not_worth_the_casts():
    assert decide_precision("cpu", probe=MatmulProbe(512, 100.0, 110.0))[0] == "32-true"
    assert decide_precision("cpu", probe=MatmulProbe(512, 100.0, 125.0))[0] == "bf16-mixed"


def test_gpus_use_bf16_where_they_support_it():
    assert decide_precision("cuda", cuda_bf16=True)[0] == "bf16-mixed"
    assert decide_precision("cuda", cuda_bf16=False) == ("32-true", "this GPU has no bf16 support")
    with pytest.raises(ValueError, match="needs cuda_bf16"):
        decide_precision("cuda")
    with pytest.raises(ValueError, match="'tpu' is not 'cpu' or 'cuda'"):
        decide_precision("tpu")


def test_the_probe_measures_both_dtypes():
    probe = precision_choice.probe_cpu_matmul(n=64, max_seconds=0.05)
    assert probe.fp32_gflops > 0 and probe.bf16_gflops > 0


def test_an_explicit_precision_is_never_changed(monkeypatch):
    monkeypatch.setattr(precision_choice, "probe_cpu_matmul", lambda: pytest.fail("probed for an explicit value"))
    cfg = OmegaConf.create({"trainer": {"accelerator": "cpu", "precision": "bf16-mixed"}})
    assert resolve_precision(cfg) == "bf16-mixed" and cfg.trainer.precision == "bf16-mixed"


@pytest.mark.parametrize("probe, expected", [(AVX2_EPYC, "32-true"), (AMX_XEON, "bf16-mixed")])
def test_auto_is_replaced_by_the_probe_choice_and_logged(monkeypatch, caplog, probe, expected):
    monkeypatch.setenv(precision_choice.ENV_VAR, "")  # restored afterwards: resolving sets it
    monkeypatch.setattr(precision_choice, "probe_cpu_matmul", lambda: probe)
    cfg = OmegaConf.create({"trainer": {"accelerator": "cpu", "precision": "auto"}})
    with caplog.at_level(logging.INFO, logger="src.utils.precision_choice"):
        assert resolve_precision(cfg) == expected
    assert cfg.trainer.precision == expected
    assert f"Precision: {expected} (bf16 matmul" in caplog.text


def test_processes_started_by_a_run_inherit_its_choice(monkeypatch):
    """DDP ranks re-run the entry point: they take the first process's choice instead of probing again."""
    monkeypatch.setenv(precision_choice.ENV_VAR, "cpu|32-true|measured by the launching process")
    monkeypatch.setattr(precision_choice, "probe_cpu_matmul", lambda: pytest.fail("a rank probed again"))
    cfg = OmegaConf.create({"trainer": {"accelerator": "cpu", "precision": "auto"}})
    assert resolve_precision(cfg) == "32-true"


def test_auto_on_an_unknown_accelerator_says_what_to_do(monkeypatch):
    monkeypatch.setenv(precision_choice.ENV_VAR, "")  # restored afterwards: resolving sets it
    cfg = OmegaConf.create({"trainer": {"accelerator": "tpu", "precision": "auto"}})
    with pytest.raises(ValueError, match="set trainer.precision explicitly"):
        resolve_precision(cfg)
