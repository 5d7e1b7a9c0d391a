"""The installed package claims one import name, `graphrelay`: the capture layer and the tools
install as `graphrelay.capture` and `graphrelay.tools` (from their top-level folders), so they
never shadow a user's own `capture` or `tools` modules, and the console script follows."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_only_graphrelay_is_a_top_level_name():
    dist = importlib.metadata.distribution("graphrelay")
    assert dist.read_text("top_level.txt").split() == ["graphrelay"]
    (script,) = [e for e in dist.entry_points if e.group == "console_scripts"]
    assert (script.name, script.value) == ("graphrelay", "graphrelay.tools.cli:main")


def test_outside_the_checkout_the_generic_names_stay_free(tmp_path):
    """From another folder, a user's own `capture` and `tools` modules are the ones imported,
    while the installed layers resolve to this checkout's folders."""
    (tmp_path / "capture.py").write_text("MINE = True\n")
    (tmp_path / "tools.py").write_text("MINE = True\n")
    probe = ("import capture, tools, graphrelay.capture.iteration.engine as e, graphrelay.tools.cli as c; "
             "print(capture.MINE, tools.MINE, e.__file__, c.__file__)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    mine_capture, mine_tools, engine, cli = done.stdout.split()
    assert mine_capture == mine_tools == "True"
    assert Path(engine) == ROOT / "capture" / "iteration" / "engine.py" and Path(cli) == ROOT / "tools" / "cli.py"
