"""Shared builders for relay tests: configs with every field, random payloads, snapshots."""

from __future__ import annotations

import torch

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
    t = t.contiguous()
    if t.dtype.is_floating_point:
        t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    return t.reshape(-1).view(torch.uint8)


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(bits(a[name]), bits(b[name])), f"{name} differs"
