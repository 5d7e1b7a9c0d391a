"""HostSyncCounter counts torch's sync-debug warnings and nothing else."""

import warnings

import pytest

from graphrelay.capture.serving.sync_count import HostSyncCounter


def test_counts_the_sync_warning_not_the_modes_own_prototype_notice():
    # torch warns this once per process on the first switch to a sync-debug mode: on a GPU it
    # would land inside the first counter of the process and read as one sync.
    with HostSyncCounter(False) as syncs:
        warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all "
                      "synchronizing operations", UserWarning)
        warnings.warn("called a synchronizing CUDA operation", UserWarning)
        warnings.warn("called a synchronizing CUDA operation", UserWarning)
    assert syncs.count == 2


def test_other_warnings_pass_through_uncounted():
    with pytest.warns(UserWarning, match="oversize batch"):
        with HostSyncCounter(False) as syncs:
            warnings.warn("oversize batch: running it eagerly", UserWarning)
    assert syncs.count == 0
