"""Quantization cost: time against its arithmetic floor, peak memory, scaling to real shapes."""
