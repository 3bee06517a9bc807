"""One call on a lent GPU (gpu_check.sh): the user path, kernels, profile, the verify step and end to end."""
