"""Shared builders for relay tests: configs with every field, random payloads, snapshots."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from graphrelay import FieldSpec, Relay, RelayConfig, RelayPayload
from graphrelay.fields import PUBLISH, STASH

# Source dtypes differ from storage dtypes on purpose, so every field exercises a cast on store.
SOURCE_DTYPE = {
    torch.int32: torch.int64,
    torch.int64: torch.int32,
    torch.int16: torch.int64,
    torch.float32: torch.float32,
    torch.bfloat16: torch.float32,
    torch.float16: torch.float32,
}


def full_config(max_reqs: int = 12, max_batch: int = 6, **overrides) -> RelayConfig:
    """Every optional field enabled, with mixed dtypes."""
    fields = dict(
        topk_p=FieldSpec((4,), "float32"),
        topk_index=FieldSpec((4,), "int64"),
        hidden=FieldSpec((40,), "bfloat16"),
        draft_probs=FieldSpec((3,), "float16"),
        sparse_topk=FieldSpec((2, 3), "int32"),
        accepted_tokens=FieldSpec((3,), "int16"),
        accept_len=FieldSpec((), "int32"),
        confidence=FieldSpec((3,), "float32"),
    )
    fields.update(overrides)
    return RelayConfig(max_reqs=max_reqs, max_batch=max_batch, pad_token_id=7, seq_len_fill=1, **fields)


def random_tensor(shape, dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 3).to(dtype)
    return torch.randint(0, 30000, shape, generator=gen).to(dtype)


def random_values(relay: Relay, group: str, bs: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        f.name: random_tensor((bs, *f.shape), SOURCE_DTYPE[f.dtype], gen).to(relay.device)
        for f in relay.fields
        if f.group == group
    }


def random_payload(relay: Relay, bs: int, gen: torch.Generator) -> RelayPayload:
    return RelayPayload(**random_values(relay, STASH, bs, gen))


def random_publish(relay: Relay, bs: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    values = random_values(relay, PUBLISH, bs, gen)
    return values["seq_lens"], values.get("confidence")


def padded_bucket(slots: list[int], bs: int, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """`slots` scattered among `bs` rows, the rest padding (slot 0)."""
    rows = torch.zeros(bs, dtype=torch.int64)
    where = torch.randperm(bs, generator=gen)[: len(slots)]
    rows[where] = torch.tensor(slots, dtype=torch.int64)
    return rows.to(device)


def snapshot(relay: Relay) -> dict[str, torch.Tensor]:
    """Every piece of relay state, cloned."""
    state = {name: buf.clone() for name, buf in relay.buffers.items()}
    state["_generation"] = relay.generation.clone()
    state["_host_generation"] = relay.host_generation.clone()
    state["_state"] = relay._state.clone()
    state["_error"] = relay._error.clone()
    return state


def bits(t: torch.Tensor) -> torch.Tensor:
    """A bit-pattern view in which every NaN reads as one canonical NaN (a NaN's payload bits
    are implementation-defined across torch's own CPU and CUDA casts); -0.0 and 0.0 differ."""
    t = t.clone(memory_format=torch.contiguous_format)  # dense strides, even for size-1 dims
    if t.dtype.is_floating_point:
        t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    return t.reshape(-1).view(torch.uint8)


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(bits(a[name]), bits(b[name])), f"{name} differs"


# ---- strided views: the same values, laid out the way callers' views can be -----------------

GAP = 101  # what the memory between a view's elements holds: reading it instead shows


@st.composite
def layouts(draw, ndim: int):
    """How to lay out an ndim tensor: its dims' order in memory, and per dim a step (every
    step-th element) and a start offset. Identity order, steps 1, offsets 0 is contiguous."""
    order = tuple(draw(st.permutations(range(ndim))))
    steps = tuple(draw(st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim)))
    starts = tuple(draw(st.lists(st.integers(0, 2), min_size=ndim, max_size=ndim)))
    return order, steps, starts


def strided_copy(t: torch.Tensor, layout) -> torch.Tensor:
    """A view holding `t`'s values in `layout`, inside a larger buffer filled with GAP."""
    order, steps, starts = layout
    full = [start + step * n for n, step, start in zip(t.shape, steps, starts)]
    memory = torch.full([full[d] for d in order], GAP, dtype=t.dtype, device=t.device)
    logical = memory.permute([order.index(d) for d in range(t.dim())])
    view = logical[tuple(slice(start, start + step * n, step) for n, step, start in zip(t.shape, steps, starts))]
    view.copy_(t)
    return view
