"""`optimum-cli quasar ...`: the quasar-hf subcommands as an Optimum CLI command.

Optimum (>= 1.2x, 2.x) discovers third-party commands through the PEP 420 namespace package
`optimum.commands.register`: every module there may define `REGISTER_COMMANDS`, a list of
`BaseOptimumCLICommand` subclasses (see `optimum.commands.optimum_cli.load_optimum_namespace_cli_commands`).
Our module for that namespace lives in this package tree, under
`quasar_hf/commands/optimum_namespace/optimum/commands/register/quasar_hf.py`, and the
distribution installs it as `optimum/commands/register/quasar_hf.py` (see docs/serving.md).
"""

from __future__ import annotations

import sys

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo


class QuasarOptimumCommand(BaseOptimumCLICommand):
    """`optimum-cli quasar {quantize,generate,export,bench,eval,demo}` with quasar-hf's options."""

    COMMAND = CommandInfo(name="quasar", help="Quasar W8A8-verified speculative decoding (quasar-hf)")

    @staticmethod
    def parse_args(parser) -> None:
        from quasar_hf.commands.parser import add_subcommands

        add_subcommands(parser.add_subparsers(dest="command", metavar="COMMAND"))

    def run(self) -> None:
        from quasar_hf.commands.parser import run_parsed

        if not getattr(self.args, "handler", None):
            self.parser.print_help(sys.stderr)
            sys.exit(2)
        sys.exit(run_parsed(self.args, prog="optimum-cli quasar"))
