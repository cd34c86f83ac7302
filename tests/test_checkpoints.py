"""What a training checkpoint holds (src/models/checkpoint_state.py), through a real Lightning Trainer on the tiny
policy: with LoRA only the adapters and their AdamW state, with the base model recorded; a resume from it is exact;
a resume onto another base model is refused; without LoRA every weight, as before."""
from __future__ import annotations

import copy
import re
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from src.models.empo2_module import EMPO2Module
from src.models.hub import build_tiny_model
from src.models.policy import build_policy
from test_module import ALGORITHM, _micro_batches, _samples

BASE_KEY = "policy_base"  # the checkpoint's record of the LoRA base model (src/models/checkpoint_state.py)
LORA = {"enabled": True, "r": 4, "alpha": 8, "target_modules": "all-linear"}


def _module(name_or_path: str, cache_dir, lora: dict | None) -> EMPO2Module:
    torch.manual_seed(0)
    return EMPO2Module(policy={"name_or_path": name_or_path, "cache_dir": str(cache_dir), "dtype": "float32",
                               "lora": lora},
                       algorithm=ALGORITHM, optimizer=partial(torch.optim.AdamW, lr=1e-2), gradient_clip_val=None)


def _fit(module: EMPO2Module, batches, epochs: int, root: Path, ckpt_path: str | None = None) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", max_epochs=epochs, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        default_root_dir=str(root))
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None), ckpt_path=ckpt_path)
    return trainer


def _adapters(module: EMPO2Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, model_cache_dir, tmp_path_factory) -> dict:
    """One epoch of LoRA training and its checkpoint; the samples and micro-batches to continue with."""
    tmp = tmp_path_factory.mktemp("lora_ckpt")
    module = _module(tiny_model_dir, model_cache_dir, LORA)
    batches = _micro_batches(_samples(module), 2)
    start = copy.deepcopy(module)
    trainer = _fit(module, batches, 1, tmp)
    trainer.save_checkpoint(tmp / "adapter.ckpt")
    return {"tmp": tmp, "start": start, "batches": batches, "path": tmp / "adapter.ckpt", "module": module,
            "ckpt": torch.load(tmp / "adapter.ckpt", map_location="cpu", weights_only=True)}


def test_a_lora_checkpoint_holds_the_adapters_and_names_the_base(lora_run, tiny_model_dir):
    ckpt, module = lora_run["ckpt"], lora_run["module"]
    trainable = {f"policy.{n}" for n, p in module.policy.named_parameters() if p.requires_grad}
    assert set(ckpt["state_dict"]) == trainable and all("lora_" in k for k in trainable)
    [opt] = ckpt["optimizer_states"]
    assert len(opt["state"]) == len(trainable)  # AdamW moments of the adapters only
    base = ckpt[BASE_KEY]
    assert base["name_or_path"] == tiny_model_dir and base["lora"] == LORA and base["dtype"] == "float32"
    frozen = sum(t.numel() for k, t in module.policy.state_dict().items() if f"policy.{k}" not in ckpt["state_dict"])
    assert base["num_elements"] == frozen and len(base["sha256"]) == 64  # (a tied weight counts under each name)
    # the whole policy would be (frozen + adapters) * 4 bytes; the file holds a small fraction of it
    assert lora_run["path"].stat().st_size < 0.2 * 4 * frozen


def test_resuming_from_an_adapter_checkpoint_is_exact(lora_run, tiny_model_dir, model_cache_dir, tmp_path):
    """1 epoch + save + resume for 1 more == 2 uninterrupted epochs: same adapters, same AdamW state."""
    straight = copy.deepcopy(lora_run["start"])
    straight_trainer = _fit(straight, lora_run["batches"], 2, tmp_path / "a")
    resumed = _module(tiny_model_dir, model_cache_dir, LORA)
    resumed_trainer = _fit(resumed, lora_run["batches"], 2, tmp_path / "b", ckpt_path=str(lora_run["path"]))
    a, b = _adapters(straight), _adapters(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    sa, sb = (t.optimizers[0].state_dict()["state"] for t in (straight_trainer, resumed_trainer))
    assert all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)


def test_resuming_onto_another_base_model_is_refused(lora_run, tiny_model_dir, model_cache_dir, tmp_path):
    other = build_tiny_model(tiny_model_dir, tmp_path / "tiny-seed1", seed=1)  # same shapes, other weights
    module = _module(str(other), model_cache_dir, LORA)
    with pytest.raises(ValueError, match=rf"trained on the base model '{re.escape(tiny_model_dir)}'.*other weights"):
        _fit(module, lora_run["batches"], 2, tmp_path, ckpt_path=str(lora_run["path"]))
    wider = _module(tiny_model_dir, model_cache_dir, {**LORA, "r": 8})  # adapters of another shape
    with pytest.raises(ValueError, match=r"has shape \(\d+, \d+\), the policy's .*: it was trained with \(LoRA"):
        _fit(wider, lora_run["batches"], 2, tmp_path, ckpt_path=str(lora_run["path"]))


def test_evaluation_loads_the_adapters_onto_the_recorded_base(lora_run, tiny_model_dir, model_cache_dir):
    from src.models.checkpoint_state import load_policy_weights

    policy = build_policy(name_or_path=tiny_model_dir, cache_dir=str(model_cache_dir), dtype="float32", lora=LORA)
    load_policy_weights(policy, lora_run["ckpt"], "adapter.ckpt")
    trained = lora_run["module"].policy
    assert all(torch.equal(p, dict(trained.named_parameters())[n]) for n, p in policy.named_parameters())
    other = build_policy(name_or_path=str(build_tiny_model(tiny_model_dir, lora_run["tmp"] / "tiny-seed2", seed=2)),
                         cache_dir=str(model_cache_dir), dtype="float32", lora=LORA)
    with pytest.raises(ValueError, match="checkpoint 'adapter.ckpt': the checkpoint's LoRA adapters were trained on"):
        load_policy_weights(other, lora_run["ckpt"], "adapter.ckpt")


def test_without_lora_a_checkpoint_holds_every_weight(tiny_model_dir, model_cache_dir, tmp_path):
    module = _module(tiny_model_dir, model_cache_dir, None)
    trainer = _fit(module, _micro_batches(_samples(module), 4), 1, tmp_path)
    trainer.save_checkpoint(tmp_path / "full.ckpt")
    ckpt = torch.load(tmp_path / "full.ckpt", map_location="cpu", weights_only=True)
    assert BASE_KEY not in ckpt
    assert set(ckpt["state_dict"]) == {f"policy.{k}" for k in module.policy.state_dict()}
