"""Registers `optimum-cli quasar` (read by optimum.commands.optimum_cli; keep this module light)."""

from quasar_hf.commands.optimum_quasar import QuasarOptimumCommand

REGISTER_COMMANDS = [QuasarOptimumCommand]
