#!/bin/bash
# One step of the H200 lease for the read-back-aware load planner, run from the repository root
# on the device machine: bash <this file> STEP. Steps, back to back while the machine stays up:
# p0 .. p5 (vLLM's parts, then vLLM installed) and go (deps and kvharbor installed, then
# bench/gpu.py e2e at 32,768 tokens: MODES, by default recompute and a file-only tier read after
# the page cache was dropped). The steps before go are the hybrid lease's.
set -uo pipefail
earlier="$(dirname "$0")/../gpu-h200-2026-12-03-hybrid/lease.sh"
case $1 in
go)
  bash "$earlier" install || exit 1
  export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 PYTHONPATH=$HOME/kvh:$HOME/site
  timeout 560 python3 bench/gpu.py e2e --modes "${MODES:-recompute,slowtier}" --lengths 32768 --max-model-len 40000 \
    --model /tmp/kvh-llama31-8b --engine-timeout 270 --out "$OUT" 2>&1 | tee "$OUT/e2e.log" | grep -E '^\[|Error' ;;
*) exec bash "$earlier" "$1" ;;
esac
