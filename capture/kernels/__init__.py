"""Triton kernels of the captured iteration, each with a torch twin for the CPU."""
