"""The REST API. It never imports torch: the worker is the only process that touches a model.

One package per concern, each with its own routers, and `main.py`, the app factory, that includes them: `http/`
(plumbing), `keys/`, `streams/`, `jobs/`, `openai/`, `files/`, `batch/`, `ops/` (docs/architecture.md §2)."""
