"""`kevlaya`, the command-line tool: the layer above all others. It may import `api/`, `worker/`, `modellab/`
and `shared/`; nothing imports it. Heavy imports (torch, uvicorn, the worker) happen inside commands."""
