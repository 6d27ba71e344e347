"""OpenAI's API surface on the durable job: chat completions (`chat/`), the Responses API (`responses/`), the model
list (`models.py`), the answer updates both stream (`answers.py`) and OpenAI's public ids (`ids.py`)."""
