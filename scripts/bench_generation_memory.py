"""Peak resident memory of one batched generation: full-vocabulary logits kept per step (the previous approach)
vs the policy's step-by-step log-probs (src/models/sampling.py).

    python scripts/bench_generation_memory.py                      # tiny model, 151,936-token vocab, B=16, T=256

Each approach runs in a fresh subprocess: load the model, warm up, reset the kernel's peak-RSS counter
(``/proc/self/clear_refs``), generate ``--tokens`` tokens for ``--batch`` prompts, and report the peak resident
set size above the level just before the call. The subprocesses run with ``MALLOC_MMAP_THRESHOLD_=65536``, so
glibc maps every tensor buffer on its own and unmaps it when freed: the RSS then follows the tensors alive.
(With glibc's adaptive default, freed per-step buffers stay in per-thread heaps and the measured peak of the
same call varied from 60 MB to 2 GB between identical runs.) The last line printed is the results as JSON.
The model is a randomly initialised 2-layer Llama with Qwen2.5's
vocabulary size, written once to a temporary directory (the tokenizer is SmolLM2's; ids it does not know decode
to nothing, which does not matter here).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rss(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (Linux >= 4.0)
        return True
    except OSError:
        return False


def _generate_old(policy, prompts, tokens: int, temperature: float = 1.0) -> list[int]:
    """The previous implementation: ``output_logits=True`` keeps every step's [B, V] logits, stacked afterwards."""
    import torch

    from src.models.log_probs import log_probs_from_logits
    from src.models.policy import pack_batch

    batch = pack_batch(prompts, [[] for _ in prompts], policy.tokenizer.pad_token_id)
    batch = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
    out = policy.model.generate(**batch, max_new_tokens=tokens, do_sample=True, temperature=temperature, top_k=0,
                                top_p=1.0, output_logits=True, return_dict_in_generate=True,
                                pad_token_id=policy.tokenizer.pad_token_id, eos_token_id=policy.eos_token_ids)
    sequences = out.sequences[:, batch["input_ids"].shape[1]:]
    logits = torch.stack(out.logits, dim=1).float().cpu() / temperature
    log_probs_from_logits(logits, sequences)
    return [sequences.shape[1]]


def measure(mode: str, model_dir: str, batch: int, tokens: int) -> dict:
    """Run one approach in this process; returns the peak RSS increase and what was generated."""
    import torch

    from src.models.policy import build_policy

    torch.manual_seed(0)
    policy = build_policy(name_or_path=model_dir, cache_dir=tempfile.gettempdir(), dtype="float32")
    prompts = [policy.encode([{"role": "user", "content": f"Describe item {k}."}]) for k in range(batch)]
    run = (lambda n: _generate_old(policy, prompts, n)) if mode == "old" else (
        lambda n: [len(r) for r in policy.generate(prompts, max_new_tokens=n).response_ids])
    run(2)  # warm-up: first-call allocations are not the approach's
    exact = _reset_peak()
    before = _rss("VmRSS")
    lengths = run(tokens)
    peak = _rss("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"mode": mode, "batch": batch, "tokens": tokens, "vocab_size": policy.model.config.vocab_size,
            "generated_tokens": batch * max(lengths), "peak_rss_increase_bytes": peak - before,
            "exact_peak": exact}


def build_model(out_dir: Path, vocab_size: int) -> str:
    """A 2-layer, 64-wide random Llama with ``vocab_size`` tokens and SmolLM2's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from src.models.hub import EMBEDDED_TINY, resolve_name_or_path

    tiny = resolve_name_or_path(EMBEDDED_TINY, ROOT / "data" / "models")
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out_dir)
    return str(out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", choices=["old", "policy"], default=["old", "policy"],
                        help="approaches to measure, each in its own subprocess")
    parser.add_argument("--mode", choices=["old", "policy"], help=argparse.SUPPRESS)  # the subprocess
    parser.add_argument("--model", help="model directory (default: a random model with --vocab-size tokens)")
    parser.add_argument("--vocab-size", type=int, default=151_936)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.mode:
        print(json.dumps(measure(args.mode, args.model, args.batch, args.tokens)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_model(Path(tmp) / "model", args.vocab_size)
        for mode in args.modes:
            cmd = [sys.executable, __file__, "--mode", mode, "--model", model, "--batch", str(args.batch),
                   "--tokens", str(args.tokens)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode:
                sys.exit(f"{mode} failed:\n{proc.stderr[-3000:]}")
            results[mode] = r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"B={r['batch']} T={r['tokens']} V={r['vocab_size']:,}: one [B, T, V] float32 tensor is "
          f"{r['batch'] * r['tokens'] * r['vocab_size'] * 4 / 2**20:,.0f} MiB")
    labels = {"old": "full logits per step (previous)", "policy": "step-by-step log-probs (policy)"}
    for mode, r in results.items():
        print(f"peak RSS increase, {labels[mode]}: {r['peak_rss_increase_bytes'] / 2**20:10,.1f} MiB")
    if len(results) == 2:
        old, new = (results[m]["peak_rss_increase_bytes"] for m in ("old", "policy"))
        print(f"ratio new/old = 1/{old / max(new, 1):.0f}  (target <= 1/20)")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
