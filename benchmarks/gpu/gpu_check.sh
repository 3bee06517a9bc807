#!/usr/bin/env bash
# One-call GPU check of quasar_hf (H200: torch 2.11, triton 3.6, transformers 5.17), < 10 minutes, then (< 5 minutes) the
# GPU regression tests (`pytest -m cuda`).
#   benchmarks/gpu/gpu_check.sh [OUT_DIR] [extra args for python -m benchmarks gpu-check]
# Runs from the source tree (no `pip install`: the GPU image has no network, and the package's
# datasets/optimum requirements are not needed here). bitsandbytes is used when importable; to
# include it, carry a CUDA bitsandbytes wheel and install it first with `pip install --no-deps`.
# Writes OUT_DIR/gpu_check.json and OUT_DIR/gpu_check.md (also when a section fails).
# The first section quantizes a random-weight Llama with a real tokenizer through from_pretrained: the
# embedded SmolLM2's where quasar_hf's demo packages are installed; a GPU image has none, so save it here
# and carry the folder (device tool: carry=["out/smollm2_tokenizer"]), then QUASAR_TOKENIZER names it:
#   .venv/bin/python -c "from transformers import AutoTokenizer as T; from quasar_hf.models import smollm2_135m_instruct as m; T.from_pretrained(m()).save_pretrained('out/smollm2_tokenizer')"
#   QUASAR_TOKENIZER=out/smollm2_tokenizer benchmarks/gpu/gpu_check.sh "$OUT"
set -u
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="${1:-${OUT:-$here/benchmarks/reports/gpu-check}}"
shift || true
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
python="${PYTHON:-python}"
"$python" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
tokenizer=()
if [ -n "${QUASAR_TOKENIZER:-}" ]; then tokenizer=(--tokenizer "$QUASAR_TOKENIZER"); fi
timeout 570 "$python" -m benchmarks gpu-check --out "$out" "${tokenizer[@]}" "$@"
status=$?
# The GPU regression checks (tests marked cuda: tests/test_cuda_regressions.py): W8A8 backends against the
# reference, attention rows, quasar=True equal to plain greedy eager and compiled, compiled verify rows.
if "$python" -c "import pytest" 2>/dev/null; then
  (cd "$here" && timeout 300 "$python" -m pytest -q -p no:cacheprovider -m cuda tests) || { echo "pytest -m cuda failed"; status=1; }
else
  echo "GPU regression tests skipped: pytest is not importable"
fi
# Optional: where vLLM imports (CUDA image with vLLM) and QUASAR_CHECKPOINT=DIR names a saved
# SmolLM2 Quasar checkpoint, run the vLLM check on it (export, greedy vs ours, n-gram, no server).
# Writes OUT_DIR/vllm_check.{json,md}.
if [ -n "${QUASAR_CHECKPOINT:-}" ] && "$python" -c "import vllm" 2>/dev/null; then
  timeout 300 "$python" -m benchmarks vllm-check --models smollm2 --checkpoint "smollm2=$QUASAR_CHECKPOINT" \
    --vllm-python "$(command -v "$python")" --skip-serve --out "$out" || echo "vllm_check failed (status $?)"
else
  echo "vLLM check skipped (needs vllm importable and QUASAR_CHECKPOINT; see docs/serving.md)"
fi
exit $status
