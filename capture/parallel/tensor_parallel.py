"""Tensor parallelism (Megatron-style) over torch.distributed: one process per device.

Each rank holds a column slice of the QKV and gate/up projections (its share of the query
heads, KV heads and MLP columns) and the matching row slice of the O and down projections, so
each layer needs exactly two all-reduces: after the O projection and after the down
projection. The embedding, final norm and LM head are replicated: every rank then computes
the same logits from the same all-reduced hidden state, so sampling (argmax, or the
per-(seed, position) draws) picks the same token on every rank by construction, and every
rank's relay holds the same values without any extra communication.

Two process groups: the device group (NCCL on GPUs, gloo on CPUs) carries the all-reduces,
which are captured inside the iteration graphs; a gloo group on the CPU carries the scheduler's
commands from rank 0 to the others (`send` / `receive`), so handing out an iteration never
touches a GPU stream. The split itself: `ModelConfig.shard` and `ModelWeights.shard`.
"""

from __future__ import annotations

import datetime
import os
from typing import Optional, Union

import msgspec
import torch
import torch.distributed as dist

from graphrelay.capture.iteration.spans import Span


class LaunchCommand(msgspec.Struct, frozen=True, tag="launch"):
    """Rank 0 queued an iteration of these spans."""

    spans: list[Span]


class StopCommand(msgspec.Struct, frozen=True, tag="stop"):
    """Rank 0 is done, or `failed`: followers leave their loop (and, on failure, do not wait
    for anything more from rank 0)."""

    failed: bool = False


Command = Union[LaunchCommand, StopCommand]
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Command)


class TensorParallel:
    """This process's place in a tensor-parallel group, and its two process groups."""

    def __init__(self, rank: int, world: int, device: torch.device,
                 group: Optional[dist.ProcessGroup], control: Optional[dist.ProcessGroup]):
        self.rank, self.world, self.device = rank, world, device
        self.group, self.control = group, control

    @property
    def leads(self) -> bool:
        """Rank 0 schedules, reads the host mirror and sends commands; the others follow."""
        return self.rank == 0

    @classmethod
    def join(cls, rank: int, world: int, init_method: str, device_type: str,
             timeout: datetime.timedelta = datetime.timedelta(minutes=5)) -> "TensorParallel":
        """Join (create, on the first call of every rank) the process groups. On CUDA, rank r
        drives `cuda:r` through NCCL; on the CPU every rank runs on the CPU through gloo."""
        if device_type == "cuda":
            if torch.cuda.device_count() < world:
                raise RuntimeError(f"tensor parallelism over {world} ranks needs {world} GPUs, "
                                   f"this machine has {torch.cuda.device_count()}; lower --tp")
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world,
                                    timeout=timeout, device_id=device)
        else:
            device = torch.device("cpu")
            # The ranks share the machine's cores: without a share each, their thread pools
            # oversubscribe the cores and every collective waits on a descheduled peer.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
            dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=timeout)
        control = dist.new_group(backend="gloo", timeout=timeout)
        return cls(rank, world, device, dist.group.WORLD, control)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (capturable with NCCL). The identity at world 1."""
        if self.world > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def send(self, command: Command) -> None:
        """Rank 0: hand `command` to every other rank (CPU only: a gloo broadcast)."""
        if self.world > 1:
            data = _ENCODER.encode(command)
            size = torch.tensor([len(data)], dtype=torch.int64)
            dist.broadcast(size, src=0, group=self.control)
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=self.control)

    def receive(self) -> Command:
        """Ranks > 0: the next command from rank 0 (blocks this CPU thread only)."""
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.control)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.control)
        return _DECODER.decode(data.numpy().tobytes())

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()
