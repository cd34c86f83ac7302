"""A training checkpoint of either layout as one dict: the one loader evaluation, resuming under another strategy and
any export use (docs/usage.md#checkpoints-and-resuming).

``src/train.py`` writes one file (``torch.save`` of Lightning's checkpoint dict) or, with ``trainer=fsdp``, a
directory: the weights and optimizer state as a ``torch.distributed.checkpoint`` (keys ``state_dict``,
``optimizer_0``), everything else in ``meta.pt``. The directory is read in one process, whatever its shard count.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

META_FILE = "meta.pt"  # Lightning's name for the non-tensor part of a distributed checkpoint
DCP_METADATA = ".metadata"


def is_distributed_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a distributed-checkpoint directory (it holds ``.metadata``)."""
    path = Path(path)
    return path.is_dir() and (path / DCP_METADATA).is_file()


def checkpoint_head(path: Path) -> dict[str, Any]:
    """A checkpoint's dict without reading its tensors: a ``.ckpt`` file memory-mapped, or a ``trainer=fsdp``
    directory's ``meta.pt`` (global step, iteration, run config, callbacks)."""
    path = Path(path)
    if path.is_dir():
        return torch.load(path / META_FILE, map_location="cpu", weights_only=True)
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)


def load_training_checkpoint(path: str | os.PathLike, optimizer: bool = True) -> dict[str, Any]:
    """A checkpoint of ``src/train.py``, file or distributed-checkpoint directory, as the single file's dict: full
    tensors on the CPU, the optimizer state keyed by parameter index as ``torch.optim`` writes it.

    Args:
        optimizer: also read the optimizer state (``optimizer_states``); evaluation and exports need only the
            weights, and the AdamW moments are twice their size.

    Returns:
        ``{"state_dict": {name: tensor}, "optimizer_states": [...], "global_step", "epoch", "callbacks" (with
        ``MemoryCallback``: the tips and novelty store), "loops", "hyper_parameters", "RolloutDataModule", ...}``.

    Raises:
        FileNotFoundError: nothing at ``path``, or a directory that is not a distributed checkpoint (naming what
            it lacks).
    """
    path = Path(path)
    if path.is_file():
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        if not optimizer:
            ckpt.pop("optimizer_states", None)
        return ckpt
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint file or directory")
    if not is_distributed_checkpoint(path):
        raise FileNotFoundError(f"{path} is a directory without {DCP_METADATA}: not a distributed checkpoint")
    if not (path / META_FILE).is_file():
        raise FileNotFoundError(f"{path} holds a distributed checkpoint but not Lightning's {META_FILE} (global step, "
                                "callbacks, memory): not a checkpoint written by src/train.py")
    ckpt = torch.load(path / META_FILE, map_location="cpu", weights_only=True)
    tensors = _read_distributed(path, keys=None if optimizer else {"state_dict"})
    ckpt["state_dict"] = tensors.pop("state_dict")
    optimizers = sorted((k for k in tensors if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    if optimizers:
        ckpt["optimizer_states"] = [optimizer_state_by_index(tensors[k]) for k in optimizers]
    return ckpt


def verify_checkpoint_file(path: Path, state_dict: dict[str, Any], name: str) -> None:
    """Refuse a checkpoint file whose bytes changed after ``torch.save`` wrote them (every record against the CRC-32
    the zip archive stores: a disk or copy error, noise written into it) or whose ``policy.*`` weights hold NaN or
    inf. ``state_dict``: the file's, memory-mapped. Reads the whole file once (about 1 s per GB).

    Raises:
        ValueError: naming ``name`` (the setting and path) and the first bad record or weight.
    """
    import zipfile

    with zipfile.ZipFile(path) as archive:
        bad = archive.testzip()
    if bad is not None:
        raise ValueError(f"{name} is corrupt: its record {bad} differs from what torch.save wrote (CRC-32 mismatch: "
                         "the file changed on disk or in a copy). Use an earlier checkpoint of the run (iter_*.ckpt "
                         "beside it).")
    broken = [k for k, t in state_dict.items() if k.startswith("policy.") and torch.is_tensor(t)
              and t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if broken:
        raise ValueError(f"{name} holds NaN or inf in {len(broken)} policy weights (e.g. {broken[0]}): the run "
                         "diverged before this save. Use an earlier checkpoint of the run (iter_*.ckpt beside it), "
                         "e.g. with a lower model.optimizer.lr.")


def _read_distributed(path: Path, keys: set[str] | None) -> dict[str, Any]:
    """The distributed checkpoint's tensors (only the top-level ``keys``, or all), unsharded, in this process."""
    from torch.distributed.checkpoint import FileSystemReader
    # what torch's own converter (format_utils.dcp_to_torch_save) does: the planner rebuilds the dict from the
    # saved metadata (the public dcp.load only fills the keys of a dict it is given)
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(keys=keys),
                     no_dist=True)
    return state


def optimizer_state_by_index(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (``torch.distributed.checkpoint.state_dict``, as FSDP saves it)
    keyed by parameter index in ``param_groups`` order instead (as ``torch.optim.Optimizer.state_dict`` writes it,
    and a non-sharded strategy loads it). A state already keyed by index is returned unchanged."""
    groups = state.get("param_groups", [])
    names = [p for g in groups for p in g["params"]]
    if not names or not isinstance(names[0], str):
        return state
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[name]: v for name, v in state.get("state", {}).items()},
            "param_groups": [{**g, "params": [index[p] for p in g["params"]]} for g in groups]}


def read_checkpoint(ckpt_path: str) -> dict[str, Any]:
    """``load_training_checkpoint`` of ``ckpt_path`` (relative to the launch directory), without the optimizer
    state: the one place that reads a checkpoint for evaluation and export.

    Raises:
        FileNotFoundError: nothing at ``ckpt_path``, or a directory that is not a checkpoint.
    """
    import hydra

    path = Path(hydra.utils.to_absolute_path(str(ckpt_path)))
    if not path.exists():
        raise FileNotFoundError(f"ckpt_path={ckpt_path!r}: no such checkpoint file or directory")
    return load_training_checkpoint(path, optimizer=False)
