"""HumanEval pass@1 (greedy): unquantized vs W8A8 vs W8A8 with Quasar decoding, code run in subprocesses.

    python scripts/humaneval.py smollm2 --limit 10 --out /tmp/he --name smollm2_he10
    python scripts/humaneval.py QUASAR_CHECKPOINT --reference ORIGINAL --out benchmarks --name humaneval_qwen0.5b

Writes NAME.json (every completion, outcome and the environment) and NAME.md. See
quasar_hf/eval/humaneval.py.
"""

import sys

from quasar_hf.eval.humaneval import main

if __name__ == "__main__":
    sys.exit(main())
