#!/bin/bash
# The block store's and the file tier's benches on the GPU machine's 16-core host (the GPU idle),
# from the repository root there (.whl/deps carried): bash <this file>. kvharbor and its Python
# dependencies installed from wheels unless an earlier step of the same lease installed them;
# then bench/store.py --no-s3 and bench/card.py (no S3 server there: S3 is measured on the
# 2-core VM, ../cpu-2026-12-05/), each run ${RUNS:-1} time(s), output into $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/kvh:$HOME/site
if ! python3 -c 'import kvharbor, simpy, lz4, zstandard, prometheus_client' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $HOME/site .whl/deps/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target $HOME/kvh . || exit 1
fi
{ date -u; uname -a; nproc; lscpu | grep -E 'Model name|Flags' | cut -c1-400; free -g; df -h /tmp; } > $OUT/machine.txt 2>&1
for run in $(seq ${RUNS:-1}); do
  mkdir -p /tmp/sb$run
  timeout 250 python3 bench/store.py --no-s3 --json --dir /tmp/sb$run > $OUT/store$run.txt 2>&1; grep 'vs_raw\|Error' $OUT/store$run.txt
  timeout 200 python3 bench/card.py --json --dir /tmp > $OUT/card$run.txt 2>&1; tail -1 $OUT/card$run.txt | cut -c1-600
done
