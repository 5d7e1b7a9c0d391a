"""A step that launches a Triton kernel. On CPU it runs under TRITON_INTERPRET=1 (set by the
tests' conftest before this module is imported), whose numpy emulation issues torch ops that a
GPU launch never would; the linter must count the launch as the user's, not those ops."""

import torch
import triton
import triton.language as tl


@triton.jit
def _double(src, dst, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(dst + offsets, tl.load(src + offsets, mask=mask) * 2, mask=mask)


def triton_launch():
    def step(x, out):
        _double[(1,)](x, out, x.numel(), BLOCK=8)
        return out + 1  # the only op of the step's own

    return step, (torch.randn(5), torch.empty(5))


def triton_launch_only():
    """A step that is one kernel launch: every op it issues is the interpreter's, none traced,
    yet the step did run (it must not count as a step that does nothing)."""

    def step(x, out):
        _double[(1,)](x, out, x.numel(), BLOCK=8)
        return out

    return step, (torch.randn(5), torch.empty(5))
