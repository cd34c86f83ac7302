"""Generation speed of the rollout engine against the path it replaced, on this machine, as JSON.

    python scripts/bench_decode.py                         # SmolLM2, 8 WebShop-shaped prompts of ~900 tokens, 32 new
    python scripts/bench_decode.py --prompts 16 64 --prompt-tokens 1500 --new-tokens 256 --shape qwen2.5-7b \
        --dtype bfloat16 --repeats 1 --out x.json       # on a GPU: the paper's shape, random weights

For each batch size: the replaced path (``transformers``' ``generate`` with the log-prob recorder and per-row seeded
streams, tests/hf_reference.py), the engine (``Policy.generate``) and the engine over preallocated keys/values
(``static``: ``model.policy.cuda_graphs=true``, each step a CUDA graph on a GPU, the same loop eagerly on a CPU), the
same prompts and seeds, best of
``--repeats`` taken in turns, all inside the context a training run gives its rollouts here (bf16 autocast where
``trainer.precision=auto`` picks ``bf16-mixed``, as ``--trainer-precision`` says); the engine then computes each phase
in ``--rollout-precision`` (``auto``: the dtype this machine runs faster, ``src/models/rollout_engine.py``).
Per path: wall time of the whole generation, of the prefill alone (one new token), prefill tokens/s,
decoding ms per step ((whole - prefill) / decoding steps of the longest reply), the tokens generated. ``bound_ms``:
the bytes one of the engine's decoding steps must read at least (the weights, plus the keys/values of the mean context
over all rows, in the dtype the steps read: 2 bytes where they run the bf16 inference copy) over the bandwidth a copy
kernel reaches on this device (``copy_bandwidth``), i.e. the memory-bandwidth bound; ``replaced_bound_ms`` the same
in the weights' own dtype, what the replaced path reads.
Replies end at EOS: a real one, or with ``--stop-every K`` every K-th token id (replies of mixed lengths, as in
rollouts, so the engine's dropping of finished rows shows). Run it alone: other work on the cores moves every figure.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "scripts")]
os.environ.setdefault("PROJECT_ROOT", str(ROOT))

WORDS = ("red", "cotton", "shirt", "size", "small", "price", "lower", "than", "dollars", "click", "search", "buy",
         "blue", "pack", "of", "two", "women", "men", "[SEP]", "Back to Search", "Next >", "B09", "rating")


def copy_bandwidth(device, mib: int = 512, repeats: int = 5) -> float:
    """Bytes per second a device-to-device copy of ``mib`` MiB reaches (read + write), best of ``repeats``."""
    import torch

    src = torch.empty(mib * 2 ** 20 // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        tic = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - tic)
    return 2 * src.numel() * 4 / best


def _sync(device) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def make_prompts(policy, n: int, tokens: int, seed: int = 0) -> list[list[int]]:
    """``n`` chat prompts of about ``tokens`` ids, a shared system prompt and a WebShop-like page each."""
    rng = random.Random(seed)
    system = "You are a shopping agent. Reply with one action: search[query] or click[label]."
    prompts = []
    for i in range(n):
        page = " ".join(rng.choice(WORDS) for _ in range(tokens))
        ids = policy.encode([{"role": "system", "content": system}, {"role": "user", "content": page}], truncate=False)
        prompts.append(ids[-tokens:] if len(ids) > tokens else ids)
    return prompts


def timed(fn) -> tuple[float, object]:
    tic = time.perf_counter()
    out = fn()
    return time.perf_counter() - tic, out


def measure(policy, prompts, new_tokens: int, repeats: int, device, bf16_context: bool) -> dict:
    """The three paths on ``prompts``: whole generation, prefill alone, decoding per step, tokens generated. Each
    figure is the best of ``repeats``, the paths taking turns (round-robin), so a slow spell of a shared machine
    falls on all of them rather than on whichever ran then."""
    from dataclasses import replace

    import torch

    from hf_reference import hf_generate
    from src.models.rollout_engine import RolloutEngine

    seeds = list(range(len(prompts)))
    static = copy.copy(policy)  # model.policy.cuda_graphs=true: captured steps on CUDA, the same loop eagerly here
    static.engine = RolloutEngine(replace(policy.engine.settings, static="graphs"), policy.model)
    paths = {"replaced": lambda n: hf_generate(policy, prompts, n, 1.0, seeds=seeds)[0],
             "engine": lambda n: policy.generate(prompts, max_new_tokens=n, temperature=1.0, seeds=seeds).response_ids,
             "static": lambda n: static.generate(prompts, max_new_tokens=n, temperature=1.0, seeds=seeds).response_ids}
    best = {name: {"whole": float("inf"), "prefill": float("inf")} for name in paths}
    replies = {}
    with torch.no_grad(), torch.autocast(str(device).split(":")[0], dtype=torch.bfloat16, enabled=bf16_context):
        for _ in range(repeats):
            for name, run in paths.items():
                whole, replies[name] = timed(lambda: run(new_tokens))
                prefill, _ = timed(lambda: run(1))
                best[name] = {"whole": min(whole, best[name]["whole"]), "prefill": min(prefill, best[name]["prefill"])}
    out = {}
    for name, times in best.items():
        steps = max(len(r) for r in replies[name]) - 1
        out[name] = {"whole_s": times["whole"], "prefill_s": times["prefill"],
                     "prefill_tokens_per_s": sum(len(p) for p in prompts) / times["prefill"],
                     "decode_ms_per_step": 1000 * (times["whole"] - times["prefill"]) / max(steps, 1),
                     "generated_tokens": sum(len(r) for r in replies[name]), "longest_reply": steps + 1}
    return out


def load_policy(args):
    """``--model`` (or random weights of ``--shape``) in ``--dtype`` on ``--device``, in eval mode. ``--model`` is
    built as training builds it, trainable (fp32 master weights): inside one autocast region autocast keeps its casts
    of trainable weights, as in a training rollout, and casts frozen ones again at every step."""
    from src.models.policy import build_policy

    cache_dir = os.environ.get("EMPO2_DATA_DIR", str(ROOT / "data")) + "/models"
    if args.shape:
        policy = random_policy(args.shape, cache_dir, args.device, args.dtype)
    else:
        policy = build_policy(name_or_path=args.model, cache_dir=cache_dir, dtype=args.dtype, master_dtype=args.dtype,
                              trainable=True, max_response_tokens=args.new_tokens, max_prompt_tokens=1 << 20)
    policy.model.to(args.device).eval()
    return policy


def random_policy(shape: str, cache_dir: str, device: str, dtype: str):
    """A policy of ``shape`` with random ``dtype`` weights built on ``device`` (no download: the paper models' public
    config.json values) and the tiny model's SmolLM2 tokenizer (its ids fit every shape's vocabulary)."""
    import tempfile

    import torch

    from bench_paper_shapes import config_dir, make_policy

    with tempfile.TemporaryDirectory() as tmp:
        return make_policy(config_dir(shape, Path(tmp)), f"{cache_dir}/tiny-random-llama", device,
                           getattr(torch, dtype), lora=False, checkpointing=False)


def summary(result: dict) -> dict:
    """The headline figures of ``measure``'s result: each engine path's decoding ms per step and whole-call
    speed-up over the replaced path, then the result itself."""
    replaced = result["replaced"]["whole_s"]
    return {"decode_ms_per_step": result["engine"]["decode_ms_per_step"],
            "speedup_whole": replaced / result["engine"]["whole_s"],
            "static_decode_ms_per_step": result["static"]["decode_ms_per_step"],
            "speedup_whole_static": replaced / result["static"]["whole_s"], **result}


def bound_ms(policy, prompts, new_tokens: int, bandwidth: float, step_bytes: int | None = None) -> float:
    """The memory-bandwidth bound of one decoding step: weight bytes plus the keys/values of every row's mean
    context (prompt + half the new tokens), over ``bandwidth``, in ms. ``step_bytes``: the bytes per weight and per
    key/value element the steps read (2 for the bf16 inference copy); default the weights' own."""
    config = policy.model.config
    params = list(policy.model.parameters())
    weights = sum(p.numel() * (step_bytes or p.element_size()) for p in params)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * (step_bytes or
                                                                                        params[0].element_size())
    context = sum(len(p) + new_tokens / 2 for p in prompts)
    return 1000 * (weights + per_token * context) / bandwidth


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded:SmolLM2-135M-Instruct", help="model.policy.name_or_path")
    parser.add_argument("--shape", choices=["qwen2.5-7b", "qwen2.5-3b", "tiny"], default=None,
                        help="instead of --model: random weights of that shape (scripts/bench_paper_shapes.py)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, nargs="+", default=[8])
    parser.add_argument("--prompt-tokens", type=int, default=900)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--stop-every", type=int, default=0, help="also stop at every K-th token id (0: real EOS)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    parser.add_argument("--trainer-precision", default="auto", choices=["auto", "32-true", "bf16-mixed"],
                        help="the rollouts' outer context, as trainer.precision=... gives it")
    parser.add_argument("--rollout-precision", default="auto", help="model.policy.rollout_precision of the engine")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)

    import torch

    from src.models.rollout_engine import BF16_DECODE, EngineSettings, RolloutEngine, rollout_precision
    from src.utils.logging import machine_description
    from src.utils.precision_choice import cpu_features, decide_precision, probe_cpu_matmul

    os.environ.setdefault("EMPO2_ADAPT_THREADS", "0")
    policy = load_policy(args)
    kind = str(args.device).split(":")[0]
    trainer_precision = args.trainer_precision
    if trainer_precision == "auto":
        trainer_precision = decide_precision(kind, cuda_bf16=kind == "cuda" and torch.cuda.is_bf16_supported(),
                                             probe=probe_cpu_matmul() if kind == "cpu" else None,
                                             features=cpu_features() if kind == "cpu" else "")[0]
    chosen = rollout_precision(args.rollout_precision, kind)  # auto: this process measures this machine
    policy.engine = RolloutEngine(EngineSettings(chosen), policy.model)
    if args.stop_every:
        vocab = policy.model.get_output_embeddings().weight.shape[0]
        policy.eos_token_ids = sorted(set(policy.eos_token_ids) | set(range(0, vocab, args.stop_every)))
    bandwidth = copy_bandwidth(args.device)
    copied = chosen in BF16_DECODE and next(policy.model.parameters()).dtype != torch.bfloat16
    rows = []
    for n in args.prompts:
        prompts = make_prompts(policy, n, args.prompt_tokens)
        result = measure(policy, prompts, args.new_tokens, args.repeats, args.device,
                         bf16_context=trainer_precision == "bf16-mixed")
        rows.append({"device": machine_description() if args.device == "cpu" else torch.cuda.get_device_name(),
                     "prompts": n, "prompt_tokens": sum(len(p) for p in prompts) / n, "new_tokens": args.new_tokens,
                     "dtype": args.dtype, "trainable_weights": any(p.requires_grad for p in policy.model.parameters()),
                     "threads": torch.get_num_threads(), "trainer_precision": trainer_precision,
                     "rollout_precision": chosen,
                     "bound_ms": bound_ms(policy, prompts, args.new_tokens, bandwidth, 2 if copied else None),
                     "replaced_bound_ms": bound_ms(policy, prompts, args.new_tokens, bandwidth), **summary(result)})
    report = {"model": args.model, "copy_bandwidth_gb_s": bandwidth / 1e9, "python": platform.python_version(),
              "torch": torch.__version__, "rows": rows}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return report


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


if __name__ == "__main__":
    main()
