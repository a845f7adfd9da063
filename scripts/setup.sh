#!/usr/bin/env bash
# Build (or reuse) the kvchaos environment: SGLang 0.5.23 without its CUDA stack, CPU torch,
# sglang-router 0.3.2, Mooncake (non-CUDA), the harness deps (env/requirements-harness.txt: pytest, mkdocs
# for the docs build, ...), and kvchaos itself (editable).
#
# Idempotent and fast when done: the venv carries a stamp (hash of RECIPE below, the requirement
# files and the Python version); a matching stamp skips straight to the editable install check.
# The venv lives outside the checkout (default ~/.cache/kvchaos/venv) so CI's fresh clones reuse it.
# Prints the venv path on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PYTHON=${KVCHAOS_BASE_PYTHON:-python3}
VENV=${KVCHAOS_VENV:-$HOME/.cache/kvchaos/venv}
log() { echo "[setup] $*" >&2; }

# --- Debian: mooncake's .so needs libibverbs.so.1 even for TCP transfers; the report test opens
# report.html in headless Chromium (chromium + chromium-driver, driven by selenium)
APT=()
ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 ' || APT+=(libibverbs1)
command -v chromium >/dev/null || APT+=(chromium)
command -v chromedriver >/dev/null || APT+=(chromium-driver)
if [ ${#APT[@]} -gt 0 ]; then
  log "installing ${APT[*]} (apt)"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${APT[@]}" >&2
fi

# Bump RECIPE when the install steps below change. The engine stamp covers the heavy part (a
# change rebuilds the venv from scratch); the harness stamp only re-runs a pip install on top.
RECIPE=1
STAMP=$(cat env/requirements-engine.txt \
        <(echo "recipe $RECIPE") <("$PYTHON" -c 'import sys; print(sys.version)') | sha256sum | cut -c1-16)
HSTAMP=$(sha256sum env/requirements-harness.txt | cut -c1-16)
pip_install() {  # pip, minus the noise about this machine's empty local index folders
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2> >(grep -v 'is ignored: it is neither' >&2)
}

if [ "$(cat "$VENV/.kvchaos-stamp" 2>/dev/null)" != "$STAMP" ]; then
  log "building $VENV (stamp $STAMP); a few minutes on a fresh machine"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  # CPU torch first: a plain 'torch' requirement would pull a multi-GB CUDA build.
  pip_install torch==2.13.0
  echo "torch==2.13.0" > "$VENV/constraints.txt"
  pip_install -c "$VENV/constraints.txt" -r env/requirements-engine.txt
  # sglang's metadata pins torch==2.14.1 + the CUDA stack; its runtime deps are listed above.
  # torchvision 0.28.0 is a CUDA build; kvchaos.cpucompat makes its import work on CPU torch.
  pip_install --no-deps sglang==0.5.23 torchvision==0.28.0
  "$VENV/bin/python" - <<'PY'
from importlib import metadata as m
want = {"sglang": "0.5.23", "sglang-router": "0.3.2", "torch": "2.13.0+cpu", "torchvision": "0.28.0",
        "mooncake-transfer-engine-non-cuda": "0.3.13.post1"}
bad = {k: m.version(k) for k, v in want.items() if m.version(k) != v}
assert not bad, f"unexpected versions after install: {bad}"
PY
  echo "$STAMP" > "$VENV/.kvchaos-stamp"
  rm -f "$VENV/.kvchaos-harness-stamp"
  log "engine environment ready"
fi

if [ "$(cat "$VENV/.kvchaos-harness-stamp" 2>/dev/null)" != "$HSTAMP" ]; then
  log "installing harness requirements"
  pip_install -c "$VENV/constraints.txt" -r env/requirements-harness.txt
  echo "$HSTAMP" > "$VENV/.kvchaos-harness-stamp"
fi

# --- NIXL (the second KV transfer backend): nixl-cu13's wheel carries UCX and runs on CPU memory
# once kvchaos.cpucompat maps NIXL's VRAM labels to DRAM. --no-deps: its metadata pulls nixl-cu12 too.
NSTAMP=$(sha256sum env/requirements-nixl.txt | cut -c1-16)
if [ "$(cat "$VENV/.kvchaos-nixl-stamp" 2>/dev/null)" != "$NSTAMP" ]; then
  log "installing NIXL"
  pip_install --no-deps -r env/requirements-nixl.txt
  echo "$NSTAMP" > "$VENV/.kvchaos-nixl-stamp"
fi

# --- kvchaos itself, editable, pointing at this checkout (CI clones elsewhere: re-point cheaply)
HERE=$(cd / && "$VENV/bin/python" -c 'import kvchaos, os; print(os.path.dirname(os.path.dirname(os.path.abspath(kvchaos.__file__))))' 2>/dev/null || true)
# pyproject.toml's entry points (the pytest plugin, the kvchaos command) are baked in at install: re-install
# when they change too
SSTAMP=$(sha256sum pyproject.toml | cut -c1-16)
if [ "$HERE" != "$REPO" ] || [ "$(cat "$VENV/.kvchaos-self-stamp" 2>/dev/null)" != "$SSTAMP" ]; then
  log "installing kvchaos (editable) from $REPO"
  (cd /tmp && "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$REPO") >&2
  echo "$SSTAMP" > "$VENV/.kvchaos-self-stamp"
fi
echo "$VENV"
