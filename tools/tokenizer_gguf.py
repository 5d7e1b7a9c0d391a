"""A tokenizer-only copy of a GGUF file: every metadata key (the vocabulary, merges, special
token ids, chat template, model sizes), no tensors.

    python -m graphrelay.tools.tokenizer_gguf SRC.gguf DST.gguf     (default SRC: SmolLM2's)

What it is for: `graphrelay serve --weights random --tokenizer DST.gguf` serves the model's
architecture with random weights and the real tokenizer and chat template, so the HTTP server,
its detokenization and its benchmarks run as with the real model wherever the weights cannot
go. SmolLM2-135M's GGUF is 98 MB, over a lent GPU machine's 64 MiB transfer limit per call;
its tokenizer-only copy is 1.7 MB. transformers builds the same tokenizer from either file.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf  # the `model` extra


def write_tokenizer_gguf(src: str | Path, dst: str | Path) -> None:
    """Copy `src`'s metadata, not its tensors, into a new GGUF at `dst`."""
    reader = gguf.GGUFReader(str(src))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    writer = gguf.GGUFWriter(str(dst), arch)  # writes general.architecture itself
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the file header's own fields: the writer sets them
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            values = [_value(field, i, field.types[1]) for i in field.data]
            writer.add_array(name, values)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(name, _value(field, field.data[0], kind))
        else:
            writer.add_key_value(name, _value(field, field.data[0], kind), kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _value(field, index: int, kind):
    part = field.parts[index]
    if kind == gguf.GGUFValueType.STRING:
        # NOTE: a vocabulary may hold byte strings that are not valid UTF-8; surrogateescape
        # writes the same bytes back.
        return bytes(part).decode("utf-8", "surrogateescape")
    return part.tolist()[0]


def main(argv: list[str] | None = None) -> int:
    from graphrelay.capture.model.checkpoint import ModelFileError, resolve_gguf_path

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) not in (1, 2) or args[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    try:
        src = resolve_gguf_path(args[0] if len(args) == 2 else None)
    except ModelFileError as exc:
        print(f"tokenizer_gguf: {exc}", file=sys.stderr)
        return 2
    dst = Path(args[-1])
    if dst.resolve() == Path(src).resolve():
        print("tokenizer_gguf: DST must not be SRC (the copy would overwrite the model)", file=sys.stderr)
        return 2
    write_tokenizer_gguf(src, dst)
    print(f"{dst}: {dst.stat().st_size:,} bytes, the tokenizer of {src} ({Path(src).stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
