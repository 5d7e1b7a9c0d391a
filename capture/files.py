"""Files the engine and its tools write."""

from __future__ import annotations

from pathlib import Path


def write_atomically(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, then rename: a failed write leaves no half file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_bytes(data)
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"cannot write {path}: {exc.strerror}") from None
