"""Rollout generation and one update at the paper's shapes on one GPU, with randomly initialised Qwen2.5-shaped models
(no weights to download): what an iteration of `experiment=webshop_paper` costs per device.

    python scripts/bench_paper_shapes.py --tokenizer data/models/tiny-random-llama --out bench.json   # CUDA
    python scripts/bench_paper_shapes.py --tokenizer data/models/tiny-random-llama --device cpu --shape tiny
                                                                      # a rehearsal of every step on a CPU
    python scripts/bench_paper_shapes.py --tokenizer data/models/tiny-random-llama --streams --new-tokens 64
                                                                      # only: decoding step by sampling stream

Generation: ``Policy.generate`` (the rollout's call: per-row seeded sampling, log-probs gathered step by step) on
``--batches`` prompts of ``--prompt-tokens`` random ids with ``--new-tokens`` new tokens at T = 1.0, timed once for
one new token (≈ the prefill) and once in full; the decode time is the difference. Also without the seeds
(``RowStreams`` off), to give that sampler's cost per decoding step; ``stream`` names what the seeded rows
drew from. ``--streams``: instead, the decoding step of each way to draw (per-row generators, the counter-based
stream, unseeded sampling, greedy) and whether a row draws the same tokens alone and in the batch.
docs/performance.md#measured-on-one-h200 has the figures of 2026-12-04.
Update: one AdamW step on a micro-batch of ``--update-batch`` sequences (prompt + response) through
``Policy.log_probs`` and ``compute_policy_loss`` under bf16 autocast with gradient checkpointing, the paper
path's settings: LoRA (r 16, all linear layers) on a bf16 base, and full fine-tuning with fp32 master weights.
Tokens/s count every token of the micro-batch; model FLOP utilisation is 6·N·tokens/s over ``--peak-tflops``
(the usual convention, which credits a LoRA step as a full one; the default is the H200's dense bf16 datasheet peak). Peak memory is ``torch.cuda.max_memory_allocated``,
next to the start-up estimate of the model states (``src/models/memory_estimate.py``), which leaves activations out.
The random model's tokens mean nothing; a row that draws EOS stops early (the counts are of the tokens drawn).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Public config.json values of Qwen2.5-7B/3B-Instruct; "tiny" only rehearses the steps.
SHAPES = {
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=False),
}
GIB = 2**30


def config_dir(shape: str, root: Path) -> Path:
    from transformers import Qwen2Config

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                         torch_dtype="bfloat16")
    path = root / shape
    config.save_pretrained(path)
    return path


def make_policy(path: Path, tokenizer_dir: str, device: str, dtype: torch.dtype, lora: bool, checkpointing: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    from src.models.hub import load_tokenizer
    from src.models.policy import Policy

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        from peft import LoraConfig, get_peft_model

        model.enable_input_require_grads()
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
        for p in model.parameters():  # fp32 master weights for what trains (src/models/precision.py)
            if p.requires_grad:
                p.data = p.data.float()
    return Policy(model, load_tokenizer(tokenizer_dir), max_response_tokens=256, max_prompt_tokens=1 << 15)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / GIB if device.startswith("cuda") else None


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def random_prompts(policy, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    vocab = len(policy.tokenizer)
    ids = torch.randint(0, vocab, (n, length), generator=g)
    for eos in policy.eos_token_ids:  # no prompt ends a turn early
        ids[ids == eos] = (eos + 1) % vocab
    return ids.tolist()


def bench_generation(policy, device: str, batches: list[int], prompt_tokens: int, new_tokens: int) -> list[dict]:
    rows = []
    policy.generate(random_prompts(policy, 2, 64, 0), max_new_tokens=4, seeds=[0, 1])  # warm-up (kernels, cuBLAS)
    for batch in batches:
        prompts = random_prompts(policy, batch, prompt_tokens, batch)
        for seeded in (True, False):
            seeds = list(range(batch)) if seeded else None
            times = {}
            for n in (1, new_tokens):
                reset_peak(device)
                sync(device)
                tic = time.perf_counter()
                out = policy.generate(prompts, max_new_tokens=n, temperature=1.0, seeds=seeds)
                sync(device)
                times[n] = time.perf_counter() - tic
            drawn = sum(len(r) for r in out.response_ids)
            steps = max(len(r) for r in out.response_ids)
            decode = times[new_tokens] - times[1]
            stream = ("counter" if device.startswith("cuda") else "generators") if seeded else "unseeded"
            rows.append({"batch": batch, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "stream": stream,
                         "prefill_s": times[1], "total_s": times[new_tokens], "decode_s": decode,
                         "tokens_drawn": drawn, "new_tokens_per_s": drawn / times[new_tokens],
                         "decode_ms_per_step": 1e3 * decode / max(steps - 1, 1), "peak_gib": peak_gib(device)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_streams(policy, device: str, batches: list[int], prompt_tokens: int, new_tokens: int) -> list[dict]:
    """Decoding step (ms) of each way to draw, and whether a seeded row draws the same tokens alone as in a batch."""
    import src.models.policy as policy_module
    from src.models.sampling import RowStreams

    class Generators(RowStreams):  # per-row torch generators on any device
        def __init__(self, seeds, temperature, device="cpu", counter=None):
            super().__init__(seeds, temperature, device, counter=False)

    class Counter(RowStreams):
        def __init__(self, seeds, temperature, device="cpu", counter=None):
            super().__init__(seeds, temperature, device, counter=True)

    rows = []
    policy.generate(random_prompts(policy, 2, 64, 0), max_new_tokens=4, seeds=[0, 1])  # warm-up
    try:
        for batch in batches:
            prompts = random_prompts(policy, batch, prompt_tokens, batch)
            row = {"batch": batch, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens}
            for name, sampler, kwargs in (("generators", Generators, {"seeds": list(range(batch))}),
                                          ("counter", Counter, {"seeds": list(range(batch))}),
                                          ("unseeded", RowStreams, {}),
                                          ("greedy", RowStreams, {"do_sample": False})):
                policy_module.RowStreams = sampler
                times = {}
                for n in (1, new_tokens):
                    sync(device)
                    tic = time.perf_counter()
                    policy.generate(prompts, max_new_tokens=n, temperature=1.0, **kwargs)
                    sync(device)
                    times[n] = time.perf_counter() - tic
                row[f"decode_ms_per_step_{name}"] = 1e3 * (times[new_tokens] - times[1]) / (new_tokens - 1)
                if sampler is not RowStreams:
                    alone = policy.generate(prompts[1:2], max_new_tokens=8, seeds=[6]).response_ids[0]
                    beside = policy.generate(prompts[:3], max_new_tokens=8, seeds=[5, 6, 7]).response_ids[1]
                    row[f"alone_equals_beside_{name}"] = alone == beside
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        policy_module.RowStreams = RowStreams
    return rows


def bench_update(policy, device: str, batch: int, prompt_tokens: int, new_tokens: int, params: int,
                 peak_tflops: float, steps: int) -> dict:
    from src.models.core_algos import compute_policy_loss

    prompts = random_prompts(policy, batch, prompt_tokens, 1)
    responses = random_prompts(policy, batch, new_tokens, 2)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-6, fused=device.startswith("cuda"))
    policy.model.train()
    times = []
    reset_peak(device)
    for _ in range(steps + 1):  # the first step is the warm-up
        sync(device)
        tic = time.perf_counter()
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16):
            out = policy.log_probs(prompts, responses)
        advantages = torch.linspace(-1, 1, batch, device=out["log_probs"].device)
        loss, _ = compute_policy_loss(old_log_prob=out["log_probs"].detach(), log_prob=out["log_probs"],
                                      advantages=advantages, response_mask=out["response_mask"], clip_ratio_low=0.2,
                                      clip_ratio_high=0.28, clip_ratio_c=3.0)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter() - tic)
    step_s = sum(times[1:]) / steps
    tokens = batch * (prompt_tokens + new_tokens)
    return {"micro_batch": batch, "sequence_tokens": prompt_tokens + new_tokens, "step_s": step_s,
            "tokens_per_s": tokens / step_s, "mfu_6N": 6 * params * tokens / step_s / (peak_tflops * 1e12),
            "trainable_params": sum(p.numel() for p in trainable), "peak_gib": peak_gib(device)}


def update_case(name: str, path: Path, args, lora: bool) -> dict:
    from src.models.memory_estimate import GIB as EST_GIB
    from src.models.memory_estimate import count_parameters, estimate_per_device

    counts = count_parameters(str(path), {"enabled": True, "r": 16, "alpha": 32} if lora else None)
    estimate = sum(estimate_per_device(counts, world=1, sharded=False, reference=False, weight_bytes=2).values())
    result = {"case": name, "params": counts.total, "estimate_gib": estimate / EST_GIB}
    policy = None
    try:
        policy = make_policy(path, args.tokenizer, args.device, torch.bfloat16 if lora else torch.float32, lora,
                             checkpointing=True)
        result |= bench_update(policy, args.device, args.update_batch, args.prompt_tokens, args.new_tokens,
                               counts.total, args.peak_tflops, args.update_steps)
    except torch.OutOfMemoryError as exc:
        result["error"] = f"out of memory: {str(exc).splitlines()[0]}"
    finally:
        del policy
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print(json.dumps(result), flush=True)
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True, help="a directory with a tokenizer (any: the ids are random)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES), help="generation and LoRA update")
    ap.add_argument("--full-shapes", nargs="*", default=["qwen2.5-7b", "qwen2.5-3b"],
                    help="full fine-tuning, in this order; stops at the first that fits")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--prompt-tokens", type=int, default=1500, help="WebShop's prompts at the paper's settings")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--update-batch", type=int, default=4)
    ap.add_argument("--update-steps", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="dense bf16 peak of the device (H200 SXM datasheet: 989; %(default)s)")
    ap.add_argument("--streams", action="store_true", help="only the decoding step by sampling stream")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    info = {"device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else args.device,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "args": vars(args)}
    print(json.dumps(info), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = config_dir(args.shape, Path(tmp))
        policy = make_policy(path, args.tokenizer, args.device, torch.bfloat16, lora=False, checkpointing=False)
        policy.eval()
        if args.streams:
            info["streams"] = bench_streams(policy, args.device, args.batches, args.prompt_tokens, args.new_tokens)
        else:
            info["generation"] = bench_generation(policy, args.device, args.batches, args.prompt_tokens,
                                                  args.new_tokens)
            del policy
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            info["update"] = [update_case(f"LoRA {args.shape}", path, args, lora=True)]
            for shape in args.full_shapes:
                info["update"].append(update_case(f"full {shape}", config_dir(shape, Path(tmp)), args, lora=False))
                if "error" not in info["update"][-1]:
                    break
    if args.out:
        Path(args.out).write_text(json.dumps(info, indent=1) + "\n")
    return info


if __name__ == "__main__":
    main()
