"""The kernels alone: W8A8 linears, row-stable attention, Hadamard rotation and lm_head, each build against the oracle and its peers."""
