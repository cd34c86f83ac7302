"""How much of a training run's effect on log-probs an export keeps (docs/export.md, "What the export keeps").

    python scripts/export_fidelity.py                     # SmolLM2, lr 1e-6 x 150 AdamW steps, LoRA and full
    python scripts/export_fidelity.py --steps 30 --kinds lora

Trains the embedded SmolLM2-135M-Instruct for ``--steps`` AdamW steps at ``--lr`` to raise the log-probs of fixed
WebShop-style responses (a supervised stand-in for RL updates at the paper's learning rate), writes the result as a
``src/train.py``-style checkpoint and exports it with ``src/model_export.py`` in each variant:

- ``lora``: a bf16 base (the paper setting, ``model.policy.dtype=bfloat16``) with fp32 LoRA r16 adapters; exports:
  the default (merged, float32), ``export.dtype=bfloat16`` (merged, rounded), ``export.adapter_only=true``;
- ``full``: a full fine-tune with fp32 master weights; exports: the default (float32), ``export.dtype=bfloat16``.

The bf16 base is trained with its weights upcast to float32 (the same values: bf16 numbers are exact in float32),
so the CPU need not run bf16 matmuls; the checkpoint records the bf16 base, as a bf16 run's would. Every model is
scored in float32 on the training pairs. Prints, per export: ``kept = 1 − mean|lp_export − lp_trained| /
mean|lp_trained − lp_start|`` (the share of training's effect on the target log-probs the export keeps) and the
share of the trained weights the export left unchanged from the start.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PROJECT_ROOT", str(ROOT))

PAIRS = [  # (observation, response): what a WebShop agent sees and answers
    ("Instruction: [SEP] i need a long lasting 6.76 fl oz bottle of l'eau d'issey, and price lower than 100.00 "
     "dollars [SEP] Search", "<action>search[l'eau d'issey 6.76 fl oz bottle]</action>"),
    ("Instruction: [SEP] i want a black folding table for the patio under 60 dollars [SEP] Back to Search [SEP] "
     "Page 1 (Total results: 50) [SEP] Next > [SEP] B07X1 [SEP] Black Folding Patio Table [SEP] $45.99",
     "<action>click[b07x1]</action>"),
    ("Instruction: [SEP] gluten free almond flour, 2 pound bag [SEP] Back to Search [SEP] < Prev [SEP] size "
     "[SEP] 1 pound [SEP] 2 pound [SEP] Almond Flour [SEP] Price: $12.99 [SEP] Buy Now",
     "<action>click[2 pound]</action>"),
    ("Instruction: [SEP] a pink hoodie for women, size medium [SEP] Back to Search [SEP] < Prev [SEP] color "
     "[SEP] pink [SEP] size [SEP] medium [SEP] Women's Hoodie [SEP] Price: $29.99 [SEP] Buy Now",
     "<action>click[buy now]</action>"),
]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150, help="AdamW steps")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--kinds", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    ap.add_argument("--model", default="embedded:SmolLM2-135M-Instruct")
    return ap


def _log_probs(policy, batch):
    import torch

    with torch.no_grad():
        out = policy.eval().log_probs(*batch)
    return out["log_probs"], out["response_mask"]


def _train(policy, batch, steps: int, lr: float) -> None:
    import torch

    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    policy.train()
    for _ in range(steps):
        out = policy.log_probs(*batch)
        loss = -(out["log_probs"].sum() / out["response_mask"].sum())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _export(ckpt_path: Path, out: Path, *overrides: str) -> dict:
    from hydra import compose, initialize_config_dir

    from src.model_export import run_export

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="export", overrides=["experiment=webshop", f"ckpt_path={ckpt_path}",
                                                        f"export.out_dir={out}", "export.memory=false",
                                                        f"paths.output_dir={out.parent}", *overrides])
    return run_export(cfg)


def _load_export(out: Path, info: dict, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    from src.models.policy import Policy

    if info["weights"]["kind"] == "lora_adapter":
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(info["weights"]["base_model"], dtype=torch.float32)
        return Policy(PeftModel.from_pretrained(base, out), tokenizer)
    return Policy(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), tokenizer)


def run(kind: str, args, tmp: Path) -> list[dict]:
    import torch

    from src.models.checkpoint_state import base_record, keep_trainable
    from src.models.hub import resolve_name_or_path
    from src.models.policy import build_policy

    cache = str(ROOT / "data" / "models")
    lora = {"enabled": True, "r": 16, "alpha": 32, "target_modules": "all-linear"} if kind == "lora" else None
    policy_cfg = {"name_or_path": resolve_name_or_path(args.model, cache), "cache_dir": cache,
                  "dtype": "bfloat16" if kind == "lora" else "float32", "lora": lora, "max_response_tokens": 32}
    torch.manual_seed(0)
    policy = build_policy(**policy_cfg)
    record = None
    if kind == "lora":
        names = {n for n, p in policy.named_parameters() if p.requires_grad}
        record = base_record(policy, policy_cfg, names)  # of the bf16 base, as a bf16 run records it
        policy.model.float()  # the same values in float32: no bf16 matmuls on the CPU
    batch = ([policy.encode([{"role": "user", "content": obs}]) for obs, _ in PAIRS],
             [policy.tokenizer(resp, add_special_tokens=False)["input_ids"] + [policy.tokenizer.eos_token_id]
              for _, resp in PAIRS])
    start = {n: p.detach().clone() for n, p in policy.model.named_parameters()} if kind == "full" else None
    lp_start, mask = _log_probs(policy, batch) if kind == "full" else (None, None)
    if kind == "lora":
        with policy.model.disable_adapter():
            lp_start, mask = _log_probs(policy, batch)
    tic = time.perf_counter()
    _train(policy, batch, args.steps, args.lr)
    train_s = time.perf_counter() - tic
    lp_trained, _ = _log_probs(policy, batch)
    moved = float((lp_trained - lp_start).abs().sum() / mask.sum())
    ckpt = {"state_dict": {f"policy.{k}": v for k, v in policy.state_dict().items()}, "global_step": args.steps,
            "iteration": 0, "hyper_parameters": {"policy": policy_cfg,
                                                 "algorithm": {"name": "grpo", "temperature": 1.0}}}
    if kind == "lora":
        keep_trainable(ckpt, policy)
        ckpt["policy_base"] = record
    ckpt_path = tmp / f"{kind}.ckpt"
    torch.save(ckpt, ckpt_path)
    variants = {"default": [], "export.dtype=bfloat16": ["export.dtype=bfloat16"]}
    if kind == "lora":
        variants["export.adapter_only=true"] = ["export.adapter_only=true"]
    rows = []
    for name, overrides in variants.items():
        out = tmp / f"{kind}-{len(rows)}"
        info = _export(ckpt_path, out, *overrides)
        exported = _load_export(out, info, policy.tokenizer)
        lp, _ = _log_probs(exported, batch)
        off = float((lp - lp_trained).abs().sum() / mask.sum())
        unchanged = None
        if start is not None:  # full fine-tune: trained entries the export put back to their start value
            got = dict(exported.model.named_parameters())
            changed = [(start[n] != p) for n, p in policy.model.named_parameters()]
            same = [(got[n] == start[n]) & c for (n, _), c in zip(policy.model.named_parameters(), changed)]
            unchanged = float(sum(int(s.sum()) for s in same) / max(1, sum(int(c.sum()) for c in changed)))
        rows.append({"kind": kind, "export": name, "files": info["weights"]["dtype"], "moved": moved, "off": off,
                     "kept": 1 - off / moved, "weights_update_kept": info["weights"].get("update_kept"),
                     "trained_entries_reverted": unchanged, "train_s": train_s})
    return rows


def main() -> None:
    args = _parser().parse_args()
    logging_quiet()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [row for kind in args.kinds for row in run(kind, args, Path(tmp))]
    print(f"SmolLM2 ({args.model}), AdamW lr {args.lr:g} x {args.steps} steps on {len(PAIRS)} WebShop-style "
          f"pairs; log-probs in float32 (nats per response token)")
    print("| policy | export | files | training moved | export off by | kept | weight-level kept |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        weight = "" if r["weights_update_kept"] is None else f"{r['weights_update_kept']:.3f}"
        if r["trained_entries_reverted"] is not None:
            weight = f"{100 * r['trained_entries_reverted']:.1f}% of changed entries back at start"
        print(f"| {r['kind']} | {r['export']} | {r['files']} | {r['moved']:.4f} | {r['off']:.4f} | "
              f"{100 * r['kept']:.2f}% | {weight} |")


def logging_quiet() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)


if __name__ == "__main__":
    main()
