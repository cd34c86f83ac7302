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


@pytest.fixture(scope="session", autouse=True)
def _rollout_precision_pinned_for_the_session():
    """The same pin for what runs outside a test function: a module-scoped fixture's rollout is made before the
    per-test pin below, and without this it probed the machine (a noisy probe on a loaded machine chose bf16 phases,
    and test_rollout.py's recomputed log-probs then differed from the recorded ones by 0.002)."""
    from src.models import rollout_engine

    rollout_engine._CHOSEN.clear()
    rollout_engine._CHOSEN["cpu"] = ("trainer", "pinned by tests/conftest.py")


@pytest.fixture(autouse=True)
def _rollout_precision_pinned(monkeypatch):
    """``model.policy.rollout_precision=auto`` runs in the caller's precision context (``trainer``) in every test,
    whatever bf16 this machine has: token-exact comparisons then hold on every CI machine (auto would pick bf16 phases
    where they measure faster). The engine's own choice for this process is replaced by a fresh one per test, so a
    test that resolves ``auto`` (for another device, or by a probe it patches) leaves nothing to the next.
    test_rollout_precision.py tests the choice itself; tests that start ``src/train.py`` pass
    ``model.policy.rollout_precision=trainer`` on its command line. trainer.precision=auto's choice still reaches DDP
    ranks through ``EMPO2_PRECISION_CHOICE`` (src/utils/precision_choice.py says why): each test leaves it as found."""
    from src.models import rollout_engine

    monkeypatch.setattr(rollout_engine, "_CHOSEN", {"cpu": ("trainer", "pinned by tests/conftest.py")})
    saved = os.environ.get("EMPO2_PRECISION_CHOICE")
    yield
    if saved is None:
        os.environ.pop("EMPO2_PRECISION_CHOICE", None)
    else:
        os.environ["EMPO2_PRECISION_CHOICE"] = saved


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
                        max_response_tokens=8, max_prompt_tokens=1024, rollout_precision="trainer")


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
