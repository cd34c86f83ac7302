"""Sampling draws from exactly softmax(logits / T), whatever the checkpoint's generation_config says, and the
sampling log-probs are gathered step by step in bounded memory (src/models/rollout_engine.py, src/models/sampling.py).

Comparing logged log-probs with a recomputation cannot catch a distorted sampler (both come from raw logits), so
the z-tests look at the *sampled tokens*: for a set S_t of tokens at each step, the number of sampled tokens in
S_t must match the raw probability mass of S_t summed over steps (a sum of Bernoulli(mass_t) under the right
sampler), with S_t chosen where a checkpoint default would move probability away.
"""
from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from src.models.policy import Policy, pack_batch
from src.models.sampling import RowStreams

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["a cat", "the sea", "a train", "winter", "a robot", "bread", "a city", "music"]


@pytest.fixture(scope="module")
def smollm2_dir(model_cache_dir) -> Path:
    from src.models.hub import EMBEDDED_SMOLLM2, resolve_name_or_path

    return Path(resolve_name_or_path(EMBEDDED_SMOLLM2, model_cache_dir))


def _smollm2_with_generation_config(smollm2_dir: Path, out_dir: Path, model_cache_dir, **settings) -> Policy:
    """The real SmolLM2 (weights linked, not copied) with ``settings`` added to its generation_config.json."""
    from src.models.policy import build_policy

    out_dir.mkdir()
    for f in smollm2_dir.iterdir():
        if f.name != "generation_config.json":
            (out_dir / f.name).symlink_to(f)
    config = json.loads((smollm2_dir / "generation_config.json").read_text())
    (out_dir / "generation_config.json").write_text(json.dumps({**config, **settings}))
    return build_policy(name_or_path=str(out_dir), cache_dir=str(model_cache_dir), dtype="float32")


def _raw_probs(policy: Policy, prompts: list[list[int]], responses: list[list[int]], temperature: float
               ) -> torch.Tensor:
    """``[B, R, V]`` softmax(logits / T) at each response position, from a plain forward pass."""
    batch = pack_batch(prompts, responses, policy.tokenizer.pad_token_id)
    r_len = batch["response_mask"].shape[1]
    with torch.no_grad():
        logits = policy.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              position_ids=batch["position_ids"], use_cache=False).logits
    return torch.softmax(logits[:, -r_len - 1:-1].float() / temperature, dim=-1)


def _low_prob_set(probs: torch.Tensor, context: list[int]) -> torch.Tensor:
    return probs < probs.max() / 2  # what min_p (0.9) removes


def _context_set(probs: torch.Tensor, context: list[int]) -> torch.Tensor:
    in_set = torch.zeros_like(probs, dtype=torch.bool)  # what repetition_penalty pushes down
    in_set[torch.tensor(sorted(set(context)))] = True
    return in_set


def _repeated_bigram_set(probs: torch.Tensor, context: list[int]) -> torch.Tensor:
    in_set = torch.zeros_like(probs, dtype=torch.bool)  # what no_repeat_ngram_size=2 bans
    followers = [b for a, b in zip(context, context[1:]) if a == context[-1]]
    if followers:
        in_set[torch.tensor(followers)] = True
    return in_set


def _z_score(policy: Policy, in_set, request: str, temperature: float = 1.0, max_new_tokens: int = 40
             ) -> tuple[float, int]:
    """z of (sampled tokens in S_t) against the raw mass of S_t, over all sampled tokens; and the token count."""
    torch.manual_seed(0)
    prompts = [policy.encode([{"role": "user", "content": request.format(topic)}]) for topic in TOPICS]
    gen = policy.generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature)
    probs = _raw_probs(policy, prompts, gen.response_ids, temperature)
    observed = expected = variance = 0.0
    tokens = 0
    for i, (prompt, response) in enumerate(zip(prompts, gen.response_ids)):
        for j, token in enumerate(response):
            mask = in_set(probs[i, j], prompt + response[:j])
            mass = float(probs[i, j][mask].sum())
            observed += float(mask[token])
            expected += mass
            variance += mass * (1 - mass)
            tokens += 1
    return (observed - expected) / max(variance, 1e-12) ** 0.5, tokens


WRITE = "Write a few sentences about {}."
REPEAT = "Write a short poem about {} with a refrain that repeats."  # repeated bigrams for no_repeat_ngram_size


@pytest.mark.parametrize("settings, in_set, request_", [
    ({"do_sample": True, "min_p": 0.9}, _low_prob_set, WRITE),
    ({"repetition_penalty": 1.05}, _context_set, WRITE),  # Qwen2.5-7B-Instruct's value
    ({"no_repeat_ngram_size": 2}, _repeated_bigram_set, REPEAT),
], ids=["min_p", "repetition_penalty", "no_repeat_ngram_size"])
def test_sampling_ignores_checkpoint_generation_defaults(smollm2_dir, tmp_path, model_cache_dir, caplog, settings,
                                                         in_set, request_):
    policy = _smollm2_with_generation_config(smollm2_dir, tmp_path / "model", model_cache_dir, **settings)
    with caplog.at_level(logging.WARNING, logger="src.models.policy"):
        z, tokens = _z_score(policy, in_set, request_)
    assert tokens >= 250
    assert abs(z) < 4, f"sampled tokens do not follow softmax(logits / T): z = {z:.1f} over {tokens} tokens"
    # the warning names each dropped checkpoint default; the checkpoint's own config is left as it was
    for key, value in settings.items():
        assert f"{key}={value!r}" in caplog.text
        assert getattr(policy.model.generation_config, key) == value


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded-rows", "global-generator"])
def test_a_checkpoint_generation_config_changes_no_token(tiny_policy: Policy, monkeypatch, seeded):
    """With a checkpoint config full of sampling settings, the engine draws the same tokens and log-probs as with none:
    nothing but the logits and the temperature shapes sampling."""
    prompts = [tiny_policy.encode([{"role": "user", "content": c}]) for c in ("hi", "tell me about the sea")]

    def sample():
        torch.manual_seed(0)
        gen = tiny_policy.generate(prompts, max_new_tokens=6, temperature=0.7, seeds=[1, 2] if seeded else None)
        return gen.response_ids, gen.log_probs

    plain = sample()
    for key, value in {"do_sample": True, "top_k": 1, "top_p": 0.1, "min_p": 0.5, "repetition_penalty": 3.0,
                       "no_repeat_ngram_size": 1, "typical_p": 0.2, "min_new_tokens": 6,
                       "suppress_tokens": plain[0][0][:1], "bad_words_ids": [plain[0][1][:1]]}.items():
        monkeypatch.setattr(tiny_policy.model.generation_config, key, value, raising=False)
    assert sample() == plain


def test_generation_memory_does_not_grow_with_response_length(tiny_model_dir):
    """Peak resident memory of one generate call stays far below one [B, T, V] float32 logits tensor (which the
    previous implementation held two to three times over); measured in a fresh process."""
    batch, tokens = 8, 96
    proc = subprocess.run([sys.executable, "scripts/bench_generation_memory.py", "--modes", "policy",
                           "--model", tiny_model_dir, "--batch", str(batch), "--tokens", str(tokens)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])["policy"]
    assert result["generated_tokens"] == batch * tokens
    logits_bytes = batch * tokens * result["vocab_size"] * 4
    assert result["peak_rss_increase_bytes"] < logits_bytes / 4, result


@pytest.mark.parametrize("counter", [False, True], ids=["row-generators", "counter-based"])
def test_seeded_rows_draw_from_softmax_whatever_else_is_in_the_batch(tiny_policy: Policy, counter):
    """``RowStreams`` (``Policy.generate(seeds=...)``): a row draws from exactly softmax(logits / T) with its
    own stream, so its tokens do not depend on the other rows of its batch; the policy gives a prompt the same
    response alone or beside another one (the same episode on 1 process or on one of N ranks). Both streams: per-row
    generators (CPU) and the counter-based one (accelerators)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]])
    temperature = 0.7
    row = torch.tensor([0])
    draws = torch.cat([RowStreams([s], temperature, counter=counter).draw(logits, row, 0) for s in range(4000)])
    counts = torch.bincount(draws, minlength=5).double()
    expected = 4000 * torch.softmax(logits[0].double() / temperature, -1)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (counts.tolist(), expected.tolist())  # chi-square, 4 d.o.f.: p = 0.0004
    batch = torch.cat([torch.randn(1, 5), logits])
    alone, beside = (RowStreams(s, temperature, counter=counter).draw(x, torch.arange(len(s)), 0)
                     for s, x in (([7], logits), ([3, 7], batch)))
    assert int(alone[0]) == int(beside[1])
    if counter:  # the policy's own calls on this CPU use the row generators
        return

    prompts = [tiny_policy.encode([{"role": "user", "content": c}]) for c in ("hi", "tell me about the sea")]
    pair = tiny_policy.generate(prompts, max_new_tokens=6, temperature=1.0, seeds=[11, 12])
    single = tiny_policy.generate(prompts[1:], max_new_tokens=6, temperature=1.0, seeds=[12])
    assert single.response_ids[0] == pair.response_ids[1]
    assert single.log_probs[0] == pytest.approx(pair.log_probs[1], abs=1e-4)
    other = tiny_policy.generate(prompts[1:], max_new_tokens=6, temperature=1.0, seeds=[13])
    assert other.response_ids[0] != pair.response_ids[1]


def test_counter_exponentials_are_splitmix64_of_seed_step_and_index():
    """Known answers: seed 0 at step 0 is splitmix64's reference sequence from state 0 (0xe220a8397b1dcdaf,
    0x6e789e6aa1b965f4, 0x06c45d188009454f), mapped to -log of the top 53 bits; other seeds and steps start
    elsewhere (checked against a plain-Python splitmix64); the draws are Exp(1), rows and steps uncorrelated."""
    from src.models.sampling import counter_exponentials

    mask = (1 << 64) - 1

    def reference(state: int, n: int) -> list[float]:  # Vigna's splitmix64.c, in Python integers
        out = []
        for _ in range(n):
            state = (state + 0x9E3779B97F4A7C15) & mask
            z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & mask
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
            z ^= z >> 31
            out.append(-math.log(((z >> 11) + 0.5) * 2.0 ** -53))
        return out

    assert reference(0, 3) == [-math.log(((z >> 11) + 0.5) * 2.0 ** -53)
                               for z in (0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F)]
    assert counter_exponentials(torch.tensor([0]), 0, 3)[0].tolist() == pytest.approx(reference(0, 3), rel=1e-14)
    for seed, step in ((1, 0), (-7, 3), (2**62 + 5, 10**6)):
        state = (seed * 0xD1B54A32D192ED03 + step * 0xAEF17502108EF2D9) & mask
        got = counter_exponentials(torch.tensor([seed]), step, 4)[0].tolist()
        assert got == pytest.approx(reference(state, 4), rel=1e-14), (seed, step)
    draws = counter_exponentials(torch.arange(8), 0, 50_000)
    assert abs(draws.mean().item() - 1) < 0.01 and abs(draws.var().item() - 1) < 0.03
    steps = torch.stack([counter_exponentials(torch.tensor([5]), t, 50_000)[0] for t in range(3)])
    for rows in (draws[:3], steps):
        corr = torch.corrcoef(rows)
        assert corr[~torch.eye(3, dtype=torch.bool)].abs().max() < 0.02  # 4.5 standard deviations at n = 50k
    streams = RowStreams([5, 6], 1.0, counter=True)
    logits = torch.zeros(2, 50)
    picks = [streams.draw(logits, torch.arange(2), step).tolist() for step in range(4)]
    assert len({tuple(p) for p in picks}) > 1  # a new draw at every step
    assert streams.draw(logits, torch.arange(2), 2).tolist() == picks[2]  # a function of (seed, step) alone
    assert not RowStreams([5], 1.0, "cpu").counter  # the CPU keeps torch's per-row generators
