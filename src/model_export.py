"""Take a trained agent out of a run: a Hugging Face directory (model, tokenizer, generation config, model card,
``export_info.json``) and its memory, written atomically (docs/export.md lists the files).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

INFO_FILE = "export_info.json"
MEMORY_DIR = "memory"


def generation_config_dict(temperature: float, eos_token_ids: list[int], pad_token_id: int,
                           max_new_tokens: int) -> dict[str, Any]:
    """The exported ``generation_config.json``: sampling from exactly ``softmax(logits / temperature)``, every
    setting that could change the distribution spelled out (unset fields would be filled with transformers'
    defaults, e.g. top_k 50), and the run's cap on response tokens."""
    return {"do_sample": True, "temperature": float(temperature), "top_k": 0, "top_p": 1.0, "min_p": None,
            "typical_p": 1.0, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
            "max_new_tokens": int(max_new_tokens), "eos_token_id": list(eos_token_ids),
            "pad_token_id": int(pad_token_id)}


def run_export(cfg: DictConfig) -> dict[str, Any]:
    """Export ``cfg.ckpt_path`` to ``cfg.export.out_dir``; returns what ``export_info.json`` holds.

    Raises:
        ValueError: no ``ckpt_path`` or ``export.out_dir``, an ``out_dir`` ``check_out_dir`` refuses,
            ``export.adapter_only`` for a checkpoint without LoRA, a bad ``export.dtype``, or a checkpoint that does
            not fit the model (see ``load_policy_weights``).
        FileNotFoundError: no checkpoint at ``ckpt_path``.
    """
    from src.models.checkpoint_state import load_policy_weights, rebuild_policy_config
    from src.models.policy import build_policy
    from src.utils.checkpoint_loading import read_checkpoint
    from src.utils.config_error import refused_settings
    from src.utils.io import atomic_dir
    from src.utils.startup_checks import check_checkpoint_path

    ex = cfg.export
    with refused_settings():  # one line, before anything is built
        if not cfg.get("ckpt_path") or not ex.get("out_dir"):
            raise ValueError(f"ckpt_path={cfg.get('ckpt_path')!r}, export.out_dir={ex.get('out_dir')!r}: both are "
                             "needed, e.g. ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt export.out_dir=agent")
        out_dir = Path(hydra.utils.to_absolute_path(str(ex.out_dir)))
        check_out_dir(out_dir, str(ex.out_dir), bool(ex.overwrite))
        check_checkpoint_path(cfg)  # complete, intact and finite
    ckpt = read_checkpoint(cfg.ckpt_path)
    policy_cfg = rebuild_policy_config(ckpt, OmegaConf.to_container(cfg.model.policy, resolve=True))
    policy = build_policy(**{**policy_cfg, "gradient_checkpointing": False})
    load_policy_weights(policy, ckpt, str(cfg.ckpt_path), policy_cfg["name_or_path"])
    temperature = float(_trained(ckpt, "algorithm", "temperature", float(cfg.algorithm.temperature)))
    max_new_tokens = int(_trained(ckpt, "policy", "max_response_tokens", policy.max_response_tokens))
    info = {**_info(cfg, ckpt, policy_cfg, temperature), "max_response_tokens": max_new_tokens}
    with atomic_dir(out_dir, replace=bool(ex.overwrite)) as tmp:
        info["weights"] = _write_model(policy, tmp, bool(ex.adapter_only), ex.get("dtype"))
        policy.tokenizer.save_pretrained(tmp)
        gen = generation_config_dict(temperature, policy.eos_token_ids, policy.tokenizer.pad_token_id, max_new_tokens)
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=1) + "\n")
        info["memory"] = _write_memory(cfg, ckpt, tmp) if ex.memory else None
        info["files"] = sorted([p.name for p in tmp.iterdir()] + [INFO_FILE, "README.md"])  # what an overwrite may delete
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=1, default=str) + "\n")
        (tmp / "README.md").write_text(model_card(info, *_run_config(cfg)))
    log.info("Exported %s to %s (%s weights%s)", cfg.ckpt_path, out_dir, info["weights"]["kind"],
             f", {info['memory']['num_entries']} memory entries" if info["memory"] else "")
    print(f"Exported the agent to {out_dir}", flush=True)
    return info


def check_out_dir(out_dir: Path, given: str, overwrite: bool) -> None:
    """Refuse an ``export.out_dir`` whose replacement would delete what no export wrote: a file, a non-empty directory
    without ``export_info.json`` (a run's ``checkpoints/``, a user's folder), or an earlier export holding files
    besides those its ``export_info.json`` lists; an earlier export is replaced only with ``export.overwrite=true``.

    Raises:
        ValueError: naming ``export.out_dir`` and what it holds.
    """
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    name = f"export.out_dir={given!r}"
    if not out_dir.is_dir() or out_dir.is_symlink():
        raise ValueError(f"{name} is a file, not a directory: an export never replaces it; choose another out_dir")
    entries = sorted(p.name for p in out_dir.iterdir())
    if not entries:
        return
    info = out_dir / INFO_FILE
    if not info.is_file():
        raise ValueError(f"{name} holds {len(entries)} entries no export wrote (e.g. {', '.join(entries[:3])}; no "
                         f"{INFO_FILE}): an export never deletes them, with export.overwrite or not; choose a new or "
                         "empty directory")
    written = json.loads(info.read_text()).get("files")
    others = [e for e in entries if written is not None and e not in written]
    if others:
        raise ValueError(f"{name} is an earlier export holding files it did not write ({', '.join(others[:3])}): an "
                         "export never deletes them; move them out or choose another out_dir")
    if not overwrite:
        raise ValueError(f"{name} exists; choose another or set export.overwrite=true")


def _trained(ckpt: dict[str, Any], group: str, key: str, configured: Any) -> Any:
    """A setting as the checkpoint was trained with it (its hyper-parameters ``group.key``: the rollout temperature,
    the response cap), else the configured one; the checkpoint's wins, with a warning when they differ."""
    trained = ((ckpt.get("hyper_parameters") or {}).get(group) or {}).get(key)
    if trained is None:
        return configured
    if trained != configured:
        log.warning("The checkpoint was trained with %s.%s=%s, the config says %s: the export uses the checkpoint's",
                    group, key, trained, configured)
    return trained


def _write_model(policy, out: Path, adapter_only: bool, dtype: str | None) -> dict[str, Any]:
    """Save the model (merged, or the adapter alone) into ``out``; returns ``{"kind", "dtype"}`` (and, for a merged
    LoRA saved below float32, ``update_kept``). LoRA is merged in float32, so with ``dtype`` null the export holds
    exactly what training changed; a lower ``dtype`` rounds small updates away (docs/export.md#what-the-export-keeps).
    """
    from src.models.precision import torch_dtype

    model = policy.model
    is_peft = hasattr(model, "merge_and_unload")
    if adapter_only and not is_peft:
        raise ValueError("export.adapter_only=true needs a LoRA checkpoint (model.policy.lora.enabled=true); this "
                         "one holds full weights: export it without export.adapter_only")
    target = torch_dtype(dtype) if dtype else None
    if adapter_only:
        if target is not None:
            model = model.to(target)
        model.save_pretrained(out)
        adapter = next(p for n, p in model.named_parameters() if "lora_" in n)
        return {"kind": "lora_adapter", "dtype": str(adapter.dtype).replace("torch.", ""),
                "base_model": model.peft_config["default"].base_model_name_or_path}
    info: dict[str, Any] = {"kind": "merged" if is_peft else "full"}
    if is_peft:
        rounded = target is not None and torch.finfo(target).eps > torch.finfo(torch.float32).eps
        # the base weights under the adapters, to measure what rounding the merged ones keeps
        base = {n.replace(".base_layer", ""): w.detach().clone()
                for n, w in model.get_base_model().state_dict().items() if ".base_layer." in n} if rounded else {}
        model = model.to(torch.float32).merge_and_unload()
        if rounded:
            info["update_kept"] = rounding_kept_fraction(base, model.state_dict(), target)
    trained = model.dtype
    if target is not None and target != model.dtype:
        model = model.to(target)
        if torch.finfo(target).eps > torch.finfo(trained).eps:
            kept = info.get("update_kept")
            log.warning("export.dtype=%s rounds the trained %s weights: update entries below half a %s ulp of "
                        "their weight vanish (%s). Leave export.dtype unset to keep the training exactly, or use "
                        "export.adapter_only=true for a LoRA run (docs/export.md)", dtype,
                        str(trained).replace("torch.", ""), dtype,
                        f"{100 * kept:.1f}% of the LoRA update's norm survives" if kept is not None
                        else "at lr 1e-6 most of them")
    model.save_pretrained(out)
    info["dtype"] = str(model.dtype).replace("torch.", "")
    return info


def rounding_kept_fraction(base: dict[str, torch.Tensor], trained: dict[str, torch.Tensor],
                           dtype: torch.dtype) -> float:
    """The share of a weight update that survives rounding the trained weights to ``dtype``:
    ``1 − ‖round(W') − W'‖ / ‖W' − W‖`` over the weights of ``base`` (W) that training changed (W', float32);
    1.0 when nothing changed. Units: a fraction of the update's Frobenius norm in [0, 1]."""
    err = change = 0.0
    for name, w in base.items():
        if name not in trained:
            continue
        new = trained[name].float()
        delta = new - w.float()
        if not bool(delta.any()):
            continue
        err += float((new.to(dtype).float() - new).pow(2).sum())
        change += float(delta.pow(2).sum())
    return 1.0 if change == 0 else max(0.0, 1.0 - (err / change) ** 0.5)


def _write_memory(cfg: DictConfig, ckpt: dict[str, Any], out: Path) -> dict[str, Any] | None:
    from src.memory.memory_file import write_memory_files

    state = ((ckpt.get("callbacks") or {}).get("MemoryCallback") or {}).get("tips")
    if state is None:
        return None
    partition = str(cfg.memory.partition)
    write_memory_files(state, out / MEMORY_DIR, partition)
    return json.loads((out / MEMORY_DIR / "memory.json").read_text())


def _info(cfg: DictConfig, ckpt: dict[str, Any], policy_cfg: dict[str, Any], temperature: float) -> dict[str, Any]:
    """The facts of the export (``export_info.json``; the model card is written from them)."""
    algorithm = (ckpt.get("hyper_parameters") or {}).get("algorithm") or {}
    iteration = ckpt.get("iteration")  # the last iteration trained (EMPO2Module.on_save_checkpoint)
    return {"ckpt_path": str(cfg.ckpt_path), "iteration": iteration,
            "iterations_trained": None if iteration is None else iteration + 1,
            "global_step": ckpt.get("global_step"), "validation": ckpt.get("validation"),
            "algorithm": algorithm.get("name", cfg.algorithm.get("name")),
            "env": cfg.env.get("_target_"), "task": cfg.env.get("task"), "base_model": policy_cfg["name_or_path"],
            "lora": bool(policy_cfg["lora"]["enabled"]), "rollout_temperature": temperature,
            "adapter_only_checkpoint": "policy_base" in ckpt}


def _run_config(cfg: DictConfig) -> tuple[str, str]:
    """(the run's config as YAML, where it comes from): the run directory's ``.hydra/config.yaml``, else the config
    composed for the export."""
    ckpt = Path(hydra.utils.to_absolute_path(str(cfg.ckpt_path)))
    saved = ckpt.parent.parent / ".hydra" / "config.yaml"
    if saved.is_file():
        return saved.read_text(), str(saved)
    composed = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k not in ("export", "eval")}
    return OmegaConf.to_yaml(OmegaConf.create(composed)), "the config composed for the export (no .hydra/config.yaml)"


def model_card(info: dict[str, Any], run_config: str, config_source: str) -> str:
    """The exported directory's ``README.md`` (a Hugging Face model card) from ``export_info.json``'s facts."""
    weights = info["weights"]
    adapter = weights["kind"] == "lora_adapter"
    base = str(info["base_model"])
    hub_base = not base.startswith(("/", ".", "~", "embedded:")) and base.count("/") == 1
    front = ["---", f"library_name: {'peft' if adapter else 'transformers'}"]
    front += [f"base_model: {base}"] if hub_base else []
    front += ["tags: [empo2, reinforcement-learning, llm-agent]", "---", ""]
    validation = info.get("validation") or {}
    metrics = sorted((k, v) for k, v in (validation.get("metrics") or {}).items() if not k.endswith("_s"))  # no timings
    scores = ", ".join(f"{k} = {v:.4g}" for k, v in metrics) or "none"
    val_at = "" if validation.get("iteration") is None else f" (after iteration {validation['iteration']})"
    memory = info.get("memory")
    lines = front + [
        f"# {info['algorithm']} agent for {info['task'] or info['env']}", "",
        f"Trained with `src/train.py` of the empo2 code base (algorithm `{info['algorithm']}`; EMPO²: arXiv "
        f"2602.23008) on `{info['env']}` (task `{info['task']}`), from the base model `{base}`"
        f"{' with LoRA' if info['lora'] else ''}; exported by `src/export.py` from `{info['ckpt_path']}`.", "",
        "| | |", "|---|---|",
        f"| iterations trained | {info['iterations_trained']} (last iteration {info['iteration']}) |",
        f"| optimizer steps (global step) | {info['global_step']} |",
        f"| validation{val_at} | {scores} |",
        f"| weights | {weights['kind']} ({weights['dtype']}) |",
        f"| rollout temperature | {info['rollout_temperature']} |",
        f"| memory | {memory['num_entries'] if memory else 'none'}"
        f"{' tips, embedder ' + memory['embedder_name'] + ', partition ' + memory['partition'] if memory else ''} |",
        "", "## Sampling", "",
        f"`generation_config.json` samples from exactly softmax(logits / {info['rollout_temperature']}) over the full "
        "vocabulary (no top-k, top-p or repetition penalty): the distribution the agent was trained with. "
        f"Responses are capped at {info['max_response_tokens']} new tokens, as in training.", "",
        "## Use", "", "```python",
        *(["from peft import AutoPeftModelForCausalLM", "model = AutoPeftModelForCausalLM.from_pretrained(path)"]
          if adapter else ["from transformers import AutoModelForCausalLM",
                           "model = AutoModelForCausalLM.from_pretrained(path)"]),
        "```", "",
        "Evaluate it with empo2 (`model.policy.name_or_path` takes this directory"
        + (", the adapter's base model must be where `adapter_config.json` says" if adapter else "") + "):", "",
        "```bash",
        "python src/eval.py experiment=<experiment> ckpt_path=null model.warm_start=null "
        "model.policy.name_or_path=<dir>" + (" eval.memory_file=<dir>/memory" if memory else ""),
        "```", "", "## Training config", "", f"From {config_source}:", "", "```yaml", run_config.rstrip(), "```", ""]
    return "\n".join(lines)
