#!/bin/bash
# One step of the H200 lease for issue 16's Mamba-type groups, run from the repository root on
# the device machine: bash <this file> STEP. Steps, back to back while the machine stays up:
# p0 .. p5 (vLLM's parts, then vLLM installed), go (deps and kvharbor installed, then
# bench/gpu_window.py --shape gdn: a Qwen3-Next-style hybrid beside a full-attention Llama of
# its attention shape, each stored by one vLLM process and restored by the next).
set -uo pipefail
step=$1
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
export PYTHONPATH=$HOME/kvh:$HOME/site
hybrid="$(dirname "$0")/../gpu-h200-2026-12-03-hybrid/lease.sh"
case $step in
p0|p1|p2|p3|p4|p5|install) exec bash "$hybrid" "$step" ;;
go)
  bash "$hybrid" install || exit 1
  work=$(mktemp -d /tmp/gw-XXXX)  # Models, configs and file tiers stay on the machine; the logs come back.
  timeout 570 python3 bench/gpu_window.py --shape gdn --tokens ${TOKENS:-32768} --cases ${CASES:-full-gdn,gdn} \
    --out $work 2>&1 | tee $OUT/gdn.log | grep -E '^\{|SUMMARY'
  mkdir -p $OUT/logs && cp $work/*.log $OUT/logs/ ;;
*) echo "unknown step $step"; exit 2 ;;
esac
