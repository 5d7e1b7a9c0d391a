"""GPU tests of the host mirror: written inside a captured CUDA graph, replayed 10,000 times
while the CPU reads with lag 2 from a depth-3 ring, plus overrun, stale slots and the fused
kernel against the torch path on the device."""

import pytest
import torch

from graphrelay import Relay
from graphrelay.config import FieldSpec, RelayConfig
from graphrelay.mirror import HostMirror, MirrorOverrun

pytestmark = pytest.mark.gpu

CFG = RelayConfig(
    max_reqs=16,
    max_batch=8,
    accept_len=FieldSpec((), "int32"),
    confidence=FieldSpec((4,), "float32"),
)
INDICES = [3, 0, 7, 1, 0, 12, 5, 16]  # a bucket of 8 with two padding rows
REAL_ROWS = torch.tensor([j for j, slot in enumerate(INDICES) if slot != 0])  # [6]
LAG, DEPTH = 2, 3
LONG_SLEEP = 200_000_000  # GPU cycles (~0.1 s)


class CapturedStep:
    """A tiny decode step, captured: per-iteration values computed on the device from a device
    counter (the host never knows them), then written to the mirror."""

    def __init__(self, use_triton=True):
        cuda = torch.device("cuda")
        self.relay = Relay(CFG, cuda)
        self.relay.admit([s for s in INDICES if s != 0])  # generation 1 for every live slot
        self.mirror = HostMirror(self.relay, depth=DEPTH, use_triton=use_triton)
        self.host_generation = self.relay.host_generation
        self.state = torch.zeros(1, dtype=torch.int64, device=cuda)  # the step's own counter
        self.indices = torch.tensor(INDICES, dtype=torch.int64, device=cuda)  # [bs]
        self.row = torch.arange(len(INDICES), dtype=torch.int64, device=cuda)  # [bs]
        self.col = torch.arange(4, dtype=torch.float32, device=cuda)  # [4]
        self.tokens = torch.zeros(len(INDICES), dtype=torch.int32, device=cuda)  # static outputs
        self.seq_lens = torch.zeros(len(INDICES), dtype=torch.int32, device=cuda)
        self.accept = torch.zeros(len(INDICES), dtype=torch.int32, device=cuda)
        self.confidence = torch.zeros(len(INDICES), 4, dtype=torch.float32, device=cuda)
        self.graph = self._capture()
        self.stream = torch.cuda.current_stream()  # cached: current_stream() costs µs per call

    def step(self):
        self.state.add_(1)
        self.tokens.copy_((self.state * 1000 + self.row) % 50_000)
        self.seq_lens.copy_(self.state + self.row)
        self.accept.copy_((self.state + self.row) % 4)
        self.confidence.copy_((self.state + self.row)[:, None].float() * 0.5 + self.col)
        self.mirror.write(self.indices, self.tokens, self.seq_lens, accept_len=self.accept, confidence=self.confidence)

    def _capture(self):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up compiles the Triton kernel before capture
            self.step()
            self.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.step()
        torch.cuda.synchronize()
        self.state.zero_()
        self.mirror.reset()  # warm-up advanced the mirror's counter
        return graph

    def launch(self, iteration):
        self.graph.replay()
        self.mirror.record(iteration, self.stream)


def assert_is_iteration(read, iteration, host_generation):
    """What the device computed for `iteration` (its step counter was iteration + 1)."""
    k = iteration + 1
    assert read.iteration == iteration
    assert read.slots.tolist() == [s for s in INDICES if s != 0]
    assert torch.equal(read.tokens, ((k * 1000 + REAL_ROWS) % 50_000).to(torch.int32))
    assert torch.equal(read.seq_lens, (k + REAL_ROWS).to(torch.int32))
    assert torch.equal(read.accept_len, ((k + REAL_ROWS) % 4).to(torch.int32))
    want = (k + REAL_ROWS)[:, None].float() * 0.5 + torch.arange(4, dtype=torch.float32)
    assert torch.equal(read.confidence, want)
    assert torch.equal(read.generation, host_generation[read.slots])
    assert not read.stale.any()


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
def test_captured_writes_read_with_lag_2_for_10000_replays(use_triton):
    run = CapturedStep(use_triton=use_triton)
    replays = 10_000
    seen, not_ready = [], 0
    allocated = torch.cuda.memory_allocated()
    for i in range(replays):
        run.launch(i)
        if i >= LAG:
            read = run.mirror.poll(i - LAG)
            if read is None:
                not_ready += 1
                read = run.mirror.wait(i - LAG)
            assert_is_iteration(read, i - LAG, run.host_generation)
            seen.append(read.iteration)
    for i in range(replays - LAG, replays):  # drain
        read = run.mirror.wait(i)
        assert_is_iteration(read, i, run.host_generation)
        seen.append(read.iteration)
    assert seen == list(range(replays))  # every iteration once, in order: none lost or duplicated
    assert torch.cuda.memory_allocated() == allocated  # no device allocation across replays
    print(f"{use_triton=}: poll found {not_ready} of {replays - LAG} iterations not yet done")


def test_poll_is_none_while_the_gpu_is_still_running():
    run = CapturedStep()
    torch.cuda._sleep(LONG_SLEEP)  # queued before the replay on the same stream
    run.launch(0)
    assert run.mirror.poll(0) is None
    assert_is_iteration(run.mirror.wait(0), 0, run.host_generation)


def test_a_reader_held_back_past_the_depth_gets_an_overrun():
    run = CapturedStep()
    for i in range(50):
        run.launch(i)
        if i >= LAG:
            assert_is_iteration(run.mirror.wait(i - LAG), i - LAG, run.host_generation)
    # iteration 48 is due; hold the reader back while three more iterations launch
    for i in range(50, 53):
        run.launch(i)
    torch.cuda.synchronize()
    with pytest.raises(MirrorOverrun, match="iteration 48 was overwritten"):
        run.mirror.poll(48)
    with pytest.raises(MirrorOverrun):
        run.mirror.wait(49)
    for i in (50, 51, 52):  # still inside the window, and intact
        assert_is_iteration(run.mirror.poll(i), i, run.host_generation)


def test_a_slot_admitted_between_replays_marks_older_rows_stale():
    run = CapturedStep()
    run.launch(0)
    run.relay.admit([7])  # slot 7 goes to a new request: generation 2, on both sides
    run.launch(1)
    old, new = run.mirror.wait(0), run.mirror.wait(1)
    row = old.slots.tolist().index(7)
    assert old.stale.tolist() == [j == row for j in range(len(old))]
    assert int(old.generation[row]) == 1 and int(new.generation[row]) == 2
    assert not new.stale.any()
    assert 7 not in old.fresh().slots.tolist()


def test_fused_kernel_equals_torch_path_on_the_device():
    relay = Relay(CFG, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    relay.generation.copy_(torch.randint(0, 2**40, (CFG.rows,), device="cuda", generator=gen))
    mirrors = [HostMirror(relay, depth=DEPTH, use_triton=flag) for flag in (True, False)]
    for bs in (1, 8, 3, 0, 5):
        args = (
            torch.randint(0, CFG.rows, (bs,), device="cuda", generator=gen),
            torch.randint(-(2**31), 2**31, (bs,), device="cuda", generator=gen),  # int64, cast to int32
            torch.randint(0, 2**20, (bs,), device="cuda", generator=gen, dtype=torch.int32),
            torch.randint(0, 4, (bs,), device="cuda", generator=gen, dtype=torch.int16),
            torch.rand(bs, 4, device="cuda", generator=gen),
        )
        for mirror in mirrors:
            mirror.write(*args)
        torch.cuda.synchronize()
        rings = [m._ring.host_view(torch.uint8, (m._ring.nbytes,)) for m in mirrors]
        assert torch.equal(rings[0], rings[1]), f"bs={bs}"


def test_strided_inputs_inside_a_captured_write_equal_contiguous_eager_writes():
    """The captured write binds strided views (columns of one [bs, 3] int64 tensor, every other
    element, a transposed confidence); replayed after new values land in them in place, the
    ring holds what an eager twin writes from contiguous copies. If this failed, an engine
    whose step outputs are views would mirror another row's tokens to the scheduler."""
    cuda = torch.device("cuda")
    relay = Relay(CFG, cuda)
    relay.admit([s for s in INDICES if s != 0])
    captured, twin = (HostMirror(relay, depth=DEPTH) for _ in range(2))
    bs = len(INDICES)
    columns = torch.zeros(bs, 3, dtype=torch.int64, device=cuda)  # slots, tokens, seq lens
    accept = torch.zeros(2 * bs, dtype=torch.int32, device=cuda)[::2]
    confidence = torch.zeros(4, bs, dtype=torch.float32, device=cuda).t()  # [bs, 4], strides (1, bs)
    views = (columns[:, 0], columns[:, 1], columns[:, 2], accept, confidence)

    def fill(step: int) -> None:
        g = torch.Generator(device=cuda).manual_seed(step)
        columns[:, 0].copy_(torch.tensor(INDICES, device=cuda).roll(step))
        columns[:, 1:].copy_(torch.randint(0, 2**31, (bs, 2), device=cuda, generator=g))
        accept.copy_(torch.randint(0, 4, (bs,), device=cuda, generator=g, dtype=torch.int32))
        confidence.copy_(torch.rand(bs, 4, device=cuda, generator=g))

    fill(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up compiles the strided specialization
        captured.write(*views[:3], accept_len=views[3], confidence=views[4])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured.write(*views[:3], accept_len=views[3], confidence=views[4])
    captured.reset()
    stream = torch.cuda.current_stream()
    for step in range(2 * DEPTH):
        fill(step)
        graph.replay()
        captured.record(step, stream)
        copies = [v.clone(memory_format=torch.contiguous_format) for v in views]
        twin.write(*copies[:3], accept_len=copies[3], confidence=copies[4])
        twin.record(step, stream)
        torch.cuda.synchronize()
        rings = [m._ring.host_view(torch.uint8, (m._ring.nbytes,)) for m in (captured, twin)]
        assert torch.equal(rings[0], rings[1]), f"step {step}"
