"""`quasar-hf`: quantize, generate, export, bench, eval and demo from the command line.

The parser and the subcommands live in `quasar_hf.commands` (`parser.py`, `handlers.py`); this
module is the console script's entry point. Heavy imports happen inside the subcommands, so
`--help` is instant and always works.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from quasar_hf.commands.parser import build_parser, delegated_eval, run_delegated, run_parsed


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: the process arguments), run the subcommand, return its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    delegate = delegated_eval(argv)
    if delegate is not None:  # `eval --tasks ...` / `eval --per-layer ...` own their options
        return run_delegated(delegate, argv[1:], "eval")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help(sys.stderr)
        return 2
    return run_parsed(args)


if __name__ == "__main__":
    sys.exit(main())
