"""Backends: the numpy reference interpreter and the llvmlite native backend."""
