#!/bin/bash
# The GPU lease of issue 40 (kvharbor under load beside vLLM's own offloading), run from the repository
# root on the device machine: bash <this file> STEP. Steps, back to back while the machine stays up:
# p0 .. p4 (a vLLM part of 48 MiB each, carried as .whl/vllm.partNN), p5 (the last part, then vLLM 0.26
# installed), then the runs, each carrying .whl/deps and .whl/srv: `load` (MODES one after another on
# one slice of REQUESTS requests, closed loop of CLIENTS clients) and `restart` (each engine restarted
# half-way). vLLM's fs tier writes every block it is given and has no bound: at the 8B shape's 128 KiB
# a token it fills this machine's 63 GiB of free disk within about 500 requests of 32-token blocks, so
# it runs in `restart`, whose slice is 400 requests unless REQUESTS says otherwise (kvharbor beside it);
# `load` (2,000) runs the modes MODES names. A run's files are named after its modes, `+` for the commas
# (a comma in a name keeps a file from coming back from the device: seen 2026-12-08).
# Engines run eager (--enforce-eager): every mode alike, and each start costs less of the lease.
# The GPU's own prefix cache is held to GPU_BLOCKS blocks of 16 tokens (a production engine's KV room is
# what its model leaves; the whole slice would otherwise fit in the H100's), and every mode gets the same
# CPU_GB of host RAM and DISK_GB of disk (vLLM's fs tier takes none, as above: its bytes are reported).
# vLLM 0.26's OpenAI server needs wheels beyond ../shared/tools/prepare-gpu-vllm.sh's (seen 2026-12-07:
# uvicorn missing, then model_hosting_container_standards): fetched here into .whl/srv with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl/srv \
#     simpy==4.1.1 anthropic==2.17.0 blake3==1.0.11 distro==1.9.0 docstring_parser==0.18.0 ijson==3.6.0 jiter==0.19.0 jmespath==1.1.0 jsonschema==4.26.0 jsonschema_specifications==2025.9.1 lark==1.3.1 model_hosting_container_standards==0.1.16 prometheus_fastapi_instrumentator==8.1.0 python_json_logger==4.2.0 referencing==0.37.0 rpds_py==2026.9.1 setproctitle==1.3.8 supervisor==4.3.0 uvicorn==0.55.0 watchfiles==1.3.0
# and installed before the runs: pip install --no-index --no-deps --target $HOME/site .whl/srv/*.whl
set -uo pipefail
step=$1
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
export PYTHONPATH=$HOME/kvh:$HOME/site
mkdir -p $HOME/w
wheel=$HOME/w/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
CLIENTS=${CLIENTS:-32} GPU_BLOCKS=${GPU_BLOCKS:-4096} CPU_GB=${CPU_GB:-32} DISK_GB=${DISK_GB:-48}
BLOCK_TOKENS=${BLOCK_TOKENS:-32}
serve() {  # serve TAG [more bench/serve.py arguments]
  local tag=$1; shift
  python3 bench/serve.py --trace ${TRACE:-../shared/data/traces/mooncake_conversation_trace.jsonl} --model /tmp/kvh-llama31-8b --block-tokens $BLOCK_TOKENS --max-model-len 16384 \
    --output-scale 0.1 --output-tokens-max 64 --requests $REQUESTS --clients $CLIENTS --cpu-gb $CPU_GB --disk-gb $DISK_GB \
    --server-args "--load-format dummy --skip-tokenizer-init --dtype bfloat16 --enforce-eager --gpu-memory-utilization 0.85 --num-gpu-blocks-override $GPU_BLOCKS --max-num-seqs 64" \
    --out /tmp/serve-$tag --plan --plan-args "--engines 1 --model llama-3.1-8b --gpu h100 --ram-gb $CPU_GB" "$@" 2>&1 | tee $OUT/$tag.log | grep -v '^MODE' | tail -40
  cp /tmp/serve-$tag/serve.json $OUT/$tag.json; cp /tmp/serve-$tag/ttft.png $OUT/$tag-ttft.png 2>/dev/null
  for f in /tmp/serve-$tag/server-*.log; do tail -60 $f; done > $OUT/$tag-servers.log
  rm -rf /tmp/serve-$tag/*/vllm-fs /tmp/serve-$tag/*/kvharbor-files  # The next run's disk.
}
case $step in
p0|p1|p2|p3|p4) cp .whl/vllm.part0${step#p} $HOME/w/ && ls $HOME/w ;;
p5)
  cp .whl/vllm.part05 $HOME/w/ && cat $HOME/w/vllm.part0? > $wheel && rm -f $HOME/w/vllm.part0? || exit 1
  echo "$(cat .whl/vllm.sha256)  $wheel" | sha256sum -c || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $HOME/site $wheel || exit 1
  echo "vllm installed" ;;
install)
  [ -f $HOME/installed ] && exit 0  # Once per machine: the later runs of the lease skip it.
  [ -d .whl/srv ] && { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $HOME/site .whl/srv/*.whl || exit 1; }
  { date -u; nvidia-smi; nproc; free -g; df -h /dev/shm /tmp; } > $OUT/machine.txt 2>&1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $HOME/site .whl/deps/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target $HOME/kvh . || exit 1
  KVH_BENCH_DEVICE=cuda python3 -c 'import sys; sys.path.insert(0, "bench"); from pathlib import Path; import gpu; gpu.write_model(Path("/tmp/kvh-llama31-8b"))' || exit 1
  python3 -c 'import kvharbor, vllm, torch; print(kvharbor.__file__, vllm.__version__, torch.__version__)' && touch $HOME/installed ;;
load) REQUESTS=${REQUESTS:-2000}; bash "$0" install || exit 1; serve ${TAG:-load-${MODES//,/+}} --modes $MODES ;;
restart) REQUESTS=${REQUESTS:-400}; bash "$0" install || exit 1; serve ${TAG:-restart-${MODES//,/+}} --restart --window-s 10 --modes $MODES ;;
*) echo "unknown step $step"; exit 2 ;;
esac
