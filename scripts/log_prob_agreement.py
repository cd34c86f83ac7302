"""How far the sampling log-probs are from the update's log-probs of the same tokens, under a precision.

    python scripts/log_prob_agreement.py                                   # WebShop prompts, bf16-mixed, SmolLM2
    python scripts/log_prob_agreement.py --precision 32-true --episodes 8 --steps 3

With ``algorithm.recompute_old_log_probs=false`` the first mini-batch's ratio is exp(scored − sampled): any
numerical disagreement between ``Policy.generate`` (KV-cache decoding, the rollout's batch and padding) and
``Policy.log_probs`` (one padded forward pass per micro-batch, as in ``training_step``) shows up as ratios ≠ 1
and, beyond the clip range, as clipped tokens before any update. The prompts are the WebShop experiment's own
(rendered by ``step_prompt`` from the scripted expert's states); the responses are sampled at T = 1 by the
policy under the Trainer's precision context (autocast under bf16-mixed), then scored in micro-batches under
the same context.

Prints max / mean |Δ log-prob| over response tokens, the fraction of tokens with a ratio outside
[1 − clip_ratio_low, 1 + clip_ratio_high], and ``clip_frac`` of the PPO loss with advantages of alternating sign.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PROJECT_ROOT", str(ROOT))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", default="bf16-mixed", help="Lightning precision of sampling and scoring")
    ap.add_argument("--episodes", type=int, default=8, help="prompts per generate call (the rollout batch)")
    ap.add_argument("--steps", type=int, default=2, help="generate calls (one per episode step)")
    ap.add_argument("--micro-batch", type=int, default=4, help="samples per scoring forward (data.micro_batch_size)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fp32-head", action="store_true", help="compute the output layer (logits) in float32")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of the training config (default experiment=webshop)")
    return ap


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = _parser().parse_args(argv)

    import lightning as L
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from src.models.policy import build_policy

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=webshop", *args.overrides])
    L.seed_everything(args.seed, verbose=False)
    policy = build_policy(**OmegaConf.to_container(cfg.model.policy, resolve=True))
    if args.fp32_head:
        _fp32_head(policy.model.get_output_embeddings())
    prompts = _prompts(policy, cfg, args.episodes, args.steps)
    context = L.Fabric(accelerator="cpu", devices=1, precision=args.precision).autocast
    temperature = float(cfg.data.temperature)
    policy.eval()
    tic = time.perf_counter()
    samples = _sample(policy, prompts, args.episodes, context, temperature, int(cfg.data.max_response_tokens))
    sample_s = time.perf_counter() - tic
    algo = cfg.algorithm
    result = _score(policy, samples, args.micro_batch, context, temperature, algo)
    result["sample_s"] = sample_s
    low, high = 1 - float(algo.clip_ratio_low), 1 + float(algo.clip_ratio_high)
    print(f"precision {args.precision}: {result['tokens']} response tokens of {len(samples)} samples "
          f"(prompts {result['prompt_tokens_mean']:.0f} tokens on average); |Δ log-prob| max "
          f"{result['max_abs_delta']:.4f} mean {result['mean_abs_delta']:.5f} p99 {result['p99_abs_delta']:.4f}; "
          f"ratio outside [{low:.1f}, {high:.1f}]: {result['outside_clip_range']:.4f}; clip_frac {result['clip_frac']:.4f}")
    return result


def _prompts(policy, cfg, episodes: int, steps: int) -> list[list[int]]:
    """``episodes`` prompts for each of the first ``steps`` steps of the scripted expert's demonstrations, rendered
    as the rollout renders them: every generate call is then a batch of different prompt lengths, as in a rollout."""
    from omegaconf import OmegaConf

    from src.data.demonstrations import build_examples, demonstration_records
    from src.data.rollout_config import RolloutConfig

    data = OmegaConf.to_container(cfg.data, resolve=True)
    records, system_prompt = demonstration_records(OmegaConf.to_container(cfg.env, resolve=True),
                                                   episodes * steps,
                                                   Path(cfg.paths.data_dir) / "scienceworld_gold")
    examples = build_examples(policy, records, system_prompt, RolloutConfig.from_data(data), data.get("max_steps"))
    by_step = {}
    for e in examples:
        by_step.setdefault(e.step, []).append(e.prompt_ids)
    return [p for step in sorted(by_step)[:steps] for p in by_step[step][:episodes]]


def _sample(policy, prompts: list[list[int]], episodes: int, context, temperature: float,
            max_new_tokens: int) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt, sampled response, sampling log-probs) per prompt, ``episodes`` prompts per generate call."""
    import torch

    samples = []
    for start in range(0, len(prompts), episodes):
        batch = prompts[start:start + episodes]
        with torch.no_grad(), context():
            gen = policy.generate(batch, max_new_tokens=max_new_tokens, temperature=temperature)
        samples += [(p, r, lp) for p, r, lp in zip(batch, gen.response_ids, gen.log_probs)]
    return samples


def _score(policy, samples, micro_batch: int, context, temperature: float, algo) -> dict[str, float]:
    """Score ``samples`` in micro-batches as ``training_step`` does and compare with their sampling log-probs."""
    import torch

    from src.models.core_algos import compute_policy_loss

    deltas, ratios, clip = [], [], []
    for start in range(0, len(samples), micro_batch):
        chunk = samples[start:start + micro_batch]
        # as training_step: autocast around one padded forward per micro-batch (no graph kept: same numbers)
        with torch.no_grad(), context():
            out = policy.log_probs([s[0] for s in chunk], [s[1] for s in chunk], temperature=temperature)
        old = torch.zeros_like(out["log_probs"])
        for i, s in enumerate(chunk):
            old[i, : len(s[2])] = torch.tensor(s[2])
        mask = out["response_mask"]
        new = out["log_probs"]
        deltas.append((new - old).abs()[mask.bool()])
        ratios.append(torch.exp(new - old)[mask.bool()])
        adv = torch.tensor([1.0 if (start + i) % 2 == 0 else -1.0 for i in range(len(chunk))])
        _, metrics = compute_policy_loss(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask,
                                         clip_ratio_low=float(algo.clip_ratio_low),
                                         clip_ratio_high=float(algo.clip_ratio_high),
                                         clip_ratio_c=float(algo.clip_ratio_c))
        clip.append((metrics["clip_frac"], float(mask.sum())))
    delta, ratio = torch.cat(deltas), torch.cat(ratios)
    low, high = 1 - float(algo.clip_ratio_low), 1 + float(algo.clip_ratio_high)
    return {"tokens": int(delta.numel()), "max_abs_delta": float(delta.max()), "mean_abs_delta": float(delta.mean()),
            "p99_abs_delta": float(delta.quantile(0.99)),
            "outside_clip_range": float(((ratio < low) | (ratio > high)).float().mean()),
            "clip_frac": sum(c * n for c, n in clip) / sum(n for _, n in clip),
            "prompt_tokens_mean": sum(len(s[0]) for s in samples) / len(samples)}


def _fp32_head(head) -> None:
    """Run the output layer outside autocast, in float32 (experiment: are bf16 logits the disagreement?)."""
    import torch

    def forward(x):
        with torch.autocast(x.device.type, enabled=False):
            return torch.nn.functional.linear(x.float(), head.weight.float(),
                                              None if head.bias is None else head.bias.float())

    head.forward = forward


if __name__ == "__main__":
    main()
