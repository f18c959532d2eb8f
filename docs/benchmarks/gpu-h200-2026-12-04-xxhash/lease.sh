#!/bin/bash
# One step of the H200 lease for issue 9 item 5 (vLLM's block hashing in a 130k restore:
# sha256, its default, beside xxhash in the same lease), run from the repository root on the
# device machine: bash <this file> STEP. Steps, back to back while the machine stays up:
# p0 .. p5 (.whl/vllm.part00 .. part05 carried, one each, .whl/vllm.sha256 with the last;
# the parts of 52 MiB), sha256 (.whl/deps carried: deps and kvharbor installed, bench/gpu.py raw,
# then restart --phases service), xxhash (restart --phases service with
# --hash-algo xxhash; lease 1 lost the machine between the two), both (install, raw, xxhash,
# then sha256, in one command; each algorithm's logs packed into one archive, as at most 8
# files come back). kvharbor's keys are its own (token ids hashed with its layout), so
# vLLM's hash algorithm changes only vLLM's own per-request work.
set -uo pipefail
step=$1
here=$(dirname "$0")
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
export PYTHONPATH=$HOME/kvh:$HOME/site
restart() {  # restart ALGO: the service-mode restart with vLLM's block hashing set to ALGO.
  mkdir -p $OUT/$1
  timeout ${RESTART_TIMEOUT_S:-560} python3 bench/gpu.py restart --phases service --model /tmp/kvh-llama31-8b --engine-timeout 240 \
    --hash-algo $1 --out $OUT/$1 2>&1 | tee $OUT/$1/restart.log | grep -E 'breakdown|restored|\{' | tail -12
}
case $step in
p0|p1|p2|p3|p4|p5) exec bash "$here/../gpu-h200-2026-12-02-early-load/lease.sh" "$step" ;;
sha256) bash "$0" sha256-install && restart sha256 ;;
xxhash) restart xxhash ;;
both)
  bash "$0" sha256-install || exit 1
  export RESTART_TIMEOUT_S=260; restart xxhash; restart sha256
  for a in xxhash sha256; do tar -czf $OUT/$a.tar.gz -C $OUT --exclude '*.json.gz' $a && rm -rf $OUT/$a; done ;;
sha256-install)
  bash "$here/../gpu-h200-2026-12-03-hybrid/lease.sh" install || exit 1
  timeout 120 python3 bench/gpu.py raw --repeat 3 --out $OUT 2>&1 | tee $OUT/raw.log | tail -3 ;;
*) echo "unknown step $step"; exit 2 ;;
esac
