#!/usr/bin/env bash
# The recipe end to end (README.md here): convert SmolLM2-135M-Instruct, write the arithmetic task,
# then GRPO with the held-out curve: bench/real_rl.py with the settings of the expected curve.
#   bash examples/smollm2_arithmetic/run.sh                 # one GPU
#   bash examples/smollm2_arithmetic/run.sh --tiny          # a CPU smoke (a few steps, small batches)
# WORK (default /tmp/smollm2_arithmetic) holds the model, the data and the run; a model or data
# already there is kept.
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${WORK:-/tmp/smollm2_arithmetic}
[ -f "$WORK/smollm2/model.safetensors" ] || python examples/smollm2_arithmetic/smollm2.py "$WORK/smollm2"
[ -f "$WORK/arithmetic/val.jsonl" ] || python examples/smollm2_arithmetic/make_arithmetic.py "$WORK/arithmetic"
python bench/real_rl.py --model "$WORK/smollm2" --data "$WORK/arithmetic" --out "$WORK/grpo" \
  --steps 120 --eval-every 40 --lr 5e-6 \
  --set "val.path=$WORK/arithmetic/val.jsonl" --set val.every=10 --set val.n=0 "$@"
