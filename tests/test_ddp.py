"""DDP and FSDP2 on CPU (2 processes, gloo) through the real CLI, with the stub environment of ``tests/stub_envs.py``
(its reward counts the characters of the action, so the tiny policy has a gradient to follow).

- DDP logs the numbers of the whole batch: 2 ranks and 1 process, on the same episodes and samples, log the same
  value for every ``train/*``, ``rollout/*`` and ``val/*`` key (docs/usage.md#gpus-and-strategies);
- DDP resumes exactly: 1 iteration + resume + 2 iterations give the 3 uninterrupted iterations' weights, optimizer
  state, memory (tips and novelty counts, checked identical on both ranks at every save), every rank's generators
  and logged metrics;
- FSDP2 trains, checkpoints (a distributed-checkpoint directory) and resumes; its checkpoint evaluates like the same
  weights saved as one file, and resumes under another strategy.
"""
from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_report import failure_report, run_cli
from hydra import compose, initialize_config_dir
from stub_envs import STUB_ENV_VARS

ROOT = Path(__file__).resolve().parents[1]
# seed 10 draws the modes off_policy, on_policy_with_tips, on_policy_with_tips and the variations [3, 2], [1, 3],
# [3, 2] (tips are retrieved after the resume point); the tiny policy's tokens are all below the low-probability
# threshold, so the off-policy iteration 0 masks every token and the policy-gradient signal comes after it
SEED, ITERATIONS, TASKS = 10, 3, 2
# 2 tasks x 2 episodes x 3 steps = 12 rows per iteration, 6 rows per optimizer step (data.mini_batch_rows, counted over
# both ranks): 2 steps per iteration on 2 ranks as on 1
STEPS = 2
STUB = ["env._target_=stub_envs.StubEnv", "+env.reward_per_char=0.1", "+env.num_tasks=4"]
# tiny policy, CSV logger, 3-step episodes; 2 tasks x 2 episodes, one optimizer step per 6 rows, a KL term
RUN = ["experiment=scienceworld", "debug=default", "logger=csv", "trainer.precision=32-true", *STUB,
       f"data.tasks_per_iteration={TASKS}", "data.group_size=2", "data.num_mini_batches=null", "data.mini_batch_rows=6",
       "data.micro_batch_size=2",
       "data.val.num_tasks=2", "algorithm.memory_rollout_prob=1.0", "algorithm.skip_zero_advantage=false",
       "algorithm.kl_coef=0.01", f"seed={SEED}", "callbacks.model_checkpoint.save_top_k=-1",
       "~callbacks.rich_progress_bar", "trainer.enable_progress_bar=false"]
DDP = ["trainer.strategy=ddp", "trainer.devices=2"]


def _train_cli(tmp: Path, name: str, *overrides: str) -> Path:
    """``src/train.py`` with the stub environment, rollouts in the Trainer's precision (as tests/conftest.py pins
    them in this process); the run directory (its console output in ``console.txt``)."""
    proc = run_cli(["src/train.py", *overrides, "model.policy.rollout_precision=trainer", f"paths.log_dir={tmp}/logs",
                    f"hydra.run.dir={tmp}/{name}"], env=STUB_ENV_VARS)
    assert proc.returncode == 0, failure_report(proc)
    (tmp / name / "console.txt").write_text(proc.stdout + proc.stderr)
    return tmp / name


def _metrics(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every logged point of ``run_dir``'s CSV log: ``{key: {step: value}}`` (timings, the process's memory
    ``system/*``, Lightning's epoch and the tokens computed aside: they differ between runs of the same
    iterations; each rank computes the prompt prefixes its own rows share)."""
    out: dict[str, dict[int, float]] = {}
    with open(next(run_dir.rglob("metrics.csv"))) as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if value != "" and key not in ("step", "epoch") and not key.endswith("_s") \
                        and not key.startswith(("system/", "rollout/prompt_tokens_computed", "rollout/prompt_shared",
                                                "train/tokens_computed")):
                    out.setdefault(key, {})[int(row["step"])] = float(value)
    return out


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def _memory(ckpt: dict) -> dict:
    """The checkpoint's memory without the tips' wall-clock write times."""
    state = ckpt["callbacks"]["MemoryCallback"]
    tips = {name: ([{k: v for k, v in e.items() if k != "created_at"} for e in p["entries"]], p["keys"].tolist())
            for name, p in state["tips"]["partitions"].items()}
    novelty = {k: (v.tolist(), state["novelty"]["counts"][k].tolist()) for k, v in state["novelty"]["states"].items()}
    return {"tips": tips, "novelty": novelty}


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """3 DDP iterations; 1 DDP iteration's checkpoint resumed for 2 more; the same 3 iterations in 1 process."""
    from src.train import train

    tmp = tmp_path_factory.mktemp("ddp")
    full = _train_cli(tmp, "full", *RUN, *DDP, f"trainer.max_epochs={ITERATIONS}")
    resumed = _train_cli(tmp, "resumed", *RUN, *DDP, f"trainer.max_epochs={ITERATIONS}",
                         f"ckpt_path={full}/checkpoints/iter_0000.ckpt")
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[*RUN, f"trainer.max_epochs={ITERATIONS}",
                                                      f"paths.output_dir={tmp}/single", f"paths.log_dir={tmp}/logs"])
    train(cfg)
    return {"full": full, "resumed": resumed, "single": tmp / "single"}


def test_ddp_ranks_run_disjoint_shards_and_share_one_memory(ddp_runs):
    full = ddp_runs["full"]
    log = (full / "train.log").read_text()  # both ranks' lines (the console shows warnings and marked lines)
    ckpt = _load(full / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == STEPS * ITERATIONS
    drawn = set()
    for it in range(ITERATIONS):
        picks = np.random.default_rng([SEED, it, 1]).choice(4, size=TASKS, replace=False)
        drawn |= {f"stub/{int(v)}" for v in picks}
        # each rank ran its own shard (task k of the draw on rank k mod 2): together the whole draw
        shards = {}
        for rank, tasks in re.findall(rf"iteration {it} \(\w+\): rank (\d) of 2 runs tasks (\[.*\])", log):
            shards[int(rank)] = [t["variation"] for t in json.loads(tasks)]
        assert shards == {0: [int(picks[0])], 1: [int(picks[1])]}, shards
    assert set(ckpt["callbacks"]["MemoryCallback"]["tips"]["partitions"]) == drawn  # both ranks' tips
    # every rank's generators are in the checkpoint (they differ: each rank seeds its own)
    rng = ckpt["RolloutDataModule"]["rng"]
    assert len(rng) == 2 and not torch.equal(rng[0]["torch"], rng[1]["torch"])


def test_ddp_logs_the_whole_batch_like_one_process(ddp_runs):
    """2 ranks and 1 process on the same episodes and samples log the same value for every key: train metrics
    reduced over ranks (partial sums summed, token means weighted, maxima maxed), rollout, memory and validation
    metrics over all ranks' episodes. Each episode draws its tokens from its own streams and the mini-batches are
    drawn over all ranks' samples, so both play the same episodes and take the same optimizer steps."""
    ddp, single = _metrics(ddp_runs["full"]), _metrics(ddp_runs["single"])
    keys = {k for k in ddp if k.split("/")[0] in ("train", "rollout", "val")}
    assert keys == {k for k in single if k.split("/")[0] in ("train", "rollout", "val")}
    for required in ("train/pg_loss", "train/entropy", "train/kl_loss", "train/ratio_max", "train/clip_frac",
                     "rollout/return", "rollout/intrinsic_return", "rollout/adv/adv_std", "rollout/memory/hit_rate",
                     "rollout/tip_action_frac", "val/score"):
        assert required in keys, required
    assert all(v > 0 for v in ddp["train/grad_norm"].values()) and len(ddp["train/grad_norm"]) == STEPS * ITERATIONS
    assert sum(ddp["rollout/adv/signal_samples"].values()) > 0
    # validation is logged at Lightning's batch counter, which counts this rank's micro-batches: compare in order
    points = {name: {k: ([v for _, v in sorted(run[k].items())] if k.startswith("val/") else sorted(run[k].items()))
                     for k in keys} for name, run in (("ddp", ddp), ("single", single))}
    differ = {k: (points["ddp"][k], points["single"][k]) for k in sorted(keys)
              if not _close(points["ddp"][k], points["single"][k])}
    assert differ == {}
    # The weights take the same steps up to float rounding (the gradient is summed in another order). AdamW's first
    # steps divide each gradient entry by its own magnitude, so an entry that is pure rounding noise (a sum that
    # cancels) moves by up to the learning rate either way: measured 0.06% of the entries; the difference stays
    # a few percent of how far training moved each tensor.
    a, b, start = (_load(ddp_runs[run] / "checkpoints" / name)["state_dict"]
                   for run, name in (("full", "last.ckpt"), ("single", "last.ckpt"), ("full", "iter_0000.ckpt")))
    for name in (k for k in a if k.startswith("policy.")):
        assert (a[name] - b[name]).norm() < 0.1 * (a[name] - start[name]).norm(), name


def _close(a: list, b: list) -> bool:
    flat = lambda points: [v for p in points for v in (p if isinstance(p, tuple) else (p,))]  # noqa: E731
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-6) for x, y in zip(flat(a), flat(b)))


def test_ddp_resume_is_exact_on_both_ranks(ddp_runs):
    """1 iteration + resume + 2 iterations == 3 uninterrupted, under DDP: weights, optimizer state, memory (tips
    and novelty counts; every save checks that both ranks hold the same), both ranks' generators and every
    metric logged after the resume point."""
    full, resumed = (_load(ddp_runs[k] / "checkpoints" / "last.ckpt") for k in ("full", "resumed"))
    assert resumed["global_step"] == full["global_step"] == STEPS * ITERATIONS
    first = _load(ddp_runs["full"] / "checkpoints" / "iter_0000.ckpt")
    moved = [k for k, v in full["state_dict"].items() if not torch.equal(v, first["state_dict"][k])]
    assert moved  # a real gradient: the weights moved after the resume point
    for name, value in full["state_dict"].items():
        assert torch.equal(resumed["state_dict"][name], value), name
    opt_full, opt_resumed = full["optimizer_states"][0], resumed["optimizer_states"][0]
    assert opt_full["param_groups"] == opt_resumed["param_groups"] and opt_full["state"]
    for i, state in opt_full["state"].items():
        for k, v in state.items():
            assert torch.equal(opt_resumed["state"][i][k], v), (i, k)
    assert _memory(resumed) == _memory(full)
    assert sum(c for _, counts in _memory(full)["novelty"].values() for c in counts) > 0
    for a, b in zip(full["RolloutDataModule"]["rng"], resumed["RolloutDataModule"]["rng"], strict=True):
        assert torch.equal(a["torch"], b["torch"]) and a["python"] == b["python"]
    got, want = _after_the_resume_point(ddp_runs["resumed"]), _after_the_resume_point(ddp_runs["full"])
    assert all(v > 1e-3 for _, v in want["train/grad_norm"])  # a real gradient at every step after the resume point
    assert len(got["val/score"]) == 2 and len(got["rollout/return"]) == 2 and len(got["train/pg_loss"]) == 4
    assert set(got) == set(want)
    assert [k for k in sorted(want) if got[k] != want[k]] == []


def _after_the_resume_point(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """The points of iterations 1 and 2: rollout metrics from step 1 (their step is the iteration), update metrics
    from step 3 (iteration 0's two updates are steps 1 and 2), the last two validations (after iterations 1 and 2)."""
    out = {}
    for key, points in _metrics(run_dir).items():
        points = sorted(points.items())
        if key.startswith("val/"):
            points = [v for _, v in points][-2:]
        elif key.startswith("train/"):
            points = [(s, v) for s, v in points if s >= 3]
        else:
            points = [(s, v) for s, v in points if s >= 1]
        if points:
            out[key] = points
    return out


@pytest.mark.slow  # ~90 s on 2 cores; DDP stays in CI (test_ddp_ranks_run_disjoint_shards_and_share_one_memory)
def test_fsdp2_two_cpu_processes_train_checkpoint_resume_and_evaluate(tmp_path):
    """trainer=fsdp (FSDP2 via ModelParallelStrategy) on CPU: sharded weights need every rank in every forward
    pass; with one validation task, rank 1 has nothing to run and must still join the generation steps. Weights
    loaded in bf16 and bf16-mixed as at paper scale: the sharded trainable parameters are fp32 master weights.
    Its checkpoint (a distributed-checkpoint directory) resumes under FSDP on another device count and under the
    default strategy, and src/eval.py gives it the score of the same weights saved as one file."""
    from src.evaluation.runner import run_eval
    from src.train import train

    common = ["experiment=scienceworld", "debug=default", "logger=csv", *STUB, "data.num_mini_batches=1",
              "trainer=fsdp", "trainer.accelerator=cpu", "trainer.precision=bf16-mixed", "model.policy.dtype=bfloat16",
              "data.tasks_per_iteration=2", "algorithm.memory_rollout_prob=1.0", "data.val.num_tasks=1",
              "~callbacks.rich_progress_bar", "trainer.enable_progress_bar=false"]
    first = _train_cli(tmp_path, "a", *common, "trainer.devices=2", "trainer.max_epochs=1")
    log = (first / "train.log").read_text()
    assert re.search(r"Precision: parameters: [\d.,]+M trainable float32; trainer.precision=bf16-mixed; FSDP2 "
                     r"compute torch.bfloat16, gradient reduction torch.float32", log)
    ckpt_dir = first / "checkpoints" / "last.ckpt"
    # one shard per rank plus Lightning's metadata (torch.distributed.checkpoint also writes a .metadata file)
    assert {"__0_0.distcp", "__1_0.distcp", "meta.pt"} <= {p.name for p in ckpt_dir.iterdir()}
    meta = _load(ckpt_dir / "meta.pt")
    n_tips = sum(len(p["entries"]) for p in meta["callbacks"]["MemoryCallback"]["tips"]["partitions"].values())
    assert n_tips > 0 and meta["global_step"] == 1

    # FSDP on one device resumes the 2-rank checkpoint (resharded)
    second = _train_cli(tmp_path, "b", *common, "trainer.devices=1", "trainer.max_epochs=2", f"ckpt_path={ckpt_dir}")
    meta = _load(second / "checkpoints" / "last.ckpt" / "meta.pt")
    assert meta["global_step"] == 2
    n_after = sum(len(p["entries"]) for p in meta["callbacks"]["MemoryCallback"]["tips"]["partitions"].values())
    assert n_after > n_tips  # restored entries plus the second iteration's

    # the default strategy (one process, single-file checkpoints) resumes it too, memory included
    single = [o for o in common if not o.startswith(("trainer=", "trainer.accelerator", "trainer.precision"))]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            *single, "trainer.precision=32-true", "trainer.max_epochs=2", "logger=none", f"ckpt_path={ckpt_dir}",
            f"paths.output_dir={tmp_path}/c", f"paths.log_dir={tmp_path}/logs"])
    objs = train(cfg)
    assert objs["trainer"].global_step == 2 and len(objs["memory"].tips) > n_tips

    # evaluation: the directory and the same weights as one file (torch's own converter) score the same
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt_dir, tmp_path / "converted.pt")
    as_file = {**_load(ckpt_dir / "meta.pt"), "state_dict": _load(tmp_path / "converted.pt")["state_dict"]}
    torch.save(as_file, tmp_path / "as_file.ckpt")
    summaries = []
    for name, path in (("dir", ckpt_dir), ("file", tmp_path / "as_file.ckpt")):
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
            cfg = compose(config_name="eval", overrides=[
                "experiment=scienceworld", "model=tiny", "model.warm_start=null", *STUB, "env.max_steps=3",
                "data.max_response_tokens=8", "memory.tip_max_tokens=8", "logger=none", f"ckpt_path={path}",
                "eval.num_tasks=2", "eval.episodes_per_task=2", "eval.memory=true", "trainer.precision=32-true",
                f"paths.output_dir={tmp_path}/eval-{name}", f"paths.log_dir={tmp_path}/logs"])
        summaries.append(run_eval(cfg))
    by_dir, by_file = summaries
    assert by_dir["memory_source"] == by_file["memory_source"] == "checkpoint"
    assert by_dir["weights_sha256"] == by_file["weights_sha256"]
    assert by_dir["score"] == by_file["score"] and by_dir["score"]["mean"] > 0
    assert by_dir["memory_size"] == by_file["memory_size"] == n_tips
