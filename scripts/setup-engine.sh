#!/usr/bin/env bash
# Build (or reuse) an engine environment for another SGLang release, layered over the main
# kvchaos venv: its own site-packages holds only that sglang and the pins that differ, and a
# .pth adds the main venv's site-packages after it (torch, mooncake, sglang-router, kvchaos).
# 0.2–0.4 GB (sglang itself ≈200 MB) instead of a second 3 GB venv. Used for the pre-fix
# reproduction of the GLM-5.3 incident (SGLang 0.5.19: the newest release without PR #36988; see
# suites/incidents), and for the releases between it and 0.5.23 (0.5.20: first with #36988;
# 0.5.21: first with #38935's is_unadmitted_reject; 0.5.22).
# Recipes: the runtime pins in that release's wheel METADATA (Requires-Dist) that the main venv
# does not satisfy, CUDA-only packages left out; torch, mooncake and sglang-router stay the main
# venv's (0.5.19–0.5.21 pin torch==2.13.0, 0.5.22/0.5.23 pin 2.14.1: both run on 2.13.0+cpu).
#
#   scripts/setup-engine.sh 0.5.19      -> prints the interpreter to put in engine_python
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: scripts/setup-engine.sh SGLANG_VERSION}
MAIN=${KVCHAOS_VENV:-$HOME/.cache/kvchaos/venv}
DEST=${KVCHAOS_ENGINE_VENV:-$HOME/.cache/kvchaos/venv-sglang-$VERSION}
log() { echo "[setup-engine] $*" >&2; }
# the pins of that release's metadata that differ from the 0.5.23 environment
case "$VERSION" in
  0.5.19|0.5.20) PINS="transformers==5.12.1 tokenizers==0.22.2 xgrammar==0.2.1 openai==2.6.1" ;;
  0.5.21) PINS="transformers==5.12.1 tokenizers==0.22.2 openai==2.6.1" ;;  # xgrammar 0.2.7 as 0.5.23
  0.5.22) PINS="openai==2.6.1" ;;  # transformers 5.19.0, tokenizers 0.23.2, xgrammar 0.2.7 as 0.5.23
  0.5.23) echo "$MAIN/bin/python"; exit 0 ;;
  *) echo "setup-engine: no recipe for sglang $VERSION (known: 0.5.19, 0.5.20, 0.5.21, 0.5.22, 0.5.23)" >&2; exit 2 ;;
esac
RECIPE=1
STAMP="$VERSION $PINS recipe $RECIPE $(cat "$MAIN/.kvchaos-stamp" 2>/dev/null)"
[ -x "$MAIN/bin/python" ] || { log "main venv $MAIN missing: run 'make setup' first"; exit 2; }
if [ "$(cat "$DEST/.kvchaos-stamp" 2>/dev/null)" != "$STAMP" ]; then
  log "building $DEST (sglang $VERSION over $MAIN)"
  rm -rf "$DEST"
  "$MAIN/bin/python" -m venv --without-pip "$DEST"
  SP=$("$DEST/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  MSP=$("$MAIN/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$MAIN/bin/python" -m pip install -q --disable-pip-version-check --no-deps --target "$SP" \
      "sglang==$VERSION" $PINS 2> >(grep -v 'is ignored: it is neither' >&2)
  # after our own site-packages; addsitedir also runs the main venv's .pth files (editable kvchaos)
  echo "import site; site.addsitedir('$MSP')" > "$SP/zz-kvchaos-main-venv.pth"
  got=$("$DEST/bin/python" -c 'from importlib import metadata as m, util; print(m.version("sglang"), util.find_spec("sglang").origin)')
  case "$got" in "$VERSION $SP"*) ;; *) log "wrong sglang in $DEST: $got"; exit 1 ;; esac
  echo "$STAMP" > "$DEST/.kvchaos-stamp"
  log "ready: sglang $VERSION"
fi
echo "$DEST/bin/python"
