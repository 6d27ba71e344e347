"""The model lab: offline work on models, never imported by the service.

Decision data (`decision_data.py`), the demo model's build (`demo_model.py`), adapter training (`training/`),
evaluation through the serving runtime (`evaluation.py`), random-weight models of real shapes
(`model_factory.py`) and the benchmarks (`bench/`). It stands on `worker/` (the runtime) and `shared/`;
nothing in `api/`, `worker/` or `shared/` imports it.
"""

from shared.logs import drop_misleading_library_lines

drop_misleading_library_lines()  # before any model library is imported below this package
