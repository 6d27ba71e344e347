"""`kevlaya bench`: the service on a GPU against the recipe's one-job-at-a-time scheme, side by side.

One fixed, seeded workload (`workload.py`) runs on a random-weight model of a real shape under the card's memory
cap: first through the recipe's scheme in this process (`recipe.py`), then through the whole service as real
processes (`service.py`: API -> Redis -> Celery worker -> SQLite). `profile.py` measures how busy the GPU is
during decode; `report.py` writes the JSON, the plot and the table; `run.py` puts the phases together.
"""
