"""The decode engine: relay, model, host mirror, input surface and captured graphs, built once.

The engine owns the device side of serving and exposes what a scheduler needs, all
non-blocking: `prefill` a request into a slot, `launch` a decode iteration for a batch of
slots, `read` an iteration's host-mirror values (poll or wait), and `first_token` of a
prefill. Everything is ordered on one stream the engine creates with cuda-python.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional, Sequence

import torch

from capture.buckets import default_buckets
from capture.graph_runner import CaptureReport, GraphRunner
from capture.model import LlamaModel, ModelConfig
from capture.sampling import SamplingParams, sample
from capture.step import DecodeStep
from capture.surface import DecodeInputs, HostBatch
from graphrelay import Relay, RelayConfig, RelayPayload
from graphrelay.mirror import HostMirror, MirrorRead
from graphrelay.runtime import Event, Stream, to_device_async


class Engine:
    """Everything one decode iteration touches, allocated up front for `device`.

    use_graphs: capture one CUDA graph per bucket (GPU only); otherwise the step runs
    eagerly on the same padded buckets, so both modes see identical shapes.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        *,
        max_reqs: int,
        max_batch: int,
        device: torch.device | str,
        use_graphs: bool = True,
        buckets: Optional[Sequence[int]] = None,
        max_top_k: Optional[int] = None,
        mirror_depth: int = 3,
        debug: bool = False,
        progress: bool = False,
    ):
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"
        relay_config = RelayConfig.plain(max_reqs, max_batch, debug=debug)
        self.relay = Relay(relay_config, self.device, validate=False)
        self.model = LlamaModel(model_config, max_reqs, self.device)
        self.mirror = HostMirror(relay_config, self.device, depth=mirror_depth, validate=False)
        self.inputs = DecodeInputs(max_batch, self.device)
        self.step = DecodeStep(self.relay, self.model, self.mirror, self.inputs, max_top_k=max_top_k)
        self.runner = GraphRunner(
            self.step, list(buckets) if buckets else default_buckets(max_batch), max_batch, self.device,
            use_graphs=use_graphs, progress=progress,
        )
        self.max_top_k = max_top_k
        # A pooled torch stream, wrapped: torch's pinned tensors (staging, prompts) are copied
        # on it and outlive any one engine (see graphrelay.runtime.Stream).
        self.torch_stream = torch.cuda.Stream(self.device) if self.on_gpu else None
        self.stream = Stream.from_torch(self.torch_stream) if self.on_gpu else Stream(self.device)
        # First tokens sampled by prefill, per slot, read by the host once their event fired.
        self._first_tokens = torch.zeros(relay_config.rows, dtype=torch.int64, pin_memory=self.on_gpu)
        self._first_token_events = [Event(device=self.device) for _ in range(relay_config.rows)]
        self.iterations_launched = 0
        if self.on_gpu:
            # The engine stream does not order against the legacy default stream that built
            # the weights: finish construction before any work is queued on it.
            torch.cuda.synchronize(self.device)

    @property
    def max_batch(self) -> int:
        return self.relay.config.max_batch

    @property
    def max_reqs(self) -> int:
        return self.relay.config.max_reqs

    def activate(self):
        """Context manager making the engine stream current for torch work (GPU), or a no-op."""
        return torch.cuda.stream(self.torch_stream) if self.on_gpu else nullcontext()

    def capture(self) -> CaptureReport:
        """Warm up and capture every bucket, then restart the mirror at iteration 0."""
        with self.activate():
            report = self.runner.capture()
        self.mirror.reset()
        self.iterations_launched = 0
        return report

    @torch.no_grad()
    def prefill(self, slot: int, prompt: Sequence[int], params: SamplingParams) -> None:
        """Admit `slot`, run the prompt eagerly and put the first sampled token and the seq len
        into the relay, without waiting for the device. Call with the engine stream active."""
        self.relay.admit([slot])
        logits = self.model.prefill(slot, torch.tensor(prompt, dtype=torch.int64))
        length = len(prompt)
        host = torch.tensor([[slot, params.top_k, params.seed, length, length]], dtype=torch.int64)
        dev = to_device_async(host, self.device)[0]  # [slot, top_k, seed, step, seq_len]
        temperature = to_device_async(torch.tensor([params.temperature], dtype=torch.float32), self.device)
        # Position `length` is the step a decode at this position would use: prefill samples the
        # token at position L-1's output, so it uses step L-1 and decode steps follow on.
        token = sample(logits[None], temperature, dev[1:2], dev[2:3], dev[3:4] - 1, max_top_k=self.max_top_k)
        slots = dev[0:1]
        self.relay.stash(slots, RelayPayload(tokens=token))
        self.relay.publish(slots, dev[4:5].to(self.relay.config.seq_len_torch_dtype))
        self._first_tokens[slot : slot + 1].copy_(token, non_blocking=True)
        self._first_token_events[slot].record(self.stream)

    def first_token(self, slot: int, block: bool = False) -> Optional[int]:
        """The token prefill sampled for `slot`, once the device has produced it (None if not
        yet and not `block`)."""
        event = self._first_token_events[slot]
        if not event.query():
            if not block:
                return None
            event.synchronize()
        return int(self._first_tokens[slot])

    def launch(self, batch: HostBatch) -> int:
        """Queue one decode iteration for `batch` (graph replay, or eager); returns its number."""
        n = len(batch.slots)
        bs = self.runner.bucket(n) or n
        self.inputs.load(batch, bs, self.torch_stream)
        self.runner.run(n)
        iteration = self.iterations_launched
        self.mirror.record(iteration, self.stream)
        self.iterations_launched += 1
        return iteration

    def read(self, iteration: int, block: bool) -> Optional[MirrorRead]:
        """Iteration `iteration`'s sampled tokens and seq lens (stale rows flagged)."""
        if block:
            return self.mirror.wait(iteration, self.relay.host_generation)
        return self.mirror.poll(iteration, self.relay.host_generation)