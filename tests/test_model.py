"""capture.model: decode agrees with a cache-free reference, padding is inert, decode is
capturable (no host syncs), and configs and inputs are validated."""

from __future__ import annotations

import msgspec
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphrelay.capture.model.model import MODEL_PRESETS, LlamaModel, ModelConfig
from model_reference import reference_logits
from graphrelay.capture.iteration.sampling import sample

MAX_REQS = 6
# slot -> prompt; slots deliberately sparse so row order != slot order.
PROMPTS = {1: [1, 2, 3], 3: [9, 8, 7, 6, 5, 4], 5: [100], 2: [44, 55, 66, 77]}


def prefilled_model(config: ModelConfig = ModelConfig()) -> tuple[LlamaModel, dict[int, list[int]]]:
    """A fresh tiny model with every PROMPTS entry prefilled; returns it and each slot's tokens
    so far (prompt + first greedy token)."""
    model = LlamaModel(config, MAX_REQS, "cpu")
    sequences = {}
    for slot, prompt in PROMPTS.items():
        logits = model.prefill([slot], [prompt])[0]
        sequences[slot] = prompt + [int(logits.argmax())]
    return model, sequences


def decode_rows(model, rows, padding=()):
    """Decode (token, slot, seq_len) rows followed by padding rows; int32 like the relay."""
    rows = list(rows) + list(padding)
    tokens, slots, seq_lens = (torch.tensor(col, dtype=torch.int32) for col in zip(*rows))
    return model.decode(tokens, slots, seq_lens)


def live_rows(sequences, slots):
    # Input token is the last one generated; seq_len = tokens already cached = len - 1.
    return [(sequences[s][-1], s, len(sequences[s]) - 1) for s in slots]


def real_cache_rows(model):
    return [t[1:].clone() for t in model.kv_cache.keys + model.kv_cache.values]


# ----------------------------------------------------------------------------------------------
# Agreement with the reference


def test_prefill_matches_reference():
    model = LlamaModel(ModelConfig(), MAX_REQS, "cpu")
    for slot, prompt in PROMPTS.items():
        logits = model.prefill([slot], [prompt])[0]
        assert logits.shape == (512,) and logits.dtype == torch.float32
        torch.testing.assert_close(logits, reference_logits(model, prompt), rtol=1e-4, atol=1e-4)


def test_decode_matches_reference_over_steps():
    model, sequences = prefilled_model()
    slots = [3, 1, 5, 2]
    padding = [(0, 0, 1)]  # bucket of 5
    for _ in range(6):
        logits = decode_rows(model, live_rows(sequences, slots), padding)
        assert logits.shape == (5, 512) and logits.dtype == torch.float32
        for row, slot in enumerate(slots):
            expected = reference_logits(model, sequences[slot])
            torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4)
            assert int(logits[row].argmax()) == int(expected.argmax())
            sequences[slot].append(int(logits[row].argmax()))


def test_decode_accepts_int64_inputs_and_out_buffer():
    model_a, seq = prefilled_model()
    model_b, _ = prefilled_model()
    rows = live_rows(seq, [1, 3])
    tokens, slots, seq_lens = (torch.tensor(col, dtype=torch.int64) for col in zip(*rows))
    out = torch.full((2, 512), float("nan"))
    result = model_a.decode(tokens, slots, seq_lens, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert torch.equal(out, decode_rows(model_b, rows))


def test_decode_then_prefill_into_reused_slot_forgets_old_request():
    model, sequences = prefilled_model()
    decode_rows(model, live_rows(sequences, [1]))
    new_prompt = [7, 7]
    model.prefill([1], [new_prompt])
    logits = decode_rows(model, [(5, 1, 2)])
    torch.testing.assert_close(logits[0], reference_logits(model, new_prompt + [5]), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------------
# Padding and batch composition


def test_padding_rows_never_change_real_rows():
    slots = [2, 5]
    results = []
    garbage = [
        [(0, 0, 1)] * 3,  # the relay's default padding
        [(511, 0, 255), (17, 0, 0), (300, 0, 128)],  # any in-range garbage
    ]
    for padding in garbage:
        model, sequences = prefilled_model()
        # Poison the padding slot: if a real row read it, its logits would be NaN.
        for cache in model.kv_cache.keys + model.kv_cache.values:
            cache[0] = float("nan")
        logits = decode_rows(model, live_rows(sequences, slots), padding)
        results.append((logits[: len(slots)], real_cache_rows(model)))
    unpadded_model, sequences = prefilled_model()
    unpadded = decode_rows(unpadded_model, live_rows(sequences, slots))

    (logits_a, cache_a), (logits_b, cache_b) = results
    assert torch.isfinite(logits_a).all()
    assert torch.equal(logits_a, logits_b), "padding garbage changed a real row's logits"
    assert all(torch.equal(a, b) for a, b in zip(cache_a, cache_b)), "padding changed a real cache row"
    # Without padding the bucket is smaller, so CPU GEMM blocking (and the last ulp) may differ.
    torch.testing.assert_close(logits_a, unpadded, rtol=1e-5, atol=1e-5)
    for a, b in zip(cache_a, real_cache_rows(unpadded_model)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_decode_is_batch_composition_independent():
    """Same bucket shape: bitwise. Different bucket sizes: tight tolerance (CPU GEMM kernels
    change their blocking with the row count, e.g. 1..3 rows vs 4+ rows here)."""
    target = 3
    alone_model, sequences = prefilled_model()
    alone = decode_rows(alone_model, live_rows(sequences, [target]), [(0, 0, 1)] * 3)[0]

    batched_model, _ = prefilled_model()
    # Target in the middle of a full bucket of 4 with other live requests around it.
    batched = decode_rows(batched_model, live_rows(sequences, [5, 1, target, 2]))[2]
    assert torch.equal(alone, batched)

    single_model, _ = prefilled_model()
    single = decode_rows(single_model, live_rows(sequences, [target]))[0]
    torch.testing.assert_close(single, batched, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Capturability: no host syncs or data-dependent ops in decode + sample


class HostSyncDetector(TorchDispatchMode):
    """Records aten ops that would sync or size a tensor by data under CUDA graph capture."""

    FORBIDDEN = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2"}

    def __init__(self):
        super().__init__()
        self.hits = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        indices = args[1] if name in ("aten::index", "aten::index_put", "aten::index_put_") else ()
        if name in self.FORBIDDEN or any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()
        ):
            self.hits.append(name)
        return func(*args, **kwargs)


def test_detector_flags_a_host_sync():
    with HostSyncDetector() as detector:
        x = torch.arange(4)
        x[x > 1].sum().item()
    assert "aten::_local_scalar_dense" in detector.hits and "aten::index" in detector.hits


def test_decode_and_sample_have_no_host_syncs():
    model, sequences = prefilled_model()
    tokens, slots, seq_lens = (
        torch.tensor(col, dtype=torch.int32) for col in zip(*live_rows(sequences, [1, 3]), (0, 0, 1))
    )
    logits_out = torch.empty(3, 512)
    tokens_out = torch.empty(3, dtype=torch.int64)
    with HostSyncDetector() as detector:
        logits = model.decode(tokens, slots, seq_lens, out=logits_out)
        for max_top_k in (None, 4):
            sample(
                logits,
                torch.tensor([0.0, 0.8, 0.0]),
                torch.tensor([0, 5, 0], dtype=torch.int32),
                torch.tensor([1, 2, 0]),
                seq_lens,
                out=tokens_out,
                max_top_k=max_top_k,
            )
    assert detector.hits == []


# ----------------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize(
    "slot, tokens, match",
    [
        (0, [1, 2], "slot 0 is padding"),
        (MAX_REQS + 1, [1], "slot must be an int in 1..6"),
        (True, [1], "slot must be an int"),
        (1, [], "at least one token"),
        (1, list(range(257)), "max_seq_len"),
        (1, [1, 512], "token id outside 0..511"),
        (1, [-1], "token id outside"),
        (1, [1.5], "token id outside"),
    ],
)
def test_prefill_rejects_bad_input(slot, tokens, match):
    model = LlamaModel(ModelConfig(), MAX_REQS, "cpu")
    with pytest.raises(ValueError, match=match):
        model.prefill([slot], [tokens])
    assert all(not cache.any() for cache in model.kv_cache.keys), "a rejected prefill wrote the cache"


def test_batched_chunked_prefill_equals_one_prompt_at_a_time():
    """Three prompts in one padded forward, and the longest again in two chunks, give the same
    last-token logits as prefilling each prompt alone, and the same cache rows."""
    prompts = {1: [3, 1, 4, 1, 5, 9, 2], 2: [6, 5], 3: [3, 5, 8, 9, 7, 9, 3, 2, 3]}
    alone = LlamaModel(ModelConfig(), MAX_REQS, "cpu")
    expected = {s: alone.prefill([s], [p])[0] for s, p in prompts.items()}
    batched = LlamaModel(ModelConfig(), MAX_REQS, "cpu")
    got = batched.prefill(list(prompts), list(prompts.values()))
    for row, slot in enumerate(prompts):
        torch.testing.assert_close(got[row], expected[slot], rtol=1e-5, atol=1e-5)
    chunked = LlamaModel(ModelConfig(), MAX_REQS, "cpu")
    chunked.prefill([3, 2], [prompts[3][:4], prompts[2]])
    tail = chunked.prefill([3], [prompts[3][4:]], [4])[0]
    torch.testing.assert_close(tail, expected[3], rtol=1e-5, atol=1e-5)
    for layer in range(ModelConfig().num_layers):
        torch.testing.assert_close(chunked.kv_cache.keys[layer][3], alone.kv_cache.keys[layer][3], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batched.kv_cache.values[layer][1:4], alone.kv_cache.values[layer][1:4], rtol=1e-5, atol=1e-5)
    assert not batched.kv_cache.keys[0][4:].any(), "padding tokens wrote a request's rows"


def test_prefill_rejects_mismatched_batches():
    model = LlamaModel(ModelConfig(), MAX_REQS, "cpu")
    with pytest.raises(ValueError, match="one chunk and one start per slot"):
        model.prefill([1, 2], [[1]])
    with pytest.raises(ValueError, match="slots repeat"):
        model.prefill([1, 1], [[1], [2]])
    with pytest.raises(ValueError, match="start -1"):
        model.prefill([1], [[1]], [-1])


def test_decode_rejects_bad_metadata():
    model = LlamaModel(ModelConfig(), MAX_REQS, "cpu")
    good = torch.tensor([1, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match="slots must be 1-D with the same length"):
        model.decode(good, torch.tensor([1, 0, 0]), good)
    with pytest.raises(ValueError, match="seq_lens must be int32 or int64"):
        model.decode(good, good, torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="out must be a float32"):
        model.decode(good, good, good, out=torch.empty(2, 512, dtype=torch.float64))


# ----------------------------------------------------------------------------------------------
# Config, presets, weights


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"vocab_size": 0}, "vocab_size"),
        ({"num_layers": -1}, "num_layers"),
        ({"hidden_size": True}, "hidden_size"),
        ({"num_heads": 4, "num_kv_heads": 3}, "num_heads"),
        ({"hidden_size": 66, "num_heads": 4}, "head_dim"),
        ({"head_dim": 7}, "head_dim"),
        ({"rope_theta": 0.0}, "rope_theta"),
        ({"rms_eps": -1e-6}, "rms_eps"),
        ({"dtype": "int8"}, "dtype"),
        ({"seed": -1}, "seed"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"ModelConfig.{field}"):
        ModelConfig(**overrides)


def test_config_derives_head_dim_and_round_trips_json():
    assert ModelConfig().head_dim == 16
    explicit = ModelConfig(hidden_size=64, num_heads=4, head_dim=32)
    assert explicit.head_dim == 32
    assert msgspec.json.decode(msgspec.json.encode(explicit), type=ModelConfig) == explicit
    with pytest.raises(ValueError, match="ModelConfig.vocab_size"):
        msgspec.json.decode(b'{"vocab_size": 0}', type=ModelConfig)


def test_presets():
    assert ModelConfig.preset("tiny") == ModelConfig()
    small, medium = ModelConfig.preset("small"), ModelConfig.preset("medium")
    assert (small.hidden_size, small.num_layers, small.head_dim, small.dtype) == (1024, 8, 64, "bfloat16")
    assert (medium.hidden_size, medium.num_layers, medium.kv_groups) == (2048, 16, 2)
    smol = ModelConfig.preset("smollm2-135m")
    assert (smol.vocab_size, smol.num_layers, smol.num_heads, smol.num_kv_heads, smol.head_dim) == (49152, 30, 9, 3, 64)
    assert smol.tie_word_embeddings and smol.rope_theta == 100000.0
    assert set(MODEL_PRESETS) == {"tiny", "small", "medium", "llama-1b", "smollm2-135m"}
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        ModelConfig.preset("huge")


def test_weights_are_seeded():
    prompt = [5, 6, 7]
    a = LlamaModel(ModelConfig(seed=3), 1, "cpu").prefill([1], [prompt])[0]
    b = LlamaModel(ModelConfig(seed=3), 1, "cpu").prefill([1], [prompt])[0]
    c = LlamaModel(ModelConfig(seed=4), 1, "cpu").prefill([1], [prompt])[0]
    assert torch.equal(a, b) and not torch.allclose(a, c)
    # Unit-scale weights keep logits sane rather than saturated or vanishing.
    assert 0.3 < float(a.std()) < 3.0


def test_tied_embeddings_and_half_precision_run():
    model = LlamaModel(ModelConfig(tie_word_embeddings=True, dtype="bfloat16"), 2, "cpu")
    assert model.lm_head is model.embed
    assert model.kv_cache.keys[0].dtype == torch.bfloat16
    assert model.kv_cache.keys[0].shape == (3, 256, 2, 16)
    prompt = [4, 9, 2]
    model.prefill([2], [prompt])
    logits = decode_rows(model, [(11, 2, 3), (0, 0, 1)])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    # bf16 rounding differs between paths, so compare loosely.
    torch.testing.assert_close(logits[0], reference_logits(model, prompt + [11]), rtol=0.1, atol=0.1)
