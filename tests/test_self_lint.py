"""The project's own relay ops, mirror write and decode step pass the capture linter."""

from __future__ import annotations

import pytest

from graphrelay.lint import lint_step
from graphrelay.tools import lint_targets


@pytest.mark.parametrize("name", lint_targets.TARGETS)
def test_project_step_is_capturable(name):
    step, inputs = getattr(lint_targets, name)()
    report = lint_step(step, inputs, target=name)
    assert report.ok, report.format()
