"""`python -m quasar_hf.eval MODEL --tasks ...`: the same as `quasar-hf eval --tasks ...`."""

import sys

from quasar_hf.eval import eval_main

if __name__ == "__main__":
    sys.exit(eval_main())
