"""Code both the API and the worker import: settings, models, DB session, job schemas, queue publishing.

The leaf of the layout: nothing here imports `api/`, `worker/`, `modellab/` or `cli/` (tests/test_layout.py)."""
