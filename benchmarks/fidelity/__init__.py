"""How close the W8A8 model is to its original: perplexity, agreement, KL, per-layer error, exports read back."""
