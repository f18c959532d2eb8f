#!/bin/bash
# One step of the GPU lease of 2026-12-07 (issue 9, item 5: where the copy engine stands idle in a
# 130k restore), run from the repository root on the device machine: bash <this file> STEP.
# Steps, back to back while the machine stays up: p0 .. p5 (vLLM's parts of 52 MiB, one each, then
# vLLM installed: ../gpu-h200-2026-12-02-early-load/lease.sh), then go (.whl/deps carried): deps
# and kvharbor installed, bench/gpu.py raw, then service-mode restarts at 130k while the call has
# time, in turn the defaults (A), RUN_B's settings (B: a queue of load requests deep enough to
# cover vLLM's step preparation) and RUN_C's (C: B with the interpreter's switch interval at
# 0.5 ms); each run's profiled restore lists the DMA's idle gaps (`dma_gaps`). The machine is
# given back when idle for 30 s: one call keeps it. The next lease (the loader of d1d06b3, not yet
# run on a GPU): RUN_B="KVHARBOR__ENGINE__LOADS_IN_FLIGHT_MAX=64 KVHARBOR__ENGINE__LOAD_START_WAIT_MS=200"
# (every request of a 130k restore queued before vLLM prepares the step) beside the defaults.
set -uo pipefail
step=$1
here=$(dirname "$0")
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
export PYTHONPATH=$HOME/kvh:$HOME/site
RUN_B=${RUN_B:-KVHARBOR__ENGINE__LOADS_IN_FLIGHT_MAX=8 KVHARBOR__ENGINE__LOAD_START_WAIT_MS=30}
RUN_C=${RUN_C:-$RUN_B KVH_BENCH_SWITCH_INTERVAL_US=500}
restart() {  # restart TAG [NAME=VALUE ...]: one service-mode restart with those settings.
  local tag=$1; shift
  mkdir -p $OUT/$tag
  echo "[$tag] $*" > $OUT/$tag/settings.txt
  env "$@" timeout 200 python3 bench/gpu.py restart --phases service --lengths 130000 \
    --model /tmp/kvh-llama31-8b --engine-timeout 180 --out $OUT/$tag 2>&1 | tee $OUT/$tag/restart.log \
    | grep -E 'breakdown|clock|restored|130000:|pcie_floor' | cut -c1-900 | tail -9
  tar -czf $OUT/$tag.tar.gz -C $OUT --exclude '*.json.gz' $tag && rm -rf $OUT/$tag
}
case $step in
p0|p1|p2|p3|p4|p5) exec bash "$here/../gpu-h200-2026-12-02-early-load/lease.sh" "$step" ;;
go)
  bash "$here/../gpu-h200-2026-12-03-hybrid/lease.sh" install || exit 1
  timeout 120 python3 bench/gpu.py raw --repeat 3 --out $OUT 2>&1 | tee $OUT/raw.log | tail -2
  n=0
  while [ $SECONDS -lt ${LOOP_S:-390} ]; do
    n=$((n + 1))
    case $((n % 3)) in
      1) restart a$n KVH_RUN=A ;;
      2) restart b$n $RUN_B ;;
      0) restart c$n $RUN_C ;;
    esac
  done ;;
one)  # A second lease, the device time nearly spent: one restart with RUN_B's settings, no raw.
  bash "$here/../gpu-h200-2026-12-03-hybrid/lease.sh" install || exit 1
  restart ${TAG:-b1} $RUN_B ;;
*) echo "unknown step $step"; exit 2 ;;
esac
