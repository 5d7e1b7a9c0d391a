"""The seeded serving-loop soak (tests/loop_soak.py): slot churn with arrivals, aborts,
chunked prompts, speculation on and off, greedy and sampled rows; 0 lost, duplicated or stale
tokens against a no-overlap reference. CI runs a size that fits in about a minute on a CPU;
the GPU check runs the full size:

    GRAPHRELAY_SOAK_ITERATIONS=100000 python -m pytest -q -m gpu tests/test_loop_soak.py
"""

from __future__ import annotations

import os

import pytest

from loop_soak import soak

ITERATIONS_ENV, SEED_ENV = "GRAPHRELAY_SOAK_ITERATIONS", "GRAPHRELAY_SOAK_SEED"
CI_ITERATIONS = 2000  # about 12 rounds: some 25 s on 2 quiet CPU cores (the reference runs each round too)


@pytest.mark.slow
def test_seeded_soak_matches_the_no_overlap_reference(device):
    iterations = int(os.environ.get(ITERATIONS_ENV, CI_ITERATIONS))
    totals = soak(device, iterations, seed=int(os.environ.get(SEED_ENV, "0")))
    print(f"\nloop soak on {device}: {totals | {'problems': len(totals['problems'])}}")
    assert totals["problems"] == [], "\n".join(totals["problems"][:20])
    assert totals["iterations"] >= iterations and totals["rounds"] >= 2  # speculation off and on
    assert 0 < totals["aborted"] < totals["requests"]
    assert totals["spec_tokens_per_step"] > 1  # drafts were accepted, not only proposed
    assert totals["host_syncs"] == 0
