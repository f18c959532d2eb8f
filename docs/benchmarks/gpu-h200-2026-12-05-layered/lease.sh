#!/bin/bash
# One step of the H200 lease for issue 9 item 5 (a restore's last requests copied layer by
# layer, the forward pass overlapping them: engine.load_layered_mb), run from the repository
# root on the device machine: bash <this file> STEP. Steps, back to back while the machine stays
# up: p0 .. p5 as in ../gpu-h200-2026-12-04-xxhash/lease.sh (a vLLM part each, 52 MiB), then go
# (.whl/deps carried): deps and kvharbor installed, bench/gpu.py raw, bench/gpu.py gateway at
# 130k's size (507 chunks: the data path chunk by chunk, with the default layered window and the
# widest), then restart --phases service with the default (2048 MiB layered); then off: the same
# restart with KVHARBOR__ENGINE__LOAD_LAYERED_MB=0 (chunk by chunk) on the same host; again: the
# default once more, after it; both: go then off in one command (lease 2). Each restart's logs
# are packed into one archive.
set -uo pipefail
step=$1
here=$(dirname "$0")
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
export PYTHONPATH=$HOME/kvh:$HOME/site
restart() { bash "$here/../gpu-h200-2026-12-04-startwait/lease.sh" restart "$1" "$2"; }
case $step in
p0|p1|p2|p3|p4|p5) exec bash "$here/../gpu-h200-2026-12-02-early-load/lease.sh" "$step" ;;
go)
  bash "$here/../gpu-h200-2026-12-04-xxhash/lease.sh" sha256-install || exit 1
  timeout 170 python3 bench/gpu.py gateway --chunks 507 --repeat 3 --out $OUT 2>&1 | tee $OUT/gateway.log \
    | grep -o '"restore_[a-z_]*": [^,]*\|Error.*'
  restart layered KVHARBOR__ENGINE__LOAD_LAYERED_MB=2048 ;;
off) restart chunked KVHARBOR__ENGINE__LOAD_LAYERED_MB=0 ;;
both)  # Lease 2, after engine.load_layered_row_mb: go, then off, in one command.
  bash "$0" go; bash "$0" off ;;
again) restart layered2 KVHARBOR__ENGINE__LOAD_LAYERED_MB=2048 ;;
*) echo "unknown step $step"; exit 2 ;;
esac
