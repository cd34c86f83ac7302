#!/usr/bin/env bash
# The GPU checks of the training path, as one script for a CUDA machine (run from the repo root):
# bf16-mixed single-GPU training and FSDP2 (trainer=fsdp) on WebShop with GRPO and the tiny policy, loaded in bf16
# like the paper's Qwen2.5-7B config: each run must report fp32 trainable master weights (the "Precision:" log
# line, checked at the start of fit) and pass the start-up memory estimate with the GPU's real memory.
# (ScienceWorld needs Java and the memory needs the 90 MB embedder, so both stay on the CPU tests.)
# Usage: bash scripts/gpu_check.sh <tiny-model-dir> <out-dir>
set -uo pipefail
tiny=${1:?tiny model dir}; out=${2:?out dir}
export PYTHONUNBUFFERED=1 PROJECT_ROOT=$PWD
mkdir -p "$out"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0))"
common=(experiment=webshop debug=default algorithm=grpo "model.policy.name_or_path=$tiny" model.policy.dtype=bfloat16
        logger=csv "paths.data_dir=$out/data" "paths.log_dir=$out/logs" data.tasks_per_iteration=2 data.group_size=4
        trainer.max_epochs=2 "~callbacks.rich_progress_bar" trainer.enable_progress_bar=false
        algorithm.entropy_coef=0.01 algorithm.skip_zero_advantage=false)  # a gradient even when a random
        # policy's group returns are all equal (its advantages are 0): entropy bonus and KL still train
status=0
for run in "gpu trainer=gpu trainer.devices=1" "fsdp trainer=fsdp trainer.devices=1"; do
  name=${run%% *}; args=${run#* }
  start=$(date +%s)
  if python3 src/train.py "${common[@]}" $args "hydra.run.dir=$out/$name" > "$out/$name.log" 2>&1; then
    echo "$name: ok in $(( $(date +%s) - start )) s"
  else
    echo "$name: FAILED"; tail -30 "$out/$name.log"; status=1
  fi
  grep -h -o "Memory estimate: [^:]*\|Precision: .*" "$out/$name.log" "$out/$name"/*.log 2>/dev/null \
    | sort -u | sed 's/^/   /'
  grep -q "Precision: parameters: [0-9.,]*M trainable float32" "$out/$name.log" "$out/$name"/*.log 2>/dev/null \
    || { echo "$name: no fp32 master weights reported"; status=1; }
  python3 - "$out/$name" <<'PY'
import csv, glob, sys
rows = list(csv.DictReader(open(glob.glob(sys.argv[1] + "/csv/version_0/metrics.csv")[0])))
for key in ("rollout/return", "train/pg_loss", "train/entropy", "train/kl_loss", "train/grad_norm", "val/score"):
    print("  ", key, ["%.4g" % float(r[key]) for r in rows if r.get(key)])
PY
done
exit $status
