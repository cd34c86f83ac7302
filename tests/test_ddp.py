"""DDP on CPU (2 processes, gloo) through the real CLI: every rank runs its shard of the tasks, and the memory
saved in the checkpoint holds the tips written on both ranks."""
from __future__ import annotations

import json
import re

import numpy as np
import torch
from cli_report import failure_report, run_cli


def test_ddp_two_cpu_processes_share_memory(tmp_path):
    seed, iterations, tasks_per_iteration = 8, 2, 2
    cmd = ["src/train.py", "experiment=scienceworld", "debug=default", "data.num_mini_batches=1",
           "trainer.strategy=ddp",
           "trainer.devices=2", f"trainer.max_epochs={iterations}", f"data.tasks_per_iteration={tasks_per_iteration}",
           "algorithm.memory_rollout_prob=1.0", f"seed={seed}", "~callbacks.rich_progress_bar",
           "trainer.enable_progress_bar=false", f"paths.log_dir={tmp_path}/logs", f"hydra.run.dir={tmp_path}/run"]
    proc = run_cli(cmd)
    assert proc.returncode == 0, failure_report(proc)
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == iterations
    partitions = set(ckpt["callbacks"]["MemoryCallback"]["tips"]["partitions"])
    # the variations drawn over both ranks (RolloutDataModule.draw_tasks: 5 train variations, then rank::2)
    drawn = set()
    for it in range(iterations):
        picks = np.random.default_rng([seed, it, 1]).choice(5, size=tasks_per_iteration, replace=False)
        drawn |= {f"find-non-living-thing/{int(v)}" for v in picks}
        # each rank ran its own shard: disjoint, together the whole draw (each rank logs its tasks)
        shards = {}
        for rank, tasks in re.findall(rf"iteration {it} \(\w+\): rank (\d) of 2 runs tasks (\[.*\])", proc.stdout):
            shards[int(rank)] = [t["variation"] for t in json.loads(tasks)]
        assert set(shards) == {0, 1} and not set(shards[0]) & set(shards[1]), shards
        assert sorted(shards[0] + shards[1]) == sorted(int(v) for v in picks)
    assert partitions == drawn


def test_fsdp2_two_cpu_processes_train_checkpoint_and_resume(tmp_path):
    """trainer=fsdp (FSDP2 via ModelParallelStrategy) on CPU: sharded weights need every rank in every forward
    pass; with one validation task, rank 1 has nothing to run and must still join the generation steps. Weights
    loaded in bf16 and bf16-mixed as at paper scale: the sharded trainable parameters are fp32 master weights."""
    common = ["experiment=scienceworld", "debug=default", "data.num_mini_batches=1", "trainer=fsdp", "trainer.accelerator=cpu",
              "trainer.devices=2", "trainer.precision=bf16-mixed", "model.policy.dtype=bfloat16",
              "data.tasks_per_iteration=2",
              "algorithm.memory_rollout_prob=1.0", "data.val.num_tasks=1", "~callbacks.rich_progress_bar",
              "trainer.enable_progress_bar=false", f"paths.log_dir={tmp_path}/logs"]
    first = ["src/train.py", *common, "trainer.max_epochs=1", f"hydra.run.dir={tmp_path}/a"]
    proc = run_cli(first)
    assert proc.returncode == 0, failure_report(proc)
    log = (tmp_path / "a" / "train.log").read_text()
    assert re.search(r"Precision: parameters: [\d.,]+M trainable float32; trainer.precision=bf16-mixed; FSDP2 "
                     r"compute torch.bfloat16, gradient reduction torch.float32", log)
    ckpt_dir = tmp_path / "a" / "checkpoints" / "last.ckpt"
    # one shard per rank plus Lightning's metadata (torch.distributed.checkpoint also writes a .metadata file)
    assert {"__0_0.distcp", "__1_0.distcp", "meta.pt"} <= {p.name for p in ckpt_dir.iterdir()}
    meta = torch.load(ckpt_dir / "meta.pt", map_location="cpu", weights_only=False)
    n_tips = sum(len(p["entries"]) for p in meta["callbacks"]["MemoryCallback"]["tips"]["partitions"].values())
    assert n_tips > 0 and meta["global_step"] == 1
    resumed = ["src/train.py", *common, "trainer.max_epochs=2", f"ckpt_path={ckpt_dir}",
               f"hydra.run.dir={tmp_path}/b"]
    proc = run_cli(resumed)
    assert proc.returncode == 0, failure_report(proc)
    meta = torch.load(tmp_path / "b" / "checkpoints" / "last.ckpt" / "meta.pt", map_location="cpu",
                      weights_only=False)
    assert meta["global_step"] == 2
    n_after = sum(len(p["entries"]) for p in meta["callbacks"]["MemoryCallback"]["tips"]["partitions"].values())
    assert n_after > n_tips  # restored entries plus the second iteration's
