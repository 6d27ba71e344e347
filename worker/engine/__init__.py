"""The engine: the drain loop that plans, claims, runs and stores (`loop.py`), the scheduler that decides each of its
iterations — who takes a free slot, which claimed jobs are prefilled when, whether to step (`scheduler.py`, pure) —,
the decoder the worker serves (`build.py`), requests run to the end without the queue (`offline.py`), and the
threads that store the results (`writer.py`) and publish live tokens (`token_stream.py`)."""
