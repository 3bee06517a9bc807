"""Implementations behind the `quasar-hf` CLI, and its registration with `optimum-cli`."""
