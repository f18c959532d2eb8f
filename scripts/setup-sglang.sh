#!/usr/bin/env bash
# Set up the SGLang test environment: a venv (default .venv-sglang in the repo root, or
# KVHARBOR_SGLANG_VENV) with sglang 0.5.23 on the CPU build of torch 2.13.0, and kvharbor
# installed editable from this checkout.
#
# SGLang and vLLM pin different torch releases, so SGLang gets a venv of its own. The sglang
# wheel itself pins torch 2.14.1 and pulls the CUDA stack (flashinfer, sglang-kernel, ...), none
# of which runs on a CPU machine: it is installed with --no-deps, then only what the HiCache
# storage interface and the offline Engine import, constrained to torch 2.13.0.
#
# Idempotent: a venv whose installed set matches this script (a stamp of it and pyproject.toml)
# is left alone. torch 2.13.0+cpu is not on PyPI: outside the project machines (where pip finds
# it in a local wheel folder) point pip at PyTorch's CPU index first:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup-sglang.sh
set -euo pipefail

SGLANG_VERSION="0.5.23"
TORCH_VERSION="2.13.0"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVHARBOR_SGLANG_VENV:-${REPO_ROOT}/.venv-sglang}"
PY="${VENV}/bin/python"

# What sglang's storage interface (sglang.srt.mem_cache.hicache_storage and
# storage.backend_factory) imports, then what the offline Engine with a Llama model imports.
# triton: sglang/srt/utils/common.py imports it at top level, even on CPU.
DEPS=(
    numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec pydantic
    pyzmq tqdm IPython aiohttp dill
    "transformers==5.19.0" "tokenizers==0.23.2" "xgrammar==0.2.7" "apache-tvm-ffi==0.1.11"
    fastapi "uvicorn>=0.51" uvloop python-multipart prometheus-client setproctitle regex einops
    interegular partial_json_parser sentencepiece tiktoken xxhash zstandard scipy
    "openai==2.8.0" "openai-harmony==0.0.4" "llguidance>=1.7.6,<2" "python-dateutil<3" distro
    "compressed-tensors==0.18.0" gguf blobfile==3.0.0 pyyaml safetensors huggingface_hub
    "pytest>=8" "pytest-timeout>=2.3"
)

T0=$(date +%s)
log() { echo "[setup-sglang] $*"; }

# pip here is configured with local file:// indexes that print one "is ignored" warning per
# package they lack; drop that noise but keep everything else (and pip's exit status).
pip_quiet() {
    "${PY}" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2 || true)
}

STAMP="${VENV}/.kvharbor-sglang.sha256"
want="$(cat "${BASH_SOURCE[0]}" "${REPO_ROOT}/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [[ -x "${PY}" && -f "${STAMP}" && "$(cat "${STAMP}")" == "${want}" ]]; then
    log "${VENV} is up to date; skipping"
    exit 0
fi

if [[ ! -x "${PY}" ]]; then
    BASE_PY="$(command -v python3.11 || command -v python3)"
    log "creating ${VENV} with $(${BASE_PY} --version)"
    "${BASE_PY}" -m venv "${VENV}"
    pip_quiet install -q --upgrade pip
fi

CONSTRAINTS="$(mktemp)"
trap 'rm -f "${CONSTRAINTS}"' EXIT
echo "torch==${TORCH_VERSION}" >"${CONSTRAINTS}"

log "installing torch==${TORCH_VERSION} (CPU), sglang==${SGLANG_VERSION} (--no-deps) and its CPU deps"
pip_quiet install -q "torch==${TORCH_VERSION}"
pip_quiet install -q --no-deps "sglang==${SGLANG_VERSION}"
pip_quiet install -q -c "${CONSTRAINTS}" "${DEPS[@]}"
# kvharbor from this checkout, its own dependencies constrained to the same torch.
pip_quiet install -q -c "${CONSTRAINTS}" -e "${REPO_ROOT}"
# PyPI's torchvision is a CUDA build that fails to import beside CPU torch, and transformers
# imports it when present: keep it out.
if "${PY}" -m pip show -q torchvision >/dev/null 2>&1; then
    "${PY}" -m pip uninstall -q -y torchvision
fi

"${PY}" - <<'EOF'
from importlib.metadata import version
import torch
import sglang.srt.mem_cache.hicache_storage  # noqa: F401
import kvharbor
print(f"[setup-sglang] ok: sglang {version('sglang')}, torch {torch.__version__}, kvharbor from {kvharbor.__file__}")
EOF
echo "${want}" >"${STAMP}"
log "all done in $(( $(date +%s) - T0 )) s"
