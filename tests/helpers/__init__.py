"""Helpers shared by the test modules (tests import these, never another test module)."""
