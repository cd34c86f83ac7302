"""A mini-batch computed as one prefix tree (src/models/prefix_tree.py, ``Policy.log_probs(tree=True)``): the layout
(known answers), and log-probs, entropies, the loss and every parameter's gradient equal to the rows computed alone,
for full fine-tuning and LoRA, the LoRA reference (adapters off) included."""
from __future__ import annotations

import pytest
import torch

from src.models.policy import Policy, build_policy
from src.models.prefix_tree import build_prefix_tree, group_rows, tree_size


def test_tree_layout_known_answer():
    """Two rows sharing [1, 2], then a branch: nodes in first-met order, depths as positions, the branch after the
    shared prefix attending to it and not to its sibling; response tokens predicted by the node before them."""
    tree = build_prefix_tree([[1, 2, 3], [1, 2, 4]], [[5], [6, 7]])
    assert tree.input_ids.tolist() == [[1, 2, 3, 5, 4, 6, 7]]
    assert tree.position_ids.tolist() == [[0, 1, 2, 3, 2, 3, 4]]
    assert tree.predict_at.tolist() == [[2, 0], [4, 5]] and tree.response_ids.tolist() == [[5, 0], [6, 7]]
    assert tree.response_mask.tolist() == [[1.0, 0.0], [1.0, 1.0]]
    mask = tree.attention_mask[0, 0].int().tolist()
    assert mask[4] == [1, 1, 0, 0, 1, 0, 0]  # node 4 (token 4): the shared [1, 2] and itself, not the sibling 3, 5
    assert mask[6] == [1, 1, 0, 0, 1, 1, 1]
    assert mask[3] == [1, 1, 1, 1, 0, 0, 0]
    assert tree.num_tokens == 7 and tree.nominal_tokens == 9
    assert tree_size([[1, 2, 3, 5], [1, 2, 4, 6, 7]]) == 7
    identical = build_prefix_tree([[1, 2], [1, 2]], [[3], [3]])  # the same step twice: computed once
    assert identical.num_tokens == 3 and identical.predict_at.tolist() == [[1], [1]]


def test_rows_are_grouped_in_token_order_under_a_token_budget():
    rows = [[9, 1], [1, 2, 3], [1, 2, 4], [1, 5]]
    assert group_rows(rows, 5) == [[1, 2, 3], [0]]  # [1,2,3] + [1,2,4] + [1,5]: 5 nodes; [9,1] would make 7
    assert group_rows(rows, 4) == [[1, 2], [3, 0]]
    assert group_rows(rows, 100) == [[1, 2, 3, 0]]
    assert group_rows([[1, 2, 3, 4]], 2) == [[0]]  # a row longer than the budget goes alone


def three_level_batch(seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """A system prompt; two tasks under it; histories under each; several replies to the same prompt (a group)."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(10, 4000, (n,), generator=g).tolist()

    system, tasks = ids(30), [ids(12), ids(7)]
    prompts, replies = [], []
    for t, task in enumerate(tasks):
        histories = [ids(9), ids(4), []]
        for h, history in enumerate(histories):
            for k in range(1 + (h == 0)):  # the first history's prompt twice, with two replies
                prompts.append(system + task + history + ids(1 + t))
                replies.append(ids(2 + (3 * h + k + t) % 5))
    prompts.append(prompts[0])  # the same prompt and reply twice: one row of the tree
    replies.append(replies[0])
    return prompts, replies


def _results(policy: Policy, prompts, replies, *, tree: bool, reference: bool = False):
    policy.zero_grad()
    out = policy.log_probs(prompts, replies, tree=tree, with_entropy=True, disable_adapters=reference)
    weights = torch.linspace(0.5, 1.5, out["log_probs"].numel()).reshape(out["log_probs"].shape)
    loss = (out["log_probs"] * weights).sum() + 0.1 * out["entropy"].sum()  # a loss weighting every token its own way
    if loss.requires_grad:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    policy.zero_grad()
    return out, float(loss.detach()), grads


def _assert_same(policy: Policy, prompts, replies, reference: bool = False) -> dict:
    (plain, loss, grads), (shared, loss_t, grads_t) = (
        _results(policy, prompts, replies, tree=t, reference=reference) for t in (False, True))
    assert torch.equal(plain["response_mask"], shared["response_mask"])
    torch.testing.assert_close(shared["log_probs"], plain["log_probs"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared["entropy"], plain["entropy"], atol=1e-5, rtol=1e-5)
    assert loss_t == pytest.approx(loss, rel=1e-5)
    assert grads.keys() == grads_t.keys()
    for name, g in grads.items():
        rel = float((grads_t[name] - g).norm() / g.norm().clamp(min=1e-12))
        assert rel <= 1e-5, (name, rel)
    return {"plain": plain, "tree": shared, "grads": grads}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_three_level_tree_gives_the_rows_log_probs_loss_and_gradients(tiny_model_dir, model_cache_dir, lora):
    policy = build_policy(name_or_path=tiny_model_dir, cache_dir=str(model_cache_dir), dtype="float32",
                          lora={"enabled": True, "r": 4, "alpha": 8, "target_modules": "all-linear"} if lora else None)
    if lora:  # adapters away from their zero init, so the adapted model differs from the reference
        with torch.no_grad():
            for name, p in policy.model.named_parameters():
                if "lora_B" in name:
                    p.add_(0.05 * torch.randn_like(p))
    prompts, replies = three_level_batch()
    got = _assert_same(policy, prompts, replies)
    assert len(got["grads"]) == sum(p.requires_grad for p in policy.parameters())
    assert got["tree"]["tokens_computed"] < 0.5 * got["plain"]["tokens_computed"]
    if lora:
        with torch.no_grad():
            _assert_same(policy, prompts, replies, reference=True)
