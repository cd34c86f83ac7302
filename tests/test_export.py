"""src/export.py (src/model_export.py) on one-iteration ScienceWorld runs of the tiny policy, with and without LoRA:
the exported Hugging Face directory reloads with ``from_pretrained`` and gives the checkpoint's log-probs (fp32,
1e-5), its generation config samples from softmax(logits / T), the model card names the run, and the exported
memory retrieves the same tips as the checkpoint's, also through src/eval.py without the checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from src.evaluation.runner import run_eval
from src.memory.memory_file import read_memory_files
from src.memory.tip_memory import TipMemory
from src.model_export import run_export
from src.models.policy import Policy, build_policy
from src.train import train

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model=tiny", "model.warm_start=null", "env.max_steps=3", "data.max_response_tokens=6",
         "memory.tip_max_tokens=8", "logger=none"]


def _compose(config: str, tmp_path: Path, *overrides: str):
    extra = ["~callbacks.rich_progress_bar", "trainer.enable_progress_bar=false"] if config == "train" else []
    base = [f"paths.output_dir={tmp_path}/out", f"paths.log_dir={tmp_path}/logs", *SMALL, *extra]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name=config, overrides=base + list(overrides))


@pytest.fixture(scope="module", params=[True, False], ids=["lora", "full"])
def run(request, tmp_path_factory) -> dict:
    """One EMPO² iteration on train variation 0 (memory written there), validated once, rollouts at T = 0.7 (the
    export's config says 1.0: the checkpoint's temperature wins)."""
    lora = request.param
    tmp = tmp_path_factory.mktemp("lora" if lora else "full")
    overrides = ["experiment=scienceworld", "env.num_train_variations=1", "data.tasks_per_iteration=1",
                 "data.group_size=2", "data.micro_batch_size=2", "trainer.max_epochs=1", "data.val.num_tasks=1",
                 "trainer.check_val_every_n_epoch=1", "algorithm.skip_zero_advantage=false",
                 f"model.policy.lora.enabled={str(lora).lower()}", "model.policy.lora.r=4",
                 "data.temperature=0.7"]
    cfg = _compose("train", tmp, *overrides)
    ckpt_path = train(cfg)["last_checkpoint"]
    from omegaconf import OmegaConf

    (Path(ckpt_path).parents[1] / ".hydra").mkdir()
    OmegaConf.save(cfg, Path(ckpt_path).parents[1] / ".hydra" / "config.yaml")  # as a Hydra run writes it
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    # One iteration of a random policy may see equal returns everywhere (no gradient); move the saved weights (the
    # LoRA B matrices start at 0) so that the checkpoint's policy is surely not its base model.
    gen = torch.Generator().manual_seed(0)
    for key, value in ckpt["state_dict"].items():
        if key.startswith("policy.") and value.is_floating_point() and ("lora_B" in key or not lora):
            ckpt["state_dict"][key] = value + 0.02 * torch.randn(value.shape, generator=gen)
    torch.save(ckpt, ckpt_path)
    return {"lora": lora, "tmp": tmp, "cfg": cfg, "ckpt_path": ckpt_path, "ckpt": ckpt, "overrides": overrides}


def _batch(policy: Policy) -> tuple[list[list[int]], list[list[int]]]:
    prompts = [policy.encode([{"role": "user", "content": f"Task {k}: find a non-living thing."}]) for k in range(3)]
    return prompts, [[100, 200, 300, 2], [400, 500], [600, 700, 800, 900, 1000]]


def _log_probs(policy: Policy, batch) -> torch.Tensor:
    with torch.no_grad():
        return policy.eval().log_probs(*batch)["log_probs"]


def _checkpoint_policy(run) -> Policy:
    """The checkpoint's policy, rebuilt here without the export code: the run's policy settings and its weights."""
    policy_cfg = {**run["ckpt"]["hyper_parameters"]["policy"], "gradient_checkpointing": False}
    policy = build_policy(**policy_cfg)
    state = {k[len("policy."):]: v for k, v in run["ckpt"]["state_dict"].items() if k.startswith("policy.")}
    missing, unexpected = policy.load_state_dict(state, strict=not run["lora"])
    assert not unexpected and all("lora_" not in k for k in missing)
    return policy


def _export(run, tmp_path: Path, *overrides: str) -> tuple[Path, dict]:
    out = tmp_path / "agent"
    cfg = _compose("export", tmp_path, *run["overrides"][:1], f"ckpt_path={run['ckpt_path']}",
                   f"export.out_dir={out}", *overrides)
    return out, run_export(cfg)


def test_exported_model_gives_the_checkpoints_log_probs(run, tmp_path):
    from transformers import AutoModelForCausalLM

    out, info = _export(run, tmp_path)
    reference = _checkpoint_policy(run)
    batch = _batch(reference)
    expected = _log_probs(reference, batch)
    base = build_policy(**{**run["ckpt"]["hyper_parameters"]["policy"], "lora": None})
    assert (_log_probs(base, batch) - expected).abs().max() > 1e-3  # the run trained the policy
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not hasattr(exported, "peft_config") and not (out / "adapter_config.json").exists()
    got = _log_probs(Policy(exported, reference.tokenizer), batch)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert info["weights"]["kind"] == ("merged" if run["lora"] else "full")
    # the tokenizer and its chat template travel with it
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == reference.tokenizer.chat_template
    # and the directory is a model.policy.name_or_path
    torch.testing.assert_close(_log_probs(build_policy(name_or_path=str(out), cache_dir="."), batch), expected,
                               atol=1e-5, rtol=0)


def test_lora_adapter_alone_is_exported(run, tmp_path):
    if not run["lora"]:
        with pytest.raises(ValueError, match="export.adapter_only=true needs a LoRA checkpoint"):
            _export(run, tmp_path, "export.adapter_only=true")
        return
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out, info = _export(run, tmp_path, "export.adapter_only=true")
    assert info["weights"]["kind"] == "lora_adapter" and (out / "adapter_config.json").is_file()
    assert not (out / "model.safetensors").exists()
    base_dir = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), out)
    reference = _checkpoint_policy(run)
    batch = _batch(reference)
    torch.testing.assert_close(_log_probs(Policy(model, reference.tokenizer), batch), _log_probs(reference, batch),
                               atol=1e-5, rtol=0)


def test_generation_config_samples_from_the_training_distribution(run, tmp_path):
    """The exported generation config at the run's rollout temperature and response cap (the checkpoint's, not the
    config's): the scores generate samples from are exactly log_softmax(logits / T), step by step."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    out, info = _export(run, tmp_path, "export.memory=false", "data.max_response_tokens=32")
    temperature = run["cfg"].algorithm.temperature
    assert info["rollout_temperature"] == temperature and info["memory"] is None
    gen = GenerationConfig.from_pretrained(out)
    assert (gen.do_sample, gen.temperature, gen.top_k, gen.top_p, gen.repetition_penalty) == (
        True, temperature, 0, 1.0, 1.0)
    assert gen.max_new_tokens == run["cfg"].data.max_response_tokens == 6  # the checkpoint's cap, not the config's 32
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([_batch(_checkpoint_policy(run))[0][0]])
    torch.manual_seed(0)
    res = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, output_scores=True,
                         output_logits=True, return_dict_in_generate=True)
    assert len(res.scores) >= 1
    for scores, logits in zip(res.scores, res.logits):
        torch.testing.assert_close(torch.log_softmax(scores, -1), torch.log_softmax(logits / temperature, -1))


def test_model_card_names_the_run(run, tmp_path):
    out, info = _export(run, tmp_path)
    assert info["iteration"] == 0 and info["iterations_trained"] == 1 and info["global_step"] >= 1
    assert info["validation"]["iteration"] == 0 and "val/score" in info["validation"]["metrics"]
    assert json.loads((out / "export_info.json").read_text())["global_step"] == info["global_step"]
    card = (out / "README.md").read_text()
    assert f"val/score = {info['validation']['metrics']['val/score']:.4g}" in card
    assert "| iterations trained | 1 (last iteration 0) |" in card
    assert "find-non-living-thing" in card and ".hydra/config.yaml" in card  # the run's own config
    assert "val/rollout_s" not in card  # timings stay in export_info.json
    with pytest.raises(ValueError, match="exists; choose another or set export.overwrite=true"):
        _export(run, tmp_path)


def test_export_never_deletes_what_it_did_not_write(run, tmp_path):
    """An overwrite replaces an earlier export only: a user's files, a run's checkpoints and a plain file stay."""
    out = tmp_path / "agent"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="no export wrote .*notes.txt"):
        _export(run, tmp_path, "export.overwrite=true")
    assert (out / "notes.txt").read_text() == "mine"
    checkpoints = Path(run["ckpt_path"]).parent
    before = sorted(p.name for p in checkpoints.iterdir())
    cfg = _compose("export", tmp_path, *run["overrides"][:1], f"ckpt_path={run['ckpt_path']}",
                   f"export.out_dir={checkpoints}", "export.overwrite=true")
    with pytest.raises(ValueError, match="no export wrote"):
        run_export(cfg)
    assert sorted(p.name for p in checkpoints.iterdir()) == before
    (out / "notes.txt").unlink()
    _export(run, tmp_path)
    _export(run, tmp_path, "export.overwrite=true")  # an earlier export is replaced
    (out / "notes.txt").write_text("added")
    with pytest.raises(ValueError, match="files it did not write \\(notes.txt\\)"):
        _export(run, tmp_path, "export.overwrite=true")
    assert (out / "notes.txt").read_text() == "added"
    plain = tmp_path / "plain"
    plain.write_text("a file")
    cfg = _compose("export", tmp_path, *run["overrides"][:1], f"ckpt_path={run['ckpt_path']}",
                   f"export.out_dir={plain}", "export.overwrite=true")
    with pytest.raises(ValueError, match="is a file"):
        run_export(cfg)
    assert plain.read_text() == "a file" and not list(tmp_path.glob(".plain*"))


def test_exported_memory_retrieves_the_same_tips(run, tmp_path):
    out, info = _export(run, tmp_path)
    saved = run["ckpt"]["callbacks"]["MemoryCallback"]["tips"]
    state, meta = read_memory_files(out / "memory")
    assert meta["embedder_name"] == saved["embedder_name"] == "embedded:all-MiniLM-L6-v2"
    assert meta["partition"] == "variation" and meta["num_entries"] == info["memory"]["num_entries"] > 0
    memories = []
    for s in (saved, state):
        memory = TipMemory(dim=384, embedder_name=s["embedder_name"], top_k=3)
        memory.load_state_dict(s)
        memories.append(memory)
    [(partition, part)] = saved["partitions"].items()
    queries = np.asarray(part["keys"], dtype=np.float32)
    hits = [m.retrieve([partition] * len(queries), queries) for m in memories]
    assert hits[0] == hits[1] and any(hits[0])


def test_eval_reads_the_exported_agent_and_memory_without_the_checkpoint(run, tmp_path):
    out, info = _export(run, tmp_path)
    cfg = _compose("eval", tmp_path / "eval", "experiment=scienceworld", "ckpt_path=null",
                   f"model.policy.name_or_path={out}", f"eval.memory_file={out / 'memory'}", "eval.split=train",
                   "eval.num_tasks=1", "eval.episodes_per_task=2")
    summary = run_eval(cfg)
    assert summary["memory_source"] == "file" and summary["memory"] is True
    assert summary["memory_size"] == info["memory"]["num_entries"] and summary["memory_hit_rate"] > 0
    bad = _compose("eval", tmp_path / "bad", "experiment=scienceworld", "ckpt_path=null",
                   f"eval.memory_file={out / 'memory'}", "memory.partition=task", "eval.num_tasks=1")
    with pytest.raises(ValueError, match="was written with memory.partition='variation'"):
        run_eval(bad)


@pytest.fixture(scope="module")
def bf16_lora_checkpoint(tiny_model_dir, model_cache_dir, tmp_path_factory) -> dict:
    """An adapter-only checkpoint on a bf16 base (the paper setting: a bf16 Qwen2.5 base with fp32 LoRA masters)
    whose update is small beside each weight, as lr 1e-6 training leaves it: most entries of W + BA move by less than
    half a bf16 ulp of W."""
    from src.models.checkpoint_state import base_record, keep_trainable

    tmp = tmp_path_factory.mktemp("bf16_lora")
    policy_cfg = {"name_or_path": tiny_model_dir, "cache_dir": str(model_cache_dir), "dtype": "bfloat16",
                  "lora": {"enabled": True, "r": 4, "alpha": 8, "target_modules": "all-linear"},
                  "max_response_tokens": 6}
    torch.manual_seed(0)
    policy = build_policy(**policy_cfg)
    gen = torch.Generator().manual_seed(1)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            p.data = 1e-4 * torch.randn(p.shape, generator=gen)
    ckpt = {"state_dict": {f"policy.{k}": v for k, v in policy.state_dict().items()}, "global_step": 1,
            "iteration": 0, "hyper_parameters": {"policy": policy_cfg, "algorithm": {"name": "grpo", "temperature": 1.0}}}
    stored = keep_trainable(ckpt, policy)
    ckpt["policy_base"] = base_record(policy, policy_cfg, stored)
    torch.save(ckpt, tmp / "last.ckpt")
    return {"tmp": tmp, "policy": policy, "path": tmp / "last.ckpt"}


def _kept_fraction(trained: torch.Tensor, base: torch.Tensor, exported: torch.Tensor) -> float:
    """The share of training's effect on log-probs an export keeps: 1 − mean|exported − trained| / mean|trained − base|."""
    return 1.0 - float((exported - trained).abs().mean() / (trained - base).abs().mean())


def test_the_default_export_of_a_bf16_lora_run_keeps_the_training(bf16_lora_checkpoint, tmp_path):
    """Merged into its bf16 base in bf16, the small update above kept ~a third of its effect on log-probs; the
    default export merges in float32 and keeps it whole. Everything is scored in float32 (the bf16 base weights are
    exact in float32), so only the export's rounding can differ."""
    from transformers import AutoModelForCausalLM

    policy = bf16_lora_checkpoint["policy"].float().eval()
    batch = _batch(policy)
    trained = _log_probs(policy, batch)
    with policy.model.disable_adapter():
        base = _log_probs(policy, batch)
    assert float((trained - base).abs().mean()) > 1e-5  # the update moves the log-probs
    cfg = _compose("export", tmp_path, "experiment=scienceworld", f"ckpt_path={bf16_lora_checkpoint['path']}",
                   f"export.out_dir={tmp_path / 'agent'}")
    info = run_export(cfg)
    assert info["weights"] == {"kind": "merged", "dtype": "float32"}
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "agent", dtype=torch.float32)
    assert _kept_fraction(trained, base, _log_probs(Policy(exported, policy.tokenizer), batch)) >= 0.99
    # asked for bf16 files, the export rounds the update away and says how much of it survived
    cfg = _compose("export", tmp_path, "experiment=scienceworld", f"ckpt_path={bf16_lora_checkpoint['path']}",
                   f"export.out_dir={tmp_path / 'agent-bf16'}", "export.dtype=bfloat16")
    info = run_export(cfg)
    assert info["weights"]["dtype"] == "bfloat16" and info["weights"]["update_kept"] < 0.9
    rounded = AutoModelForCausalLM.from_pretrained(tmp_path / "agent-bf16", dtype=torch.float32)
    assert _kept_fraction(trained, base, _log_probs(Policy(rounded, policy.tokenizer), batch)) < 0.9
