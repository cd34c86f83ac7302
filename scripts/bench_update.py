"""The update and the warm start with and without prefix trees (issue 60), on recorded mini-batches, taking turns in
one process: seconds per optimizer step, tokens computed, peak resident memory, the machine.

    python scripts/bench_update.py record --experiment scienceworld --iterations 2 --out /tmp/sw_batches.pt
    python scripts/bench_update.py update --batches /tmp/sw_batches.pt --experiment scienceworld \\
        --budget 4096 --out docs/results/update_bench/scienceworld.json
    python scripts/bench_update.py warm_start --experiment scienceworld --out docs/results/update_bench/warm_start.json

``record`` runs ``src/train.py``'s training (the experiment's settings, no warm start unless ``--warm-start``) for
``--iterations`` iterations and keeps every micro-batch the update saw, grouped into its mini-batches. ``update``
runs each recorded mini-batch through today's path (micro-batches of ``data.micro_batch_size`` rows, each
micro-batch's common prompt prefix computed once) and the prefix-tree path (``data.micro_batch_tokens=--budget``):
forward, backward and an AdamW step per mini-batch, the two paths alternating. ``warm_start`` does the same for the
warm start's actions phase: its demonstration batches as padded row chunks against prefix trees, both under
``model.warm_start.micro_batch_tokens``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import lightning as L  # noqa: E402
import rootutils  # noqa: E402

rootutils.setup_root(__file__, indicator=".project-root", pythonpath=True)  # PROJECT_ROOT for the configs
import src  # noqa: E402,F401 - the config resolvers and schemas

FIELDS = ("update_prompt_ids", "old_prompt_ids", "rollout_prompt_ids", "response_ids", "advantage",
          "old_log_probs", "ref_log_probs", "rollout_log_probs", "key")


class Recorder(L.Callback):
    """Keeps each micro-batch's samples and mini-batch facts at ``on_train_batch_start``."""

    def __init__(self) -> None:
        self.micro = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch.loss_scale == 0:
            return
        self.micro.append({"iteration": batch.iteration, "ppo_epoch": batch.ppo_epoch, "mini_batch": batch.mini_batch,
                           "mode": batch.mode, "batch_num_tokens": batch.batch_num_tokens,
                           "global_batch_size": batch.global_batch_size,
                           "samples": [{f: getattr(s, f) for f in FIELDS} for s in batch.samples]})


def compose(experiment: str, *overrides: str):
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=[f"experiment={experiment}", *overrides])


def record(args) -> None:
    from src.train import train

    cfg = compose(args.experiment, f"trainer.max_epochs={args.iterations}", "logger=csv", "data.val=null",
                  f"paths.log_dir={args.log_dir}", f"paths.output_dir={args.log_dir}/run",
                  "+callbacks.recorder._target_=bench_update.Recorder", *args.overrides,
                  *([] if args.warm_start else ["model.warm_start=null"]))
    objs = train(cfg)
    recorder = next(c for c in objs["trainer"].callbacks if type(c).__name__ == "Recorder")  # bench_update.Recorder
    mini: dict = {}
    for m in recorder.micro:
        mini.setdefault((m["iteration"], m["ppo_epoch"], m["mini_batch"]), []).append(m)
    batches = [{**parts[0], "samples": [s for p in parts for s in p["samples"]]} for parts in mini.values()]
    torch.save({"experiment": args.experiment, "overrides": args.overrides, "mini_batches": batches}, args.out)
    print(f"{len(batches)} mini-batches, {sum(len(b['samples']) for b in batches)} samples -> {args.out}")


class PeakRss:
    """The largest resident memory of this process while the block runs (sampled every 20 ms), in GiB."""

    def __enter__(self):
        self.peak, self._stop = psutil.Process().memory_info().rss, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, psutil.Process().memory_info().rss)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_gib = self.peak / 2**30


def update(args) -> None:
    import hydra
    from omegaconf import OmegaConf

    from src.data.minibatches import micro_batches
    from src.data.samples import StepSample

    recorded = torch.load(args.batches, weights_only=False)
    cfg = compose(args.experiment, "model.warm_start=null", *recorded["overrides"], *args.overrides)
    from src.warm_start import warm_start_model_config

    model_cfg, _ = warm_start_model_config(cfg)  # the warm start is null here: the base model
    module = hydra.utils.instantiate(model_cfg, algorithm=OmegaConf.to_container(cfg.algorithm, resolve=True))
    module.policy.train()
    optimizer = torch.optim.AdamW([p for p in module.policy.parameters() if p.requires_grad], lr=1e-7)
    paths = {"today": {"micro_batch_tokens": None}, "tree": {"micro_batch_tokens": args.budget}}
    results = {name: {"seconds": [], "tokens_computed": 0, "nominal_tokens": 0, "peak_rss_gib": 0.0} for name in paths}
    chosen = recorded["mini_batches"][: args.max_batches]
    for rep in range(args.repeats):
        for k, mb in enumerate(chosen):  # the two paths take turns on each mini-batch
            for name in (list(paths) if (rep + k) % 2 == 0 else list(paths)[::-1]):
                module.share_prompt_prefix = name == "today"
                samples = [StepSample(**s) for s in mb["samples"]]
                info = {"iteration": mb["iteration"], "mode": mb["mode"], "rollout_global_step": 0}
                micro = list(micro_batches(samples, info, {}, seed=0, iteration=mb["iteration"], ppo_epochs=1,
                                           micro_batch_size=int(cfg.data.micro_batch_size),
                                           padding=partial(StepSample.padding, 0), **paths[name]))
                with PeakRss() as rss:
                    tic = time.perf_counter()
                    for batch in micro:
                        loss, _, _, computed = module._loss(batch)
                        loss.backward()
                        if rep == 0:
                            results[name]["tokens_computed"] += computed
                            results[name]["nominal_tokens"] += sum(s.num_tokens for s in batch.samples)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    results[name]["seconds"].append(time.perf_counter() - tic)
                results[name]["peak_rss_gib"] = max(results[name]["peak_rss_gib"], rss.peak_gib)
                print(f"{name}: mini-batch {k}, {results[name]['seconds'][-1]:.1f} s", flush=True)
    write(args, {"kind": "update", "batches": str(args.batches), "budget": args.budget,
                 "micro_batch_size": int(cfg.data.micro_batch_size), "mini_batches": len(chosen),
                 "results": summarize(results, args.repeats)})


def warm_start(args) -> None:
    from omegaconf import OmegaConf

    from src.data.demonstrations import make_dataloader
    from src.models.sft_module import micro_batches, response_nll
    from src.warm_start import _prepare

    cfg = compose(args.experiment, *args.overrides)
    ws = {**OmegaConf.to_container(cfg.model.warm_start, resolve=True), "reflections": None}
    prep = _prepare(cfg, ws)
    policy = prep["policy"]
    policy.train()
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-7)
    batches = list(make_dataloader(prep["examples"], int(ws["batch_size"]), int(ws["seed"])))[: args.max_batches]
    budget = int(ws["micro_batch_tokens"])
    results = {n: {"seconds": [], "tokens_computed": 0, "nominal_tokens": 0, "peak_rss_gib": 0.0}
               for n in ("today", "tree")}
    for rep in range(args.repeats):
        for name in (("today", "tree") if rep % 2 == 0 else ("tree", "today")):
            for batch in batches:
                total = float(sum(len(e.response_ids) for e in batch))
                with PeakRss() as rss:
                    tic = time.perf_counter()
                    for chunk in micro_batches(batch, budget, tree=name == "tree"):
                        nll, _ = response_nll(policy, chunk, share_prefix=True, tree=name == "tree")
                        (nll / total).backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    results[name]["seconds"].append(time.perf_counter() - tic)
                results[name]["peak_rss_gib"] = max(results[name]["peak_rss_gib"], rss.peak_gib)
                if rep == 0:
                    results[name]["nominal_tokens"] += sum(len(e.prompt_ids) + len(e.response_ids) for e in batch)
    write(args, {"kind": "warm_start", "budget": budget, "batches": len(batches),
                 "examples": sum(len(b) for b in batches), "results": summarize(results, args.repeats)})


def summarize(results: dict, repeats: int) -> dict:
    out = {}
    for name, r in results.items():
        n = len(r["seconds"]) // repeats
        per_rep = [sum(r["seconds"][k * n:(k + 1) * n]) for k in range(repeats)]
        out[name] = {"seconds_per_pass": per_rep, "seconds_per_step_best": min(per_rep) / max(n, 1),
                     "tokens_computed": r["tokens_computed"], "nominal_tokens": r["nominal_tokens"],
                     "peak_rss_gib": round(r["peak_rss_gib"], 2)}
    out["tree_over_today_time"] = out["tree"]["seconds_per_step_best"] / out["today"]["seconds_per_step_best"]
    return out


def write(args, body: dict) -> None:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"}).stdout
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    body = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv), "experiment": args.experiment,
            "machine": {"model_name": fields.get("Model name", "?").strip(), "cpus": os.cpu_count(),
                        "avx512_bf16": "avx512_bf16" in flags, "amx": any(f.startswith("amx") for f in flags)},
            "load_average_1min": os.getloadavg()[0], "torch_threads": torch.get_num_threads(), **body}
    text = json.dumps(body, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["record", "update", "warm_start"])
    parser.add_argument("--experiment", default="scienceworld")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--warm-start", action="store_true", help="record: from the experiment's warm start")
    parser.add_argument("--batches", type=Path)
    parser.add_argument("--budget", type=int, default=4096, help="update: data.micro_batch_tokens of the tree path")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-batches", type=int, default=12, help="the first N (mini-)batches")
    parser.add_argument("--log-dir", default="/tmp/bench_update_logs")
    parser.add_argument("--out", default=None)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the experiment")
    args = parser.parse_intermixed_args()
    {"record": record, "update": update, "warm_start": warm_start}[args.what](args)


if __name__ == "__main__":
    main()
