"""The `graphrelay` command: `serve` (the main job), `generate`, `lint`, `bench`.

Each subcommand lives with the code it drives and is imported only when asked for, so
`graphrelay lint` works without the capture layer loaded and the library stays import-light.
"""

from __future__ import annotations

import os
import sys

from graphrelay.tools.bench import SUBCOMMANDS

# The bench entry lists every benchmark the bench command plugs in (its registry imports nothing heavy).
def _bench_entry(width: int = 110) -> str:
    words = ["benchmarks:", *(f"`bench {name}`," for name in SUBCOMMANDS), "see", "`graphrelay", "bench", "--help`"]
    lines = [""]
    for word in words:  # wrapped at whole words, so no benchmark name is split over two lines
        if len(lines[-1]) + len(word) + 1 > width - 12:
            lines.append("")
        lines[-1] = f"{lines[-1]} {word}".lstrip()
    return ("\n" + " " * 12).join(lines)


USAGE = f"""usage: graphrelay {{serve,generate,lint,bench}} [ARGS]

  serve     run the overlap-scheduled decode loop on a workload (default: the real model on chat prompts),
            or with --port PORT serve it over an OpenAI-compatible HTTP API
  generate  print the model's completion of one prompt
  lint      check that a step function is capturable into a CUDA graph, without a GPU
  bench     {_bench_entry()}

`graphrelay SUBCOMMAND --help` for each one's options."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from graphrelay.capture.serving.cli import serve_main

        return serve_main(rest)
    if command == "generate":
        from graphrelay.capture.serving.cli import generate_main

        return generate_main(rest)
    if command == "lint":
        # The linter runs steps on CPU tensors: Triton kernels must run in its interpreter,
        # which is chosen when the kernels are defined, so before graphrelay is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from graphrelay.lint.cli import lint_main

        return lint_main(rest)
    if command == "bench":
        from graphrelay.tools.bench import bench_main

        return bench_main(rest)
    print(f"graphrelay: unknown subcommand {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
