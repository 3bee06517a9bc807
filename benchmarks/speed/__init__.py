"""Step and generation speed on CPU, eager and compiled, drafters, and two code trees compared (ab-step, same-bits)."""
