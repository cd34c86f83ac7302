"""Shared fixtures: a tiny random policy with SmolLM2's tokenizer, built offline once per session."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("PROJECT_ROOT", str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A fixed torch thread count: float rounding depends on it, and the tests compare runs bit for bit (exact resume,
# DDP against one process); the run's default follows the machine's load (src/utils/threads.py), which on a shared
# CI machine made a resumed run round differently (CI, 2026-12-04). test_threads.py tests the governor itself.
os.environ.setdefault("EMPO2_ADAPT_THREADS", "0")
# Rollouts in the caller's precision context, whatever bf16 this machine has: token-exact comparisons then hold on
# every CI machine (model.policy.rollout_precision=auto would pick bf16 phases where they are faster).
# test_rollout_precision.py tests the choice itself.
os.environ.setdefault("EMPO2_ROLLOUT_PRECISION", "cpu|trainer")


@pytest.fixture(autouse=True)
def _keep_the_process_precision_choices():
    """Each test leaves the process tree's precision choices as it found them: a start-up check that resolves
    ``auto`` for another device (trainer=fsdp names a GPU) rewrites them, and a later test's CPU rollouts then probed
    this machine and ran bf16 steps (seen: test_startup_checks.py before test_rollout_engine.py, 8 failures)."""
    saved = {name: os.environ.get(name) for name in ("EMPO2_ROLLOUT_PRECISION", "EMPO2_PRECISION_CHOICE")}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def model_cache_dir() -> Path:
    """Where converted/built models live (the project's data dir, so the SmolLM2 conversion is reused)."""
    return Path(os.environ.get("EMPO2_DATA_DIR", ROOT / "data")) / "models"


@pytest.fixture(scope="session")
def tiny_model_dir(model_cache_dir) -> str:
    from src.models.hub import EMBEDDED_TINY, resolve_name_or_path

    return resolve_name_or_path(EMBEDDED_TINY, model_cache_dir)


@pytest.fixture(scope="session")
def tiny_policy(tiny_model_dir, model_cache_dir):
    import torch

    from src.models.policy import build_policy

    torch.manual_seed(0)
    return build_policy(name_or_path=tiny_model_dir, cache_dir=str(model_cache_dir), dtype="float32",
                        max_response_tokens=8, max_prompt_tokens=1024)


ENGINE_TOPICS = ("hi", "tell me about the sea", "name three colours and a fruit, then stop", "why", "a poem on trains")


@pytest.fixture(scope="session")
def engine_prompts():
    """``prompts(policy)``: the five chat prompts of different lengths the rollout-engine tests decode."""
    return lambda policy: [policy.encode([{"role": "user", "content": t}]) for t in ENGINE_TOPICS]


@pytest.fixture(scope="session")
def stopping_policy(tiny_policy):
    """The tiny policy with a fifth of its vocabulary declared EOS: its random replies end at different steps, so the
    engine drops finished rows mid-batch."""
    import copy

    policy = copy.copy(tiny_policy)
    vocab = tiny_policy.model.get_output_embeddings().weight.shape[0]
    policy.eos_token_ids = sorted(set(tiny_policy.eos_token_ids) | set(range(0, vocab, 5)))
    return policy
