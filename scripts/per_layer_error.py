"""Per-layer W8A8 error report: which decoder linears lose the most, split into weight and activation error.

    python scripts/per_layer_error.py --name per_layer_smollm2                 # embedded SmolLM2, quantized now
    python scripts/per_layer_error.py --model DIR --quantized QDIR --name per_layer_x   # a saved checkpoint

Writes benchmarks/<name>.md and .json (see quasar_hf.bench.per_layer).
"""

from __future__ import annotations

import sys

from quasar_hf.bench.per_layer import per_layer_main

if __name__ == "__main__":
    for path in per_layer_main(sys.argv[1:]):
        print(path)
