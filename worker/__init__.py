"""The GPU worker: Celery glue, the batch scheduler, and the model runtime (base + LoRA adapters).

Only the serving path lives here; offline model work (training, evaluation, benchmarks) is in `modellab/`."""
