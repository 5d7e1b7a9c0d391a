"""The README's adopter example runs as written (captured on a GPU, eager on a CPU) and does
what it says: each iteration feeds the previous one's tokens back through the relay."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _example() -> str:
    match = re.search(r"<!-- adopter-example -->\n```python\n(.*?)```", README.read_text(), re.S)
    assert match, "README lost its adopter example (marked <!-- adopter-example -->)"
    return match.group(1)


def test_readme_adopter_example_runs_and_relays_tokens():
    printed, namespace = io.StringIO(), {"__name__": "readme_example"}
    with contextlib.redirect_stdout(printed):
        exec(compile(_example(), str(README), "exec"), namespace)
    lines = printed.getvalue().strip().splitlines()
    assert [int(line.split()[0]) for line in lines] == [0, 1, 2]
    # Each line: iteration [slots] [tokens] [seq lens]
    reads = [[[int(x) for x in group.split(",")] for group in re.findall(r"\[(.*?)\]", line)] for line in lines]
    assert all(slots == [1, 2] for slots, _, _ in reads)  # padding rows never reach the host
    # On a GPU the warm-up ran one iteration before capture, so everything starts one further.
    warm = 1 if torch.cuda.is_available() else 0
    assert [lens for _, _, lens in reads] == [[4 + i + warm, 10 + i + warm] for i in range(3)]
    # Greedy through the example's model: each iteration's tokens are its argmax of the tokens
    # the relay carried from the iteration before (the prefill's 5 and 7 first).
    model = namespace["model"]
    tokens = torch.tensor([5, 7], device=namespace["device"])
    with torch.no_grad():
        for _ in range(warm):
            tokens = model(tokens).argmax(-1)
        for _, got, _ in reads:
            tokens = model(tokens).argmax(-1)
            assert got == tokens.tolist()
