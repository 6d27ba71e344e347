"""The engine: the drain loop that claims jobs into free slots and decodes them (`loop.py`), who takes a slot and
when a claimed job is prefilled (`policy.py`), and the thread that stores the results (`writer.py`)."""
