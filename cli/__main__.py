"""`python -m cli`: the `kevlaya` command where its installed script is missing (a source checkout)."""

from cli.main import main

main()
