"""Tensor parallelism: sharded ranks, their launch and their serving run."""
