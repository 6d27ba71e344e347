"""OpenAI's Batch API on the durable queue (docs/architecture.md §15): the batch objects (schemas.py), reading an
input file (lines.py), a file batch's life in the database (file_batches.py), the keeper thread that moves batches
along (keeper.py) and runs the retention sweep (retention.py), and `/v1/batches` (routes.py)."""
