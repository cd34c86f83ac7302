"""``load_training_checkpoint`` reads both checkpoint layouts into the same dict (src/utils/checkpoint_loading.py):
a single file and a distributed-checkpoint directory written as Lightning's ModelParallelStrategy writes it
(tensors under ``state_dict`` / ``optimizer_0`` with the optimizer state keyed by parameter name, the rest in
``meta.pt``). The directory here is written in this process (no process group); tests/test_ddp.py evaluates and
resumes a real 2-rank FSDP2 checkpoint."""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from src.utils.checkpoint_io import AtomicCheckpointIO
from src.utils.checkpoint_loading import load_training_checkpoint, optimizer_state_by_index


def _checkpoint() -> tuple[dict, dict]:
    """(Lightning's single-file checkpoint dict of a small model after one AdamW step, the same optimizer state
    keyed by parameter name as FSDP saves it)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    state_dict = {f"policy.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    by_index = opt.state_dict()
    names = [f"policy.{k}" for k, _ in model.named_parameters()]
    by_name = {"state": {names[i]: v for i, v in by_index["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in by_index["param_groups"]]}
    meta = {"global_step": 7, "epoch": 3, "callbacks": {"MemoryCallback": {"tips": {"partitions": {}}}},
            "RolloutDataModule": {"rng": [], "no_signal_iterations": 1}}
    return {**meta, "state_dict": state_dict, "optimizer_states": [by_index]}, by_name


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_both_layouts_load_as_the_same_dict(tmp_path):
    ckpt, by_name = _checkpoint()
    torch.save(ckpt, tmp_path / "file.ckpt")
    directory = tmp_path / "dir.ckpt"
    dcp.save({"state_dict": ckpt["state_dict"], "optimizer_0": by_name}, checkpoint_id=directory, no_dist=True)
    torch.save({k: v for k, v in ckpt.items() if k not in ("state_dict", "optimizer_states")}, directory / "meta.pt")

    from_file, from_dir = load_training_checkpoint(tmp_path / "file.ckpt"), load_training_checkpoint(directory)
    assert _same(from_file, ckpt) and _same(from_dir, ckpt)
    assert _same(AtomicCheckpointIO().load_checkpoint(directory), ckpt)  # what a non-sharded strategy resumes from
    weights_only = load_training_checkpoint(directory, optimizer=False)
    assert "optimizer_states" not in weights_only and _same(weights_only["state_dict"], ckpt["state_dict"])
    assert _same(optimizer_state_by_index(by_name), ckpt["optimizer_states"][0])
    assert optimizer_state_by_index(ckpt["optimizer_states"][0]) is ckpt["optimizer_states"][0]


def test_what_is_not_a_checkpoint_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        load_training_checkpoint(tmp_path / "missing.ckpt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="without .metadata"):
        load_training_checkpoint(tmp_path / "empty")
    dcp.save({"state_dict": {"w": torch.zeros(2)}}, checkpoint_id=tmp_path / "bare", no_dist=True)
    with pytest.raises(FileNotFoundError, match="not Lightning's meta.pt"):
        load_training_checkpoint(tmp_path / "bare")
