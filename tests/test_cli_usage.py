"""`graphrelay --help` lists every subcommand and every benchmark `graphrelay bench` has."""

from graphrelay.tools.bench import SUBCOMMANDS
from graphrelay.tools.cli import main


def test_usage_names_every_benchmark(capsys):
    assert main(["--help"]) == 0
    usage = capsys.readouterr().out
    for command in ("serve", "generate", "lint", "bench"):
        assert f"  {command} " in usage
    missing = [name for name in SUBCOMMANDS if f"`bench {name}`" not in usage]
    assert not missing and "bench spec" in usage
