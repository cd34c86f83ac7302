"""What one warm-start step, one rollout generation and one RL update cost on this CPU, in each precision.

    python scripts/bench_cpu_speed.py                          # experiment=scienceworld, every setting
    python scripts/bench_cpu_speed.py --experiment webshop --batches 2
    python scripts/bench_cpu_speed.py --profile                # + the top operators of a step (torch.profiler)
    python scripts/bench_cpu_speed.py --shapes                 # forward + backward tokens/s by batch shape, and
                                                               # the attention kernels' share (random ids)

Uses the real SmolLM2-135M policy and the real demonstration examples of the experiment's warm start (the same
prompts RL sees; ScienceWorld gold paths are generated into the data dir on first use). For each precision
(``32-true``, ``bf16-mixed``) it times, in seconds per call (median of ``--batches`` after one warm-up):

- ``warm-start step``: forward + backward + AdamW on a batch of ``warm_start.batch_size`` examples, with and
  without activation checkpointing and with and without the shared-prompt-prefix forward;
- ``generate``: one rollout step of ``data.tasks_per_iteration x data.group_size`` prompts, up to
  ``data.max_response_tokens`` new tokens (T = 1.0);
- ``update``: forward (with entropy) + backward + AdamW on a micro-batch of ``data.micro_batch_size`` of those
  prompts with their sampled replies.

It prints the machine first (CPU model, torch's CPU capability, bf16 support, threads) and the matmul probe
that ``trainer.precision=auto`` decides with. Figures belong to the machine they were measured on.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PROJECT_ROOT", str(ROOT))


def compose(experiment: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    import src  # noqa: F401 - config resolvers

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = hydra_compose("train.yaml", overrides=[f"experiment={experiment}", "trainer.precision=32-true"],
                            return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    return cfg


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: allocations, kernel selection
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", default="scienceworld")
    parser.add_argument("--batches", type=int, default=2, help="timed calls per setting (after one warm-up)")
    parser.add_argument("--precisions", nargs="+", default=["32-true", "bf16-mixed"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--profile", action="store_true", help="print the top operators of one step of each kind")
    parser.add_argument("--shapes", action="store_true",
                        help="only: bf16 forward + backward tokens/s of the policy by batch shape and attention kernel")
    args = parser.parse_args(argv)

    import lightning as L
    import torch

    from src.utils.logging import cpu_model
    from src.utils.precision_choice import cpu_features, decide_precision, probe_cpu_matmul

    if args.threads:
        torch.set_num_threads(args.threads)
    probe = probe_cpu_matmul()
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}, {cpu_features()}, "
          f"{torch.get_num_threads()} threads")
    print(f"matmul probe {probe.n}^2: fp32 {probe.fp32_gflops:.0f} GFLOP/s, bf16 {probe.bf16_gflops:.1f} GFLOP/s -> "
          f"trainer.precision=auto picks {decide_precision('cpu', probe=probe)[0]}")
    if args.shapes:
        return shapes(compose(args.experiment), args.batches)
    bench = Bench(compose(args.experiment), args.batches)
    print(f"\n{'precision':<11} {'what':<66} {'s/call':>8} {'tokens/s':>9}")
    for precision in args.precisions:
        autocast = L.Fabric(accelerator="cpu", devices=1, precision=precision).autocast
        bench.warm_start_steps(precision, autocast)
        update = bench.generation_and_update(precision, autocast)
        if args.profile:
            profile_top(precision, autocast, {"warm-start step": lambda: bench.sft_step(True), "update": update})


class Bench:
    """The experiment's warm-start batch, rollout prompts and an optimizer over the real SmolLM2 policy."""

    def __init__(self, cfg, repeats: int):
        import torch
        from omegaconf import OmegaConf

        from src.data.demonstrations import make_dataloader
        from src.warm_start import _prepare

        ws = OmegaConf.to_container(cfg.model.warm_start, resolve=True)
        prep = _prepare(cfg, ws)
        self.policy, examples, self.data, self.repeats = prep["policy"], prep["examples"], cfg.data, repeats
        self.batch = next(iter(make_dataloader(examples, int(ws["batch_size"]), 0)))
        self.tokens = sum(len(e.prompt_ids) + len(e.response_ids) for e in self.batch)
        self.set_checkpointing(False)
        shared = self.policy.shared_prefix_length([e.prompt_ids for e in self.batch])
        self.n_prompts = int(self.data.tasks_per_iteration) * int(self.data.group_size)
        self.prompts = [e.prompt_ids for e in examples[:self.n_prompts]]
        print(f"warm-start batch: {len(self.batch)} examples, {self.tokens} tokens ({shared} shared prompt-prefix "
              f"tokens); rollout step: {self.n_prompts} prompts of "
              f"{sum(map(len, self.prompts)) / self.n_prompts:.0f} tokens on average")
        self.optimizer = torch.optim.AdamW([p for p in self.policy.parameters() if p.requires_grad], lr=1e-7)
        self.policy.train()

    def set_checkpointing(self, on: bool) -> None:
        if on:
            self.policy.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            self.policy.model.gradient_checkpointing_disable()

    def sft_step(self, share: bool) -> None:
        from src.models.sft_module import response_nll

        self.optimizer.zero_grad()
        nll, target_tokens = response_nll(self.policy, self.batch, share_prefix=share)
        (nll / target_tokens).backward()
        self.optimizer.step()

    def warm_start_steps(self, precision: str, autocast) -> None:
        for checkpointing in (True, False):
            self.set_checkpointing(checkpointing)
            for share in (False, True) if not checkpointing else (False,):
                with autocast():
                    seconds = timed(lambda: self.sft_step(share), self.repeats)
                report((precision, f"warm-start step (checkpointing {'on' if checkpointing else 'off'}, shared "
                                   f"prefix {'on' if share else 'off'})", seconds, self.tokens / seconds))

    def generation_and_update(self, precision: str, autocast):
        """Time a rollout generation step and an update on its replies; return the update (for profiling)."""
        import torch

        new_tokens = int(self.data.max_response_tokens)
        with autocast(), torch.no_grad():
            generation = self.policy.generate(self.prompts, max_new_tokens=new_tokens, temperature=1.0)
            seconds = timed(lambda: self.policy.generate(self.prompts, max_new_tokens=new_tokens, temperature=1.0),
                            self.repeats)
        report((precision, f"generate ({self.n_prompts} prompts, <= {new_tokens} new tokens)", seconds,
                sum(map(len, generation.response_ids)) / seconds))
        k = int(self.data.micro_batch_size)
        update_tokens = sum(len(p) for p in self.prompts[:k]) + sum(len(r) for r in generation.response_ids[:k])

        def update():
            self.optimizer.zero_grad()
            out = self.policy.log_probs(self.prompts[:k], generation.response_ids[:k], with_entropy=True)
            (-(out["log_probs"].sum()) / out["response_mask"].sum()).backward()
            self.optimizer.step()

        for checkpointing in (True, False):
            self.set_checkpointing(checkpointing)
            with autocast():
                seconds = timed(update, self.repeats)
            report((precision, f"update (micro-batch {k}, checkpointing {'on' if checkpointing else 'off'})",
                    seconds, update_tokens / seconds))
        return update


def shapes(cfg, repeats: int, sizes=((8, 400), (8, 800), (2, 1500))) -> None:
    """bf16 forward + backward of the experiment's policy on random ids (first row left-padded by 50, logits of the
    last 6 positions, as the warm start asks for them), tokens/s per (rows, length) and attention kernel; then one
    layer's attention alone (SmolLM2's 9 query / 3 key-value heads of 64), causal and with a padding mask."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AutoModelForCausalLM

    from src.models.hub import resolve_name_or_path

    path = resolve_name_or_path(str(cfg.model.policy.name_or_path), cfg.model.policy.cache_dir)
    for kernel in ("sdpa", "eager", "math"):
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager" if kernel == "eager" else "sdpa",
                                                     dtype=torch.float32).train()
        for rows, length in sizes:
            ids, mask = torch.randint(0, 40000, (rows, length)), torch.ones(rows, length, dtype=torch.long)
            mask[0, :50] = 0

            def step():
                ctx = sdpa_kernel(SDPBackend.MATH) if kernel == "math" else contextlib.nullcontext()
                with torch.autocast("cpu", dtype=torch.bfloat16), ctx:
                    logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=6, use_cache=False).logits
                logits.float().logsumexp(-1).sum().backward()
            seconds = timed(step, repeats)
            report(("bf16-mixed", f"forward + backward {rows} x {length} ({kernel} attention)", seconds,
                    rows * length / seconds))
    for rows, length in sizes:
        q = torch.randn(rows, 9, length, 64, dtype=torch.bfloat16, requires_grad=True)
        kv = [torch.randn(rows, 3, length, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
        pad = torch.ones(length, length, dtype=torch.bool).tril().expand(rows, 1, length, length).clone()
        pad[0, :, :, 1:50] = False
        for name, kwargs in (("causal", {"is_causal": True}), ("padding mask", {"attn_mask": pad})):
            def attention():
                k, v = (t.repeat_interleave(3, 1) for t in kv)
                F.scaled_dot_product_attention(q, k, v, **kwargs).float().sum().backward()
            seconds = timed(attention, repeats)
            report(("bf16", f"one layer's SDPA forward + backward {rows} x {length} ({name})", seconds,
                    rows * length / seconds))


def profile_top(precision: str, autocast, steps: dict) -> None:
    """Print the top operators (self CPU time) of one call of each step."""
    from torch.profiler import ProfilerActivity, profile

    for name, fn in steps.items():
        with autocast(), profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        print(f"\n[{precision}] top operators of one {name} (self CPU time):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=40))


def report(row: tuple[str, str, float, float]) -> None:
    precision, what, seconds, rate = row
    print(f"{precision:<11} {what:<66} {seconds:>8.2f} {rate:>9.0f}", flush=True)


if __name__ == "__main__":
    main()
