"""The GPU worker: Celery glue, the batch scheduler, and the model runtime (base + LoRA adapters)."""
