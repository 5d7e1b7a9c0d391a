"""The floor of one relay iteration: the bytes it must move, at the measured copy bandwidth,
plus one kernel node.

Per batch row and field (row = width x element size, the same dtype in the payload, the
buffer and the output, as in the benchmark):
  gather (resolve):          read the buffer row + write the output row  = 2 x row
  scatter (stash + publish): read the payload row + write the buffer row = 2 x row
and each of the two ops reads the row's slot index once. Nothing else is necessary: any
version that moves fewer bytes has skipped a field.
"""

from __future__ import annotations

from typing import Sequence

from graphrelay.fields import Field
from graphrelay.tools.bench.timing import Ceilings


def row_bytes(fields: Sequence[Field]) -> int:
    """Bytes of one slot row across all fields."""
    return sum(f.width * f.dtype.itemsize for f in fields)


def iteration_bytes(fields: Sequence[Field], batch: int, index_itemsize: int) -> int:
    """Bytes one resolve + stash + publish of `batch` rows must read and write."""
    return batch * (4 * row_bytes(fields) + 2 * index_itemsize)


def floor_us(nbytes: int, ceilings: Ceilings) -> float:
    """Moving `nbytes` at the copy bandwidth, plus one kernel node's GPU time."""
    return nbytes / ceilings.copy_bandwidth * 1e6 + ceilings.kernel_node_us
