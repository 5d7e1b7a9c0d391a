"""The real model in bf16 on the GPU, through captured graphs, against transformers' own GGUF
load in bf16: the first 16 greedy tokens of every test prompt must match; beyond that, bf16
near-ties may flip a token (different GEMM shapes round differently), so the first divergence
per prompt is printed for the report, with the two candidates' logit gap.

The GGUF comes from `$GRAPHRELAY_GGUF` or the installed package (tools/gpu_check.sh).
"""

from __future__ import annotations

import pytest
import torch

from graphrelay.capture.model.checkpoint import read_gguf, resolve_gguf_path
from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.serving.loop import ServingLoop
from graphrelay.capture.model.text import TextCodec
from graphrelay.capture.serving.workloads import Request

pytestmark = pytest.mark.gpu

PROMPTS = (
    "What is the capital of France?",
    "Hi",
    "Write a short story about a robot who learns to paint, in the style of a fairy tale, with a happy ending.",
    "List the planets of the solar system in order from the sun, and say one fact about each.",
)
NEW_TOKENS = 32
MUST_MATCH = 16


def test_bf16_graph_tokens_match_transformers():
    from transformers import AutoModelForCausalLM

    path = resolve_gguf_path(None)
    codec = TextCodec(path)
    prompts = [codec.encode_chat([{"role": "user", "content": t}]) for t in PROMPTS]

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.bfloat16).cuda().eval()
    expected, gaps = [], []
    for ids in prompts:
        x = torch.tensor([ids], device="cuda")
        with torch.no_grad():
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=codec.stop_tokens[0], output_scores=True,
                              return_dict_in_generate=True)
        expected.append(out.sequences[0, x.shape[1]:].tolist())
        top2 = [s[0].float().topk(2).values for s in out.scores]
        gaps.append([float(v[0] - v[1]) for v in top2])
    del hf
    torch.cuda.empty_cache()

    config, weights = read_gguf(path, max_seq_len=256, dtype="bfloat16")
    engine = Engine(EngineConfig(config, max_reqs=3, max_batch=4, max_tokens=256, device="cuda"), weights=weights)
    engine.capture()
    requests = [Request(id=str(i), prompt=p, max_new_tokens=NEW_TOKENS) for i, p in enumerate(prompts)]
    result = ServingLoop(engine, "overlap").run(requests)
    assert result.stats.graphs

    for i, want in enumerate(expected):
        got = result.outputs[str(i)].tokens
        first = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        where = "identical" if first is None else f"first divergence at token {first} (HF top-2 logit gap there {gaps[i][first]:.4f})"
        print(f"prompt {i}: {where}; ours {codec.decode(got)!r}")
        assert got[:MUST_MATCH] == want[:MUST_MATCH], f"prompt {i}: {where}"
    assert "Paris" in codec.decode(result.outputs["0"].tokens)
