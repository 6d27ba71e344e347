"""`python -m modellab.bench` on a machine that has the project's files and wheels but no installed `kevlaya` command."""

from modellab.bench.cli import app

app(prog_name="python -m modellab.bench")
