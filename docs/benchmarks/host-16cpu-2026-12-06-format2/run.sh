#!/bin/bash
# bench/card.py on the GPU machine's 16-core host (the GPU idle), block format 2 against the
# commit before it (3f16701, block format 1), alternating in one call, from the repository root
# there with .whl/deps (with simpy) and .bench-old (`git archive 3f16701 kvharbor bench`)
# carried: bash <this file>. Output into $OUT: new<N>.txt and old<N>.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $HOME/site .whl/deps/*.whl || exit 1
{ date -u; uname -a; nproc; lscpu | grep -E 'Model name' ; free -g; df -h /tmp; } > $OUT/machine.txt 2>&1
for run in $(seq ${RUNS:-4}); do
  [ $SECONDS -lt ${BUDGET_S:-420} ] || break
  PYTHONPATH=.:$HOME/site timeout 100 python3 bench/card.py --json --ops 100000 --dir /tmp > $OUT/new$run.txt 2>&1
  echo "new$run $(tail -1 $OUT/new$run.txt | cut -c1-900)"
  (cd .bench-old && PYTHONPATH=.:$HOME/site timeout 100 python3 bench/card.py --json --ops 100000 --dir /tmp > $OUT/old$run.txt 2>&1)
  echo "old$run $(tail -1 $OUT/old$run.txt | cut -c1-900)"
done
