"""The start-up memory check (src/models/memory_estimate.py) on a Qwen2.5-7B-shaped config.json written here (no
weights, nothing downloaded): 8 devices of 80 GiB refuse full fine-tuning under DDP and accept the paper default."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import torch

from src.models.memory_estimate import (GIB, ParamCounts, check_device_memory, count_parameters, device_memory_bytes,
                                       estimate_per_device)

ROOT = Path(__file__).resolve().parents[1]
# Qwen/Qwen2.5-7B-Instruct's config.json (the fields that shape the parameters)
QWEN25_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
             "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
             "vocab_size": 152064, "tie_word_embeddings": False, "hidden_act": "silu", "rms_norm_eps": 1e-6,
             "max_position_embeddings": 32768, "rope_theta": 1000000.0, "bos_token_id": 151643,
             "eos_token_id": 151645, "torch_dtype": "bfloat16", "use_sliding_window": False}
# by hand: per layer q,o 3584^2 (+3584 bias on q), k,v 3584*512 (+512 bias), MLP 3*3584*18944, 2 norms 3584;
# embeddings and LM head 152064*3584 each, final norm 3584
LAYER = 2 * 3584**2 + 3584 + 2 * (3584 * 512 + 512) + 3 * 3584 * 18944 + 2 * 3584
QWEN25_7B_PARAMS = 28 * LAYER + 2 * 152064 * 3584 + 3584


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen2.5-7b")
    (path / "config.json").write_text(json.dumps(QWEN25_7B))
    return path


def _paper_cfg(qwen_dir: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="train", overrides=["experiment=webshop_paper",
                                                       f"model.policy.name_or_path={qwen_dir}",
                                                       "memory_check.device_memory_gib=80", *overrides])


def test_parameter_count_from_config_alone(qwen_dir):
    counts = count_parameters(str(qwen_dir))
    assert counts.total == QWEN25_7B_PARAMS == 7_615_616_512
    assert counts.adapters == 0
    assert counts.gathered == 2 * 152064 * 3584 + 3584 + 2 * LAYER


def test_full_fine_tuning_under_ddp_is_refused_with_the_fix(qwen_dir):
    with pytest.raises(ValueError) as err:
        check_device_memory(_paper_cfg(qwen_dir, "trainer=ddp"))
    msg = str(err.value)
    # 4 (fp32 weights) + 4 (grads) + 8 (AdamW) + 4 (DDP buckets) bytes per parameter + bf16 reference (2 bytes)
    assert f"~{QWEN25_7B_PARAMS * 22 / GIB:.1f} GiB per device" in msg
    assert "full fine-tuning" in msg and "8 device(s)" in msg and "80.0 GiB" in msg
    assert "Use trainer=fsdp (~" in msg and "model.policy.lora.enabled=true (~" in msg


def test_paper_default_and_lora_under_ddp_fit_on_8x80(qwen_dir):
    default = check_device_memory(_paper_cfg(qwen_dir))  # FSDP2, full fine-tuning, KL reference
    assert sum(default.values()) < 0.9 * 80 * GIB
    # sharded fp32 master weights, grads and AdamW: 16 bytes per parameter over 8 devices
    assert sum(default[k] for k in ("trainable weights", "gradients", "AdamW states")) == QWEN25_7B_PARAMS * 16 / 8
    lora = check_device_memory(_paper_cfg(qwen_dir, "trainer=ddp", "model.policy.lora.enabled=true"))
    assert lora["frozen base"] == QWEN25_7B_PARAMS * 2  # bf16, replicated
    assert sum(lora.values()) < 0.9 * 80 * GIB
    assert check_device_memory(_paper_cfg(qwen_dir, "memory_check.enabled=false")) is None


def test_estimate_known_answer():
    counts = ParamCounts(total=1000, adapters=0, gathered=100)
    parts = estimate_per_device(counts, world=4, sharded=True, reference=True, weight_bytes=2)
    assert parts == {"trainable weights": 1000.0, "gradients": 1000.0, "AdamW states": 2000.0,
                     "frozen reference": 500.0, "FSDP gathered params+grads": 400}
    # with LoRA the KL reference is normally the base with the adapters off (no copy) ...
    lora = estimate_per_device(ParamCounts(1000, 10, 100), world=2, sharded=False, reference=False, weight_bytes=2)
    assert lora == {"trainable weights": 40, "gradients": 40, "AdamW states": 80, "frozen base": 2000,
                    "DDP gradient buckets": 40}
    # ... and a frozen copy when LoRA continues an adapter loaded as the policy
    adapter = estimate_per_device(ParamCounts(1000, 10, 100), world=2, sharded=False, reference=True, weight_bytes=2)
    assert adapter == {**lora, "frozen reference": 2000}
    # bf16 decoding steps copy what is not bf16: fp32 master weights, fp32 adapters over a bf16 base (shared)
    full = estimate_per_device(ParamCounts(1000, 0, 100), world=1, sharded=False, reference=False, weight_bytes=2,
                               inference_copy=True)
    assert full["bf16 inference copy"] == 2000
    adapters = estimate_per_device(ParamCounts(1000, 10, 100), world=1, sharded=False, reference=False,
                                   weight_bytes=2, inference_copy=True)
    assert adapters["bf16 inference copy"] == 20
    fp32_base = estimate_per_device(ParamCounts(1000, 10, 100), world=1, sharded=False, reference=False,
                                    weight_bytes=4, inference_copy=True)
    assert fp32_base["bf16 inference copy"] == 2020


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the real device memory is read")
def test_device_memory_comes_from_the_config_without_a_gpu():
    assert device_memory_bytes("gpu", 80) == (80 * GIB, "memory_check.device_memory_gib")


def test_a_hub_id_that_is_not_in_the_local_cache_is_named_with_what_to_do(monkeypatch):
    """Offline, the paper experiment's start-up memory check reads the model's config from the hub: the error names
    the model id, says it is not in the local cache and how to point model.policy.name_or_path at a directory
    (instead of transformers' generic "We couldn't connect to 'https://huggingface.co'")."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1 at start-up
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["experiment=webshop_paper",
                                                      "model.policy.name_or_path=made-up-org/no-such-model-7b"])
    with pytest.raises(OSError) as err:
        check_device_memory(cfg)
    msg = str(err.value)
    assert "'made-up-org/no-such-model-7b'" in msg and "not in the local Hugging Face cache" in msg
    assert "model.policy.name_or_path=/path/to/" in msg
    with pytest.raises(OSError, match=r"name_or_path='/no/such/model/dir': no such directory"):
        count_parameters("/no/such/model/dir")
