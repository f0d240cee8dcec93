"""The llvmlite backend: targets, kernels, and the native program executor."""
