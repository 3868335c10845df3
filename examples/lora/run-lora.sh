#!/usr/bin/env bash
# GRPO with a LoRA adapter (examples/lora/README.md): the CPU quickstart's run, training a rank-16 adapter on every
# linear layer while the base stays frozen; the engines serve the adapter being trained. Extra flags go to train.py
# (e.g. --lora-rank 8, --target-modules q_proj v_proj, or GPU flags).
set -euo pipefail
cd "$(dirname "$0")/../.."
LORA=1 exec bash scripts/run-quickstart-cpu.sh "$@"
