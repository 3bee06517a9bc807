"""Kept for tests/test_serve.py only, until it imports tests.helpers.hub: the helpers live there now."""

from tests.helpers.hub import make_tiny_checkpoint, quantize_tiny  # noqa: F401
