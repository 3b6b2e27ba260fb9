"""Compute kernels, each beside its torch reference."""
