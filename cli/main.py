"""The `kevlaya` app: one module per command group, wired here in the order `kevlaya --help` lists them."""

from __future__ import annotations

import typer

from cli import batch, db, dev, keys, models, quotas, serve
from modellab.bench.cli import batch_load, bench, load, scale_out, soak, stream_load

app = typer.Typer(help="Kev & Laya decision-job service.", no_args_is_help=True, add_completion=False)
app.add_typer(db.app, name="db")
app.add_typer(keys.app, name="keys")
app.add_typer(quotas.app, name="quotas")
app.add_typer(models.app, name="models")
app.add_typer(dev.app, name="dev")
app.add_typer(batch.app, name="batch")
app.command("bench")(bench)  # defined beside the benchmark it runs (also `python -m modellab.bench`)
app.command("load")(load)
app.command("stream-load")(stream_load)
app.command("batch-load")(batch_load)
app.command("soak")(soak)
app.command("scale-out")(scale_out)
app.command("api")(serve.api)
app.command("worker")(serve.worker)
app.command("worker-health")(serve.worker_health)
app.command("flower")(serve.flower)
app.command("train")(models.train)
app.command("run")(serve.run)
app.command("eval")(models.evaluate)
app.command("eval-tools")(models.evaluate_tools)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
