#!/bin/bash
# One step of the H200 lease for issue 9 item 5 (engine.loads_in_flight_max: load requests a GPU
# may have queued ahead of its copy engine), run from the repository root on the device machine:
# bash <this file> STEP. Steps, back to back while the machine stays up: p0 .. p5 as in
# ../gpu-h200-2026-12-04-xxhash/lease.sh, then go (.whl/deps carried): deps and kvharbor
# installed, bench/gpu.py raw, then restart --phases service twice on one host: with
# KVHARBOR__ENGINE__LOADS_IN_FLIGHT_MAX=2 (one request per staging slot: the behaviour before)
# and 8; each run's logs packed into one archive (at most 8 files come back). reverse: the same
# in the other order (8 first), on another host, to tell the setting from the host's drift.
# deeper: 2, 8 and 16 (ran on the host of reverse, which stayed up). The runs go through
# ../gpu-h200-2026-12-04-startwait/lease.sh restart (shared after these leases ran, the same commands).
set -uo pipefail
step=$1
here=$(dirname "$0")
restart() {  # restart TAG DEPTH: the service-mode restart with engine.loads_in_flight_max = DEPTH.
  bash "$here/../gpu-h200-2026-12-04-startwait/lease.sh" restart "$1" KVHARBOR__ENGINE__LOADS_IN_FLIGHT_MAX=$2
}
install() { bash "$here/../gpu-h200-2026-12-04-xxhash/lease.sh" sha256-install; }
case $step in
p0|p1|p2|p3|p4|p5) exec bash "$here/../gpu-h200-2026-12-02-early-load/lease.sh" "$step" ;;
go) install || exit 1; restart depth2 2; restart depth8 8 ;;
reverse) install || exit 1; restart depth8 8; restart depth2 2 ;;
deeper) install || exit 1; restart depth2 2; restart depth8 8; restart depth16 16 ;;
*) echo "unknown step $step"; exit 2 ;;
esac
