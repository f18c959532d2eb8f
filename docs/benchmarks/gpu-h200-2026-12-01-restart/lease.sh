#!/bin/bash
# One step of the H200 lease for bench/gpu.py (issue 9, items 5 and 6), run from the repository root
# on the device machine: bash .gpu-src/lease.sh STEP. Results accumulate in /root/res while the
# machine stays up; each step packs its own folder into $OUT.
# First lease: deps, gw (then named part0), part1-part3, vllm, restart; the raw A/B runs (ab/) and the
# gateway re-run (gateway-507.json) were inline commands of the gw and part1-part3 calls, after the fix.
# Second lease (second-lease/): deps2, part0-part3, vllm2.
set -uo pipefail
step=$1
R=$PWD
S=$R/.gpu-src
res=/root/res
model=/tmp/kvh-llama31-8b
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
export PYTHONPATH=$HOME/kvh:$HOME/site
mkdir -p $res/$step $HOME/w
out=$res/$step
pack() { tar czf $OUT/$step.tgz -C $res $step; ls -la $OUT; }
part() { cp .whl/vllm.part0$1 $HOME/w/ && ls -la $HOME/w; }
case $step in
deps)
  { date -u; nvidia-smi; uname -a; nproc; free -g; df -h /dev/shm /tmp; ulimit -l; } > $out/machine.txt 2>&1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $HOME/site .whl/deps/*.whl || exit 1
  (cd $S && python3 -m pip install -q --no-index --no-deps --no-build-isolation --target $HOME/kvh .) || exit 1
  python3 -c 'import kvharbor, torch; print(kvharbor.__file__, torch.__version__, torch.cuda.get_device_name(0))'
  (cd $S && timeout 240 python3 bench/gpu.py raw --out $out) 2>&1 | tee $out/raw.log | tail -3
  pack ;;
gw)
  part 0
  (cd $S && timeout 300 python3 bench/gpu.py gateway --chunks 507 --ring-mb 1024 --repeat 3 --profile --out $out) 2>&1 \
    | tee $out/gateway.log | tail -3
  pack ;;
part0|part1|part2|part3)
  part ${step#part} ;;
vllm)
  part 4
  cd $HOME/w && cat vllm.part0? > vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl && cd $R &&
  echo "$(cat .whl/vllm.sha256)  $HOME/w/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl" | sha256sum -c || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $HOME/site \
    $HOME/w/vllm-0.26.0-*.whl || exit 1
  rm -f $HOME/w/vllm.part0?
  python3 -c 'import vllm; print("vllm", vllm.__version__)'
  (cd $S && timeout 420 python3 bench/gpu.py e2e --modes native --model $model --engine-timeout 360 --out $out) 2>&1 | tee $out/e2e.log | tail -8
  pack ;;
restart)
  (cd $S && timeout 560 python3 bench/gpu.py restart --model $model --engine-timeout 240 --out $out) 2>&1 | tee $out/restart.log | tail -30
  mkdir -p $res/all && cp $res/*/*.json $res/all/ 2>/dev/null
  (cd $S && python3 bench/gpu.py report --out $res/all --json) > $out/report.txt 2>&1; tail -c 3000 $out/report.txt
  pack ;;
deps2)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $HOME/site .whl/deps/*.whl || exit 1
  (cd $S && python3 -m pip install -q --no-index --no-deps --no-build-isolation --target $HOME/kvh .) || exit 1 ;;
vllm2)
  part 4
  cd $HOME/w && cat vllm.part0? > vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl && cd $R &&
  echo "$(cat .whl/vllm.sha256)  $HOME/w/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl" | sha256sum -c || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $HOME/site \
    $HOME/w/vllm-0.26.0-*.whl || exit 1
  rm -f $HOME/w/vllm.part0?
  (cd $S && timeout 400 python3 bench/gpu.py restart --phases service --model $model --engine-timeout 240 --out $out) 2>&1 \
    | tee $out/restart.log | tail -12
  pack ;;
*) echo "unknown step $step"; exit 2 ;;
esac
