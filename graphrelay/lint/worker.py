"""`python -m graphrelay.lint.worker FILE.py:NAME RESULT.json`: lint one target and write the
outcome to RESULT.json, `{"report": {...}}` or `{"error": "reason"}`.

`graphrelay lint` starts one of these per target. The outcome goes to a file, not stdout,
because the step may print; and a worker that exits or is killed before writing it leaves no
file, which the command reports as the target not being linted.
"""

from __future__ import annotations

import json
import os
import sys

from graphrelay.lint.targets import TargetError, lint_target


def main(argv: list[str]) -> None:
    target, result_path = argv
    try:
        outcome = {"report": lint_target(target).to_dict()}
    except TargetError as exc:
        outcome = {"error": str(exc)}
    # Written whole, then renamed: a worker killed mid-write leaves no half-read outcome.
    partial = result_path + ".partial"
    with open(partial, "w") as file:
        json.dump(outcome, file)
    os.replace(partial, result_path)
    sys.stdout.flush()
    sys.stderr.flush()
    # NOTE: not a normal exit: threads the step left running would keep the process alive
    # (until the command's timeout) after the outcome is already written.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
