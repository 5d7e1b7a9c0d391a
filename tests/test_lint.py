"""The capture linter: each hazard class is flagged at the user's line, clean fixed-shape steps
give no findings, value-dependent control flow and shapes are caught by the two-run
comparison, and `graphrelay lint` exits 0/1/2 with messages a person can act on.

A missed hazard means an engine author captures a graph that fails (host sync) or, worse,
replays the wrong branch or shape silently; a false positive teaches them to ignore the tool.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from graphrelay.lint import Finding, HazardKind, LintError, LintReport, lint_step
from graphrelay.lint.cli import lint_main
from graphrelay.lint.inputs import other_values
from lint_examples import bad_steps, broken_steps, good_steps, kernel_steps

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "tests", "lint_examples")
BAD = os.path.join(EXAMPLES, "bad_steps.py")
GOOD = os.path.join(EXAMPLES, "good_steps.py")
BROKEN = os.path.join(EXAMPLES, "broken_steps.py")


def marked_line(func, marker: str = "# <- hazard") -> int:
    lines, first = inspect.getsourcelines(func)
    hits = [first + i for i, text in enumerate(lines) if marker in text]
    assert len(hits) == 1, f"{func.__name__} must mark exactly one line with {marker!r}"
    return hits[0]


def lint_factory(factory):
    step, example_inputs, *alt = factory()
    return lint_step(step, example_inputs, alt_inputs=alt[0] if alt else None, target=factory.__name__)


def only_finding(report, kind: HazardKind) -> Finding:
    matches = [f for f in report.findings if f.kind is kind]
    assert len(matches) == 1, report.format()
    return matches[0]


H = HazardKind
BAD_CASES = [
    # (factory, kind, op, function holding the marked line or None for the factory itself)
    ("item_sync", H.HOST_SYNC, "Tensor.item", None),
    ("bool_branch", H.HOST_SYNC, "Tensor.__bool__", None),
    ("int_of_tensor", H.HOST_SYNC, "Tensor.__int__", None),
    ("index_of_tensor", H.HOST_SYNC, "Tensor.__index__", None),
    ("tolist_sync", H.HOST_SYNC, "Tensor.tolist", None),
    ("numpy_sync", H.HOST_SYNC, "Tensor.numpy", None),
    ("cpu_copy", H.HOST_SYNC, "Tensor.cpu", None),
    ("to_cpu_string", H.HOST_SYNC, 'Tensor.to("cpu")', None),
    ("to_cpu_keyword", H.HOST_SYNC, 'Tensor.to("cpu")', None),
    ("cuda_synchronize", H.HOST_SYNC, "torch.cuda.synchronize", None),
    ("cudart_stream_query", H.HOST_SYNC, "cudart.cudaStreamQuery", None),
    ("print_tensor", H.HOST_SYNC, "Tensor.__format__", None),
    ("sync_in_helper", H.HOST_SYNC, "Tensor.item", "_max_of"),
    ("value_dependent_shape", H.HOST_SYNC, "aten._local_scalar_dense.default", None),
    ("nonzero_shape", H.DATA_DEPENDENT_SHAPE, "aten.nonzero.default", None),
    ("bool_mask_index", H.DATA_DEPENDENT_SHAPE, "aten.index.Tensor", None),
    ("bool_mask_assign", H.DATA_DEPENDENT_SHAPE, "aten.index_put_.default", None),
    ("masked_select_shape", H.DATA_DEPENDENT_SHAPE, "aten.masked_select.default", None),
    ("unique_shape", H.DATA_DEPENDENT_SHAPE, "aten._unique2.default", None),
    ("repeat_interleave_unsized", H.DATA_DEPENDENT_SHAPE, "aten.repeat_interleave.Tensor", None),
    ("one_hot_unsized", H.DATA_DEPENDENT_SHAPE, "torch.nn.functional.one_hot", None),
    ("multinomial_sampling", H.HOST_SYNC, "aten.multinomial.default", None),
    ("python_list_tensor", H.PYTHON_DATA_TENSOR, "torch.tensor", None),
    ("as_tensor_list", H.PYTHON_DATA_TENSOR, "torch.as_tensor", None),
    ("from_numpy_array", H.PYTHON_DATA_TENSOR, "torch.from_numpy", None),
    ("list_index", H.PYTHON_DATA_TENSOR, "Tensor.__getitem__", None),
    ("list_column_index", H.PYTHON_DATA_TENSOR, "Tensor.__getitem__", None),
    ("range_index", H.PYTHON_DATA_TENSOR, "Tensor.__getitem__", None),
    ("numpy_index", H.PYTHON_DATA_TENSOR, "Tensor.__getitem__", None),
    ("list_index_assign", H.PYTHON_DATA_TENSOR, "Tensor.__setitem__", None),
]


@pytest.mark.parametrize("name, kind, op, marked_in", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_each_hazard_is_flagged_once_at_the_users_line(name, kind, op, marked_in):
    factory = getattr(bad_steps, name)
    report = lint_factory(factory)
    assert not report.ok
    # Exactly one static finding: `item` must not also appear as `_local_scalar_dense`.
    static = [f for f in report.findings if f.kind is not H.VALUE_DEPENDENT]
    assert len(static) == 1, report.format()
    finding = static[0]
    assert (finding.kind, finding.op) == (kind, op)
    assert os.path.samefile(finding.location.filename, BAD)
    assert finding.location.lineno == marked_line(getattr(bad_steps, marked_in or name))
    assert finding.location.line.endswith("# <- hazard")
    assert finding.fix


@pytest.mark.parametrize("factory", good_steps.FACTORIES, ids=lambda f: f.__name__)
def test_fixed_shape_steps_give_no_findings(factory):
    report = lint_factory(factory)
    assert report.findings == [], report.format()
    assert report.ok
    assert report.ops_recorded > 5


def test_value_dependent_branch_is_a_sync_and_a_divergence():
    report = lint_factory(bad_steps.value_dependent_branch)
    sync = only_finding(report, H.HOST_SYNC)
    assert sync.op == "Tensor.__bool__"
    assert sync.location.lineno == marked_line(bad_steps.value_dependent_branch)
    divergence = only_finding(report, H.VALUE_DEPENDENT)
    assert divergence.location.line == "return x * 2"
    assert divergence.other_location.lineno == marked_line(bad_steps.value_dependent_branch, "# <- other branch")
    text = divergence.format()
    assert "aten.mul.Tensor" in text and "aten.add.Tensor" in text and "return x + 1" in text


def test_value_dependent_shape_is_found_with_generated_values():
    report = lint_factory(bad_steps.value_dependent_shape)
    divergence = only_finding(report, H.VALUE_DEPENDENT)
    assert divergence.op == "aten.slice.Tensor"
    assert divergence.location.lineno == marked_line(bad_steps.value_dependent_shape)
    assert "output shape [6] with the example values" in divergence.detail


def test_same_branch_for_both_value_sets_is_no_divergence():
    step, example, _ = bad_steps.value_dependent_branch()
    report = lint_step(step, example, alt_inputs=(example[0] * 3,))
    assert report.kinds() == [H.HOST_SYNC]


def test_inputs_are_cloned_so_in_place_steps_see_the_same_start():
    step, example = good_steps.decode_step()
    before = [t.clone() for t in example]
    assert lint_step(step, example).ok
    assert all(torch.equal(a, b) for a, b in zip(example, before))

    def counts_calls(x):
        x.add_(1)
        return torch.arange(8)[: int(x)]

    # Had the second run seen the first run's increment, the slice would differ: no divergence.
    report = lint_step(counts_calls, (torch.tensor(3),), alt_inputs=(torch.tensor(3),))
    assert report.kinds() == [H.HOST_SYNC]


def test_linter_internal_ops_are_not_recorded():
    report = lint_step(lambda x: x * 2, (torch.ones(3),))
    assert report.ok and report.ops_recorded == 1


def test_triton_interpreter_internals_are_not_the_users_ops():
    report = lint_factory(kernel_steps.triton_launch)
    assert report.ok, report.format()
    assert report.ops_recorded == 1


def test_a_step_of_kernel_launches_alone_is_linted_not_empty():
    report = lint_factory(kernel_steps.triton_launch_only)
    assert report.ok and report.ops_recorded == 0
    assert report.summary().endswith("capturable, no hazards (0 ops checked, plus Triton kernel launches)")


@pytest.mark.parametrize("name", ["generator_step", "does_nothing"])
def test_a_step_that_runs_no_ops_gets_no_verdict(name):
    step, example = getattr(broken_steps, name)()
    with pytest.raises(LintError, match=r"ran no tensor ops \(a generator function, or a step that does nothing\)"):
        lint_step(step, example)


def test_a_step_that_calls_sys_exit_raises_lint_error_naming_its_line():
    step, example = broken_steps.exits_cleanly()
    with pytest.raises(LintError, match=r"raised SystemExit: 0 on the example inputs at .*broken_steps.py:\d+: sys.exit"):
        lint_step(step, example)


def test_python_data_index_is_named_by_the_users_call():
    finding = only_finding(lint_factory(bad_steps.list_column_index), H.PYTHON_DATA_TENSOR)
    assert "CPU int64 tensor of shape [2] from Python data" in finding.detail
    assert finding.fix.startswith("build the index tensor once, outside the step, on the device")


def test_bool_list_index_is_python_data_and_a_mask():
    report = lint_step(lambda x: x[[True, False, True, True]], (torch.ones(4),))
    assert {(f.kind, f.op) for f in report.findings} == {
        (H.PYTHON_DATA_TENSOR, "Tensor.__getitem__"),
        (H.DATA_DEPENDENT_SHAPE, "aten.index.Tensor"),
    }


def test_report_survives_json():
    report = lint_factory(bad_steps.value_dependent_branch)
    assert report.findings[-1].other_location is not None
    assert LintReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report


def test_device_moves_that_stay_on_the_device_are_fine():
    def step(x, idx):
        return x.to(x.device) + x.to(torch.float64).to(device=x.device).float() + x[idx].sum()

    assert lint_step(step, (torch.randn(4), torch.tensor([3, 0]))).ok


def test_patched_host_calls_are_restored():
    synchronize = torch.cuda.synchronize
    lint_factory(bad_steps.cuda_synchronize)
    assert torch.cuda.synchronize is synchronize


def test_generated_values_keep_layout_and_range_but_differ():
    slots = torch.tensor([[3, 5], [0, 7]])
    probs = torch.tensor([0.25, 0.5, float("-inf")])
    mask = torch.tensor([True, False, True, True])
    new_slots, new_probs, new_mask = other_values((slots, probs, mask), seed=1)
    for old, new in ((slots, new_slots), (probs, new_probs), (mask, new_mask)):
        assert (new.shape, new.dtype) == (old.shape, old.dtype)
    assert not torch.equal(new_slots, slots) and not torch.equal(new_probs, probs)
    assert 0 <= int(new_slots.min()) and int(new_slots.max()) <= 7
    assert 0.25 <= float(new_probs[:2].min()) and float(new_probs[:2].max()) <= 0.5
    assert new_probs[2] == float("-inf")
    constant = torch.full((3,), 0.125)
    (new_constant,) = other_values((constant,))
    assert not torch.equal(new_constant, constant) and bool((new_constant >= 0).all())


def test_mismatched_alt_inputs_are_refused():
    with pytest.raises(ValueError, match="shapes and dtypes"):
        lint_step(lambda x: x, (torch.ones(3),), alt_inputs=(torch.ones(4),))


def test_a_step_that_raises_names_its_line():
    step, example = bad_steps.raises_on_example()
    with pytest.raises(LintError, match=r"RuntimeError.*example inputs at .*bad_steps.py:\d+: return x @"):
        lint_step(step, example)


def test_report_text_is_actionable():
    text = lint_factory(bad_steps.item_sync).format()
    line = marked_line(bad_steps.item_sync)
    assert f"bad_steps.py:{line}: host-sync: Tensor.item" in text
    assert "| scale = x.max().item()  # <- hazard" in text
    assert "fix: keep the value on the device" in text
    assert text.endswith("item_sync: 1 capture hazard (1 host-sync)")


# --- the command line ---------------------------------------------------------------------


def test_cli_clean_target_exits_0(capsys):
    assert lint_main([f"{GOOD}:decode_step"]) == 0
    assert "decode_step: capturable, no hazards" in capsys.readouterr().out


def test_cli_hazards_exit_1_with_every_target_reported(capsys):
    assert lint_main([f"{GOOD}:top_p_sampling", f"{BAD}:tolist_sync", f"{BAD}:nonzero_shape"]) == 1
    out = capsys.readouterr().out
    assert "top_p_sampling: capturable" in out
    assert f"bad_steps.py:{marked_line(bad_steps.tolist_sync)}: host-sync: Tensor.tolist" in out
    assert "nonzero_shape: 2 capture hazards (1 data-dependent-shape, 1 value-dependent)" in out


def test_cli_alt_inputs_from_a_three_tuple(capsys):
    assert lint_main([f"{BAD}:value_dependent_branch"]) == 1
    assert "value-dependent" in capsys.readouterr().out


@pytest.mark.parametrize(
    "target, message",
    [
        ("no_such_file.py:f", "no such file: 'no_such_file.py'"),
        (BAD, "is not FILE.py:NAME"),
        (f"{BAD}:", "is not FILE.py:NAME"),
        (f"{BAD}:missing", "has no 'missing'; define `def missing(): return step, example_inputs`"),
        (f"{BAD}:NOT_CALLABLE", "NOT_CALLABLE is a int, not a callable"),
        (f"{BAD}:not_a_pair", "not_a_pair() returned a function; it must return (step, example_inputs)"),
        (f"{BAD}:step_not_callable", "returned a int as the step"),
        (f"{BAD}:raises_on_example", "the step raised RuntimeError"),
        (f"{REPO}/pyproject.toml:f", "is not a Python file"),
    ],
)
def test_cli_usage_errors_exit_2_without_traceback(capsys, target, message):
    assert lint_main([target]) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert "Traceback" not in captured.err + captured.out


def test_cli_error_outranks_hazards(capsys):
    assert lint_main([f"{BAD}:item_sync", f"{BAD}:missing"]) == 2
    assert "item_sync: 1 capture hazard" in capsys.readouterr().out


def test_cli_help_and_no_arguments(capsys):
    assert lint_main(["--help"]) == 0
    assert "usage: graphrelay lint [--timeout SECONDS] FILE.py:NAME" in capsys.readouterr().out
    assert lint_main([]) == 2
    assert "usage: graphrelay lint" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--timeout"], "not ''"),
        (["--timeout", "0", f"{GOOD}:decode_step"], "not '0'"),
        (["--timeout=-3", f"{GOOD}:decode_step"], "not '-3'"),
        (["--timeout", "soon", f"{GOOD}:decode_step"], "not 'soon'"),
        (["--timeout", "nan", f"{GOOD}:decode_step"], "not 'nan'"),
        (["--timeout", "5"], "no targets given"),
        (["--time", "5", f"{GOOD}:decode_step"], "unknown option '--time'"),
    ],
)
def test_cli_bad_options_exit_2(capsys, args, message):
    assert lint_main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "usage: graphrelay lint" in err


def test_cli_timeout_option_forms(capsys):
    assert lint_main(["--timeout=30", f"{GOOD}:decode_step", "--timeout", "45.5"]) == 0
    assert "decode_step: capturable" in capsys.readouterr().out


def could_not_lint(err: str, target: str) -> str:
    prefix = f"graphrelay lint: {BROKEN}:{target}: could not be linted: "
    lines = [line for line in err.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, err
    return lines[0][len(prefix):]


def test_cli_exiting_targets_cannot_hide_another_targets_hazard(capsys):
    targets = ["exits_cleanly", "exits_hard", "exits_in_factory", "aborts"]
    status = lint_main([f"{BAD}:item_sync"] + [f"{BROKEN}:{t}" for t in targets] + [f"{GOOD}:decode_step"])
    assert status == 2
    out, err = capsys.readouterr()
    # Every target got its turn, in order, whatever the ones before it did.
    assert "item_sync: 1 capture hazard" in out and "decode_step: capturable" in out
    assert could_not_lint(err, "exits_cleanly").startswith("the step raised SystemExit: 0 on the example inputs at ")
    assert could_not_lint(err, "exits_hard") == (
        "the linter process exited with status 0 before reporting "
        "(the file, the factory or the step called sys.exit or os._exit)"
    )
    assert "exited with status 0 before reporting" in could_not_lint(err, "exits_in_factory")
    assert could_not_lint(err, "aborts").startswith("the linter process was killed by SIGABRT")
    # What a step printed before it died is relayed, not lost.
    assert "the step's own output, before it exits" in out


def test_cli_steps_that_run_no_ops_exit_2(capsys):
    assert lint_main([f"{BROKEN}:generator_step", f"{BROKEN}:does_nothing"]) == 2
    out, err = capsys.readouterr()
    assert "capturable" not in out
    for target in ("generator_step", "does_nothing"):
        assert could_not_lint(err, target) == (
            "the step ran no tensor ops (a generator function, or a step that does nothing)"
        )


def test_cli_hanging_steps_time_out(capsys):
    """The hanging steps are cut at their 4 s; the normal target after them gets the default
    timeout (the short one also covers a worker's start-up, the torch import, which a busy
    machine can stretch past 4 s). The time bound only proves the hangs were cut: the steps
    would sleep an hour or spin forever."""
    start = time.monotonic()
    assert lint_main(["--timeout", "4", f"{BROKEN}:sleeps", f"{BROKEN}:spins"]) == 2
    assert time.monotonic() - start < 1800
    err = capsys.readouterr().err
    for target in ("sleeps", "spins"):
        assert could_not_lint(err, target).startswith("timed out after 4 s")
    assert lint_main([f"{BAD}:item_sync"]) == 1
    assert "item_sync: 1 capture hazard" in capsys.readouterr().out


def test_graphrelay_lint_command_in_a_subprocess():
    target = os.path.join("tests", "lint_examples", "bad_steps.py") + ":bool_mask_index"
    result = subprocess.run(
        [sys.executable, "-m", "graphrelay.tools.cli", "lint", target], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 1, result.stderr
    line = marked_line(bad_steps.bool_mask_index)
    assert f"tests/lint_examples/bad_steps.py:{line}: data-dependent-shape: aten.index.Tensor" in result.stdout
    assert "fix: keep the full shape" in result.stdout
    assert "Traceback" not in result.stderr
