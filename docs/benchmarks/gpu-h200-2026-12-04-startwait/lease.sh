#!/bin/bash
# One step of the H200 lease for issue 9 item 5 (engine.load_start_wait_ms: the engine's thread
# waits for an early restore's first copies to be queued), run from the repository root on the
# device machine: bash <this file> STEP. Steps, back to back while the machine stays up: p0 .. p5
# as in ../gpu-h200-2026-12-04-xxhash/lease.sh, then go (.whl/deps carried): deps and kvharbor
# installed, bench/gpu.py raw, then restart --phases service twice on one host: with
# KVHARBOR__ENGINE__LOAD_START_WAIT_MS=0 (no wait: the behaviour before) and with the default
# (10 ms); each run's logs packed into one archive (at most 8 files come back). restart TAG
# NAME=VALUE: one such run with another setting (later leases use it).
set -uo pipefail
step=$1
here=$(dirname "$0")
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
export PYTHONPATH=$HOME/kvh:$HOME/site
restart() {  # restart TAG NAME=VALUE: the service-mode restart with the environment's NAME=VALUE.
  mkdir -p $OUT/$1
  env "$2" timeout 260 python3 bench/gpu.py restart --phases service \
    --model /tmp/kvh-llama31-8b --engine-timeout 240 --out $OUT/$1 2>&1 | tee $OUT/$1/restart.log \
    | grep -E 'breakdown|restored' | tail -6
  tar -czf $OUT/$1.tar.gz -C $OUT --exclude '*.json.gz' $1 && rm -rf $OUT/$1
}
case $step in
p0|p1|p2|p3|p4|p5) exec bash "$here/../gpu-h200-2026-12-02-early-load/lease.sh" "$step" ;;
go)
  bash "$here/../gpu-h200-2026-12-04-xxhash/lease.sh" sha256-install || exit 1
  restart nowait KVHARBOR__ENGINE__LOAD_START_WAIT_MS=0; restart wait10 KVHARBOR__ENGINE__LOAD_START_WAIT_MS=10 ;;
restart) restart "$2" "$3" ;;  # One run, for later leases: restart TAG NAME=VALUE.
*) echo "unknown step $step"; exit 2 ;;
esac
