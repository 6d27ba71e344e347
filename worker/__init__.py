"""The GPU worker, by role: `tasks.py` (Celery glue), `engine/` (the drain loop), `ledger/` (claims, leases,
outcomes), `decoder/` (the slot decoder), `model/` (loading), `memory.py` (the VRAM budget). Imports only go down
(docs/architecture.md §2).

Only the serving path lives here; offline model work (training, evaluation, benchmarks, the reference runtime) is
in `modellab/`."""

from shared.logs import drop_misleading_library_lines

drop_misleading_library_lines()  # before any model library is imported below this package
