#!/bin/bash
# bench/card.py on the GPU machine's 16-core host (the GPU idle), after its raw reads were made
# to land in the pages the store's gets fill (715d817), from the repository root there
# (.whl/deps carried, with simpy): bash <this file>. Runs it ${RUNS:-3} times while the call
# has time, output into $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/kvh:$HOME/site
if ! python3 -c 'import kvharbor, simpy, lz4, zstandard, prometheus_client' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $HOME/site .whl/deps/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target $HOME/kvh . || exit 1
fi
{ date -u; uname -a; nproc; lscpu | grep -E 'Model name' ; free -g; df -h /tmp; } > $OUT/machine.txt 2>&1
for run in $(seq ${RUNS:-3}); do
  [ $SECONDS -lt ${BUDGET_S:-200} ] || break
  timeout 120 python3 bench/card.py --json --dir /tmp > $OUT/card$run.txt 2>&1; tail -1 $OUT/card$run.txt | cut -c1-700
done
