"""Policy: batch layout, sampled ids/log-probs vs recomputation, chat rendering, hub-style loading from local files."""
from __future__ import annotations

import pytest
import torch

from src.models.policy import Policy, pack_batch


def test_pack_batch_layout_known_answer():
    # prompts [5,6] and [7]; responses [8] and [9,10]; pad 0 -> P=2, R=2
    b = pack_batch([[5, 6], [7]], [[8], [9, 10]], pad_token_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 8, 0], [0, 7, 9, 10]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 0], [0, 1, 1, 1]]
    # positions count only real tokens, so left padding does not shift them
    assert b["position_ids"].tolist() == [[0, 1, 2, 2], [0, 0, 1, 2]]
    assert b["response_mask"].tolist() == [[1, 0], [1, 1]]


def test_pack_batch_rejects_bad_input():
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        pack_batch([[1], [2]], [[3]], 0)
    with pytest.raises(ValueError, match="empty prompt"):
        pack_batch([[]], [[3]], 0)


def test_generate_ids_and_log_probs_match_recomputation(tiny_policy: Policy):
    """The ids the policy sampled and their sampling log-probs line up with a fresh forward pass."""
    torch.manual_seed(1)
    messages = [[{"role": "system", "content": "You are an agent."}, {"role": "user", "content": f"Task {k}: go."}]
                for k in range(3)]
    prompts = [tiny_policy.encode(m) for m in messages]
    # uneven prompt lengths exercise the left padding
    prompts[1] = prompts[1] + prompts[1][-3:]
    gen = tiny_policy.generate(prompts, max_new_tokens=6, temperature=1.0)
    assert [len(r) for r in gen.response_ids] == [len(lp) for lp in gen.log_probs]
    eos = set(tiny_policy.eos_token_ids)
    for ids, truncated in zip(gen.response_ids, gen.truncated):
        assert 1 <= len(ids) <= 6
        # cut right after the first EOS; no EOS means truncated
        assert all(t not in eos for t in ids[:-1])
        assert truncated == (ids[-1] not in eos)
    out = tiny_policy.log_probs(prompts, gen.response_ids, temperature=1.0)
    for i, lp in enumerate(gen.log_probs):
        n = len(lp)
        assert out["response_mask"][i].tolist() == [1.0] * n + [0.0] * (out["response_mask"].shape[1] - n)
        torch.testing.assert_close(out["log_probs"][i, :n], torch.tensor(lp), atol=1e-4, rtol=1e-4)
    # the decoded text is derived from the ids, never the other way round
    assert gen.texts == tiny_policy.tokenizer.batch_decode(gen.response_ids, skip_special_tokens=True)


def test_generate_log_probs_use_the_sampling_temperature(tiny_policy: Policy):
    torch.manual_seed(2)
    prompts = [tiny_policy.encode([{"role": "user", "content": "hello"}])]
    gen = tiny_policy.generate(prompts, max_new_tokens=4, temperature=0.5)
    at_half = tiny_policy.log_probs(prompts, gen.response_ids, temperature=0.5)["log_probs"][0, : len(gen.log_probs[0])]
    torch.testing.assert_close(at_half, torch.tensor(gen.log_probs[0]), atol=1e-4, rtol=1e-4)


def test_generation_from_kept_prompt_keys_values_equals_generation_from_the_whole_prompt(tiny_policy: Policy):
    """Prefix caching: continuing kept prompts (uneven prefixes, a row without one, uneven new parts) samples the
    same tokens with the same log-probs as generating from the whole prompts."""
    torch.manual_seed(3)
    prompts = [tiny_policy.encode([{"role": "user", "content": "go " * k}]) for k in (1, 7, 3)]
    first = tiny_policy.generate(prompts, max_new_tokens=5, keep_prompt_kv=True)
    kept = [first.prompt_kv(i) for i in range(3)]
    assert [k.length for k in kept] == [len(p) for p in prompts]
    turn = tiny_policy.encode_next_turn("Now reflect.")
    full = [p + r[:-1] + turn if r[-1] in tiny_policy.eos_token_ids else p + r + turn
            for p, r in zip(prompts, first.response_ids)]
    full[1] = full[1] + full[1][-4:]
    prefixes = [kept[0], None, kept[2]]
    torch.manual_seed(4)
    cached = tiny_policy.generate(full, max_new_tokens=6, prefix_kv=prefixes)
    torch.manual_seed(4)
    fresh = tiny_policy.generate(full, max_new_tokens=6)
    assert cached.response_ids == fresh.response_ids
    for a, b in zip(cached.log_probs, fresh.log_probs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="at least one must be new"):
        tiny_policy.generate([prompts[0]], prefix_kv=[kept[0]])
    with pytest.raises(ValueError, match="not kept"):
        fresh.prompt_kv(0)


def _task_prompts(policy: Policy, step: int) -> list[list[int]]:
    """Two tasks x three episodes as a rollout step renders them: a long system prompt and task text shared by a task's
    episodes; at step 0 a task's prompts are identical, later each episode has its own history."""
    system = "You are an agent in a text world. Reply with one action. " * 4
    prompts = []
    for task in ("Find the red key in the cellar. " * 6, "Boil water in the kitchen. " * 6):
        for episode in range(3):
            history = "" if step == 0 else f" History: step {step}, episode {episode}: " + "look " * (episode + step)
            prompts.append(policy.encode([{"role": "system", "content": system},
                                          {"role": "user", "content": f"Task: {task}{history} What next?"}]))
    return prompts


def test_shared_prefill_draws_the_same_tokens_and_keeps_the_same_prompt_keys_values(tiny_policy: Policy):
    """Policy.generate(shared=SharedPrefixes()): each task's common prefix (at step 0 the whole prompt but its last id)
    is computed once, and again reused at the next step; with per-row seeds the drawn tokens are the ones generation
    from the whole prompts draws, the log-probs agree, and the kept prompt keys/values continue like the plain ones."""
    from src.models.prefix_tree import common_prefix
    from src.models.prompt_cache import SharedPrefixes

    shared = SharedPrefixes(16)
    for step in (0, 1):
        prompts = _task_prompts(tiny_policy, step)
        seeds = list(range(100 * step, 100 * step + len(prompts)))
        plain = tiny_policy.generate(prompts, max_new_tokens=6, seeds=seeds, keep_prompt_kv=True)
        before = shared.computed_tokens
        got = tiny_policy.generate(prompts, max_new_tokens=6, seeds=seeds, keep_prompt_kv=True, shared=shared)
        assert got.response_ids == plain.response_ids
        for a, b in zip(got.log_probs, plain.log_probs):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=1e-4)
        computed = shared.computed_tokens - before
        if step == 0:  # one whole prompt per task, then each row's last id
            assert computed == sum(len(prompts[k]) - 1 for k in (0, 3)) + len(prompts)
        else:  # each task's prefix continues the part step 0's prefix covers; then each row's own part
            head = [tiny_policy.shared_prefix_length(prompts[k:k + 3]) for k in (0, 3)]
            covered = [common_prefix(step0[k], prompts[k]) for k in (0, 3)]
            assert 0 < min(covered) and all(c < h for c, h in zip(covered, head))
            assert computed == sum(len(p) for p in prompts) - 3 * sum(head) + sum(h - c for h, c in zip(head, covered))
        step0 = prompts
        for i in (0, 4):
            a, b = got.prompt_kv(i), plain.prompt_kv(i)
            assert a.length == b.length == len(prompts[i])
            for (ka, va), (kb, vb) in zip(a.layers, b.layers):
                torch.testing.assert_close(ka, kb, atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(va, vb, atol=1e-5, rtol=1e-4)
    assert shared.computed_tokens < shared.prompt_tokens / 2


def test_shared_runs_group_the_episodes_of_a_task(tiny_policy: Policy):
    from src.models.prompt_cache import shared_runs

    prompts = _task_prompts(tiny_policy, 0)
    runs = shared_runs([prompts[i] for i in (0, 3, 1, 4, 2, 5)], 16)  # interleaved tasks
    assert sorted((sorted(rows), n) for rows, n in runs) == [([0, 2, 4], len(prompts[0]) - 1),
                                                             ([1, 3, 5], len(prompts[3]) - 1)]
    assert shared_runs([prompts[0][:10], prompts[0][:10]], 16) == []  # too short to be worth a forward pass


def test_encode_next_turn_continues_the_conversation(tiny_policy: Policy):
    system, user, answer = "You are an agent.", "Task: go.", "look around"
    prompt = tiny_policy.encode([{"role": "system", "content": system}, {"role": "user", "content": user}])
    answer_ids = tiny_policy.tokenizer.encode(answer, add_special_tokens=False)
    continued = prompt + answer_ids + tiny_policy.encode_next_turn("Reflect now.")
    assert continued == tiny_policy.encode([{"role": "system", "content": system}, {"role": "user", "content": user},
                                            {"role": "assistant", "content": answer},
                                            {"role": "user", "content": "Reflect now."}])


def test_encode_renders_the_chat_template(tiny_policy: Policy):
    messages = [{"role": "system", "content": "SYS"}, {"role": "user", "content": "USER TEXT"}]
    text = tiny_policy.tokenizer.decode(tiny_policy.encode(messages))
    assert text.index("SYS") < text.index("USER TEXT")
    assert text.rstrip().endswith("assistant")  # generation prompt (SmolLM2's <|im_start|>assistant)


def test_log_probs_gradients_flow_and_entropy_shape(tiny_policy: Policy):
    prompts = [tiny_policy.encode([{"role": "user", "content": "a"}])]
    out = tiny_policy.log_probs(prompts, [[10, 11, 12]], with_entropy=True)
    assert out["log_probs"].shape == out["entropy"].shape == (1, 3)
    out["log_probs"].sum().backward()
    grads = [p.grad for p in tiny_policy.parameters() if p.requires_grad]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
    tiny_policy.zero_grad(set_to_none=True)


def test_hub_loading_path_on_local_files(tiny_model_dir, model_cache_dir):
    """The hub-id code path (from_pretrained on a name_or_path) works on a local directory."""
    from src.models.policy import build_policy

    policy = build_policy(name_or_path=tiny_model_dir, cache_dir=str(model_cache_dir), dtype="float32")
    assert policy.tokenizer.padding_side == "left"
    assert policy.model.config.num_hidden_layers == 2


def test_unknown_embedded_model_is_a_clear_error(model_cache_dir):
    from src.models.hub import resolve_name_or_path

    with pytest.raises(ValueError, match="embedded:nope"):
        resolve_name_or_path("embedded:nope", model_cache_dir)


def test_lora_reference_is_the_base_model(tiny_model_dir, model_cache_dir):
    """With LoRA, disabling adapters gives the base model's log-probs (the KL reference, docs/method.md#one-iteration,
    step 5)."""
    from src.models.policy import build_policy

    policy = build_policy(name_or_path=tiny_model_dir, cache_dir=str(model_cache_dir), dtype="float32",
                          lora={"enabled": True, "r": 4, "alpha": 8, "target_modules": "all-linear"})
    prompts = [policy.encode([{"role": "user", "content": "x"}])]
    with torch.no_grad():
        base = policy.log_probs(prompts, [[5, 6]], disable_adapters=True)["log_probs"]
        # move the adapters away from their zero init so the adapted model differs from the base
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.add_(0.5)
        adapted = policy.log_probs(prompts, [[5, 6]])["log_probs"]
        base_again = policy.log_probs(prompts, [[5, 6]], disable_adapters=True)["log_probs"]
    torch.testing.assert_close(base, base_again)
    assert not torch.allclose(base, adapted)
    trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_a_shared_prompt_prefix_computed_once_gives_the_same_log_probs_and_gradients(tiny_policy: Policy):
    """log_probs(share_prefix=True) runs the prompts' common prefix once and continues every row from its
    keys/values: log-probs, entropies and every parameter's gradient equal the plain batch's (float rounding)."""
    torch.manual_seed(0)
    head = torch.randint(10, 4000, (40,)).tolist()
    # uneven rests and replies exercise the padding between the shared block and each row
    prompts = [head + torch.randint(10, 4000, (k,)).tolist() for k in (5, 17, 1, 9)]
    replies = [torch.randint(10, 4000, (k,)).tolist() for k in (3, 7, 1, 4)]
    assert tiny_policy.shared_prefix_length(prompts) == 40
    results = []
    for share in (False, True):
        tiny_policy.zero_grad()
        out = tiny_policy.log_probs(prompts, replies, share_prefix=share, with_entropy=True)
        (out["log_probs"].sum() + out["entropy"].sum()).backward()
        grads = {n: p.grad.clone() for n, p in tiny_policy.named_parameters() if p.grad is not None}
        results.append((out["log_probs"].detach(), out["entropy"].detach(), out["response_mask"], grads))
    (lp, ent, mask, grads), (lp_s, ent_s, mask_s, grads_s) = results
    assert torch.equal(mask, mask_s)
    torch.testing.assert_close(lp_s, lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_s, ent, atol=1e-5, rtol=1e-5)
    assert grads.keys() == grads_s.keys() and len(grads) == len(list(tiny_policy.parameters()))
    for name, g in grads.items():
        torch.testing.assert_close(grads_s[name], g, atol=1e-5, rtol=1e-4, msg=name)
    tiny_policy.zero_grad()


def test_a_shared_prefix_is_computed_apart_only_where_it_saves_a_fifth_of_the_tokens(tiny_policy: Policy):
    """The prefix pass costs about what sharing a short prefix saves (measured: WebShop rows sharing 15% of their
    tokens ran no faster), so ``log_probs(share_prefix=True)`` runs one forward call below ``MIN_SHARED_SAVING``
    and two (prefix, then rows) above it; the log-probs are the plain batch's either way."""
    from src.models.policy import MIN_SHARED_SAVING

    calls = []
    hook = tiny_policy.model.register_forward_pre_hook(lambda *_: calls.append(1))
    head = list(range(100, 120))  # 20 shared ids (over MIN_SHARED_PREFIX)
    try:
        for rest, sharing in ((60, False), (5, True)):  # 3 x 20 saved of 4 x (20 + rest + 2) tokens
            prompts = [head + [200 + 7 * i + j for j in range(rest)] for i in range(4)]
            replies = [[300 + i, 301] for i in range(4)]
            saving = 3 * 20 / (4 * (20 + rest + 2))
            assert (saving >= MIN_SHARED_SAVING) == sharing
            assert tiny_policy.prefix_to_share(prompts, replies) == (20 if sharing else 0)
            calls.clear()
            with torch.no_grad():
                got = tiny_policy.log_probs(prompts, replies, share_prefix=True)["log_probs"]
                assert len(calls) == (2 if sharing else 1)
                plain = tiny_policy.log_probs(prompts, replies)["log_probs"]
            torch.testing.assert_close(got, plain, atol=1e-5, rtol=1e-5)
    finally:
        hook.remove()


def test_shared_prefix_length_needs_a_long_common_prefix_and_leaves_each_last_prompt_token(tiny_policy: Policy):
    head = list(range(100, 130))
    assert tiny_policy.shared_prefix_length([head + [1], head + [2, 3]]) == 30
    # the shortest prompt's last token must be fed: it predicts the first reply token
    assert tiny_policy.shared_prefix_length([head, head + [2, 3]]) == 29
    assert tiny_policy.shared_prefix_length([head[:10] + [1], head[:10] + [2]]) == 0  # under MIN_SHARED_PREFIX
    assert tiny_policy.shared_prefix_length([head + [1]]) == 0  # one prompt: nothing to share
