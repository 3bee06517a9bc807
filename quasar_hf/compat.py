"""Every private Transformers name quasar_hf relies on, in one module.

Transformers' private API (underscore names, internal registries, cache layer classes) moves
between 5.x releases. The rest of the package calls the small functions here instead, so an
upgrade changes this file only; `tests/test_layering.py` fails when another module reaches a
private Transformers name.
"""

from __future__ import annotations
