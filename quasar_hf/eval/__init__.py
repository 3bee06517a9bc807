"""Task accuracy of Quasar models: lm-evaluation-harness tasks and HumanEval pass@1, vs the original.

- `eval_main(argv)`: `quasar-hf eval --tasks ...` (lm-eval; needs the `eval` extra: `pip install quasar-hf[eval]`).
- `quasar_hf.eval.lm_eval_model.QuasarLM`: the lm-eval model type "quasar-hf" (generation with Quasar decoding).
- `quasar_hf.eval.humaneval`: HumanEval pass@1 with the generated code run in a sandboxed subprocess.
- `quasar_hf.eval.accuracy.record_accuracy`: put the numbers in a checkpoint's model card.
lm-eval is imported only when used, so `import quasar_hf.eval` works without it.
"""

from __future__ import annotations


def eval_main(argv: list[str] | None = None) -> int:
    """`quasar-hf eval --tasks ...`: see `quasar_hf.eval.lm_eval_runner.build_parser` for the options."""
    try:
        from .lm_eval_runner import eval_main as run
    except ImportError as error:
        if "lm_eval" not in str(error):
            raise
        raise SystemExit(
            "quasar-hf eval --tasks needs lm-evaluation-harness: pip install 'quasar-hf[eval]' (or pip install lm-eval==0.4.13)"
        ) from None
    return run(argv)


__all__ = ["eval_main"]
