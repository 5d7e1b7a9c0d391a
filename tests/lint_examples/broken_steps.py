"""Targets the linter can reach no verdict on: each must be reported as "could not be linted"
(exit status 2), and none may hide another target's result or hang `graphrelay lint`.

Each factory returns (step, example_inputs); the tests run them through the command, which
lints every target in a process of its own.
"""

import os
import sys
import time

import torch


def _x():
    return torch.arange(4, dtype=torch.float32)


def exits_cleanly():
    """sys.exit(0) in the step: before workers, the command exited 0 with this."""

    def step(x):
        sys.exit(0)  # <- exits

    return step, (_x(),)


def exits_hard():
    """os._exit skips every handler: only the process boundary sees it."""

    def step(x):
        print("the step's own output, before it exits")
        os._exit(0)

    return step, (_x(),)


def exits_in_factory():
    sys.exit(0)


def aborts():
    """A crash of the interpreter, as a segfault in an extension would be."""

    def step(x):
        os.abort()

    return step, (_x(),)


def sleeps():
    def step(x):
        time.sleep(3600)
        return x

    return step, (_x(),)


def spins():
    def step(x):
        while True:
            pass

    return step, (_x(),)


def generator_step():
    """Calling a generator function runs none of its body: nothing is checked."""

    def step(x):
        yield x * 2

    return step, (_x(),)


def does_nothing():
    def step(x):
        return None

    return step, (_x(),)
