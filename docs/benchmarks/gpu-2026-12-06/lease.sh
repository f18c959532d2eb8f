#!/bin/bash
# One step of the GPU lease of 2026-12-06, run from the repository root on the device machine:
# bash <this file> STEP. Steps, back to back while the machine stays up: p0 .. p5 (vLLM's parts
# of 52 MiB, one each, then vLLM installed: ../gpu-h200-2026-12-02-early-load/lease.sh), then
# hybrid (.whl/deps carried, with compressed-tensors and loguru: vLLM's Qwen3-Next imports them):
# deps and kvharbor installed, bench/gpu_window.py's Qwen3-Next-80B-A3B-shaped case (issue 16);
# then restart TAG (issue 9): one service-mode restart at 130k with the defaults, its logs packed;
# all: hybrid, then restarts r1 and r2 while the call has time (the machine is given back when
# idle for 30 s: one call keeps it).
set -uo pipefail
step=$1
here=$(dirname "$0")
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
export PYTHONPATH=$HOME/kvh:$HOME/site
case $step in
p0|p1|p2|p3|p4|p5) exec bash "$here/../gpu-h200-2026-12-02-early-load/lease.sh" "$step" ;;
hybrid)
  bash "$here/../gpu-h200-2026-12-03-hybrid/lease.sh" install || exit 1
  work=$(mktemp -d /tmp/gw-XXXX)  # Models, configs and file tiers stay on the machine; the logs come back.
  timeout 560 python3 bench/gpu_window.py --shape gdn --tokens 32768 --cases ${CASES:-gdn-80b} \
    --out $work 2>&1 | tee $OUT/gdn.log | grep -E '^\{|SUMMARY|Error'
  mkdir -p $OUT/logs && cp $work/*.log $OUT/logs/ ;;
restart)
  [ -d $HOME/kvh/kvharbor ] || bash "$here/../gpu-h200-2026-12-03-hybrid/lease.sh" install || exit 1
  [ -f $OUT/raw.json ] || timeout 150 python3 bench/gpu.py raw --repeat 3 --out $OUT 2>&1 | tail -1
  bash "$here/../gpu-h200-2026-12-04-startwait/lease.sh" restart "$2" KVHARBOR__ENGINE__LOAD_LAYERED_MB=2048 ;;
all)
  bash "$0" hybrid
  for tag in r1 r2; do
    [ $SECONDS -lt 330 ] && bash "$0" restart $tag
  done ;;
*) echo "unknown step $step"; exit 2 ;;
esac
