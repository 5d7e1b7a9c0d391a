"""Where in the user's code an op was triggered: a walk of the live Python stack.

The op is seen deep inside torch (a dispatch or function mode handler); the line a person
must change is the innermost frame that is neither torch nor this linter.
"""

from __future__ import annotations

import importlib.util
import linecache
import os
import sys
from typing import NamedTuple, Optional

import torch

from graphrelay.lint.report import SourceLocation


def _package_dir(name: str) -> Optional[str]:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], "")


_TORCH_DIR = os.path.join(os.path.dirname(torch.__file__), "")
_LINT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")
# NOTE: on CPU, Triton kernels run under TRITON_INTERPRET=1, whose Python emulation copies
# tensors to numpy and back. On a GPU the launch is one graph node, so ops issued from inside
# the interpreter are not the user's hazards.
_TRITON_DIR = _package_dir("triton")


class Site(NamedTuple):
    """The user's line for the op being seen, and whether it runs inside a kernel launch."""

    location: Optional[SourceLocation]
    in_kernel_launch: bool


def is_internal(filename: str) -> bool:
    """Whether a frame belongs to torch or to this linter, never to the user."""
    return filename.startswith(_TORCH_DIR) or filename.startswith(_LINT_DIR)


def _display_path(filename: str) -> str:
    relative = os.path.relpath(filename) if os.path.isabs(filename) else filename
    return filename if relative.startswith("..") else relative


def current_site() -> Site:
    """Walk outward from the caller to the first user frame; note any Triton frame on the way
    or beyond it (the interpreter runs kernel bodies, which live in user files, as Python)."""
    location = None
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if _TRITON_DIR and filename.startswith(_TRITON_DIR):
            return Site(None, True)
        if location is None and not is_internal(filename):
            lineno = frame.f_lineno
            location = SourceLocation(
                filename=_display_path(filename),
                lineno=lineno,
                function=frame.f_code.co_name,
                line=linecache.getline(filename, lineno).strip(),
            )
        frame = frame.f_back
    return Site(location, False)
