#!/bin/bash
# The next GPU lease for issue 9, item 5 (prepared 2026-12-07 at f198aab, not yet run): does the
# copy engine still stand idle while vLLM prepares the step of a 130k restore, now that the engine's
# thread waits until the copies are ahead of the copy engine (`engine.loads_in_flight_max` requests
# still being copied) and the loader scatters whole chunks in one pass (d1d06b3)?
# Run from the repository root on the device machine: bash <this file> STEP, with the steps of
# ../gpu-2026-12-07/lease.sh (p0 .. p5 back to back, each carrying its vLLM part; then go, carrying
# .whl/deps). The restarts take turns: A the defaults (2 requests ahead, the wait at most 10 ms),
# B 8 requests ahead (60 ms), C 64 (200 ms: at 130k the loader then queues every streamed request,
# up to the held ones, before vLLM prepares the step). After them, bench/loader.py: the loader's own time
# per 256 MiB request beside its copy on this GPU (`loader_vs_dma`). Each restart prints its restores
# against the issue's floor (`pcie_floor`, from 1606f11: the pinned host-to-GPU rate measured in the
# restoring process; `vs_floor` <= 1.1 is the target).
set -uo pipefail
here=$(dirname "$0")
export RUN_B=${RUN_B:-KVHARBOR__ENGINE__LOADS_IN_FLIGHT_MAX=8 KVHARBOR__ENGINE__LOAD_START_WAIT_MS=60}
export RUN_C=${RUN_C:-KVHARBOR__ENGINE__LOADS_IN_FLIGHT_MAX=64 KVHARBOR__ENGINE__LOAD_START_WAIT_MS=200}
export LOOP_S=${LOOP_S:-360}  # Room for the loader's figure within the call's 600 s.
bash "$here/../gpu-2026-12-07/lease.sh" "$@"
rc=$?
if [ "$1" = go ]; then
  PYTHONPATH=$HOME/kvh:$HOME/site timeout 60 python3 bench/loader.py --json 2>&1 | tee $OUT/loader.log | tail -1
fi
exit $rc
