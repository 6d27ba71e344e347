"""`POST /v1/chat/completions` (docs/architecture.md §8): `schemas.py`, the request and the answer in OpenAI's shapes;
`stream.py`, the `chat.completion.chunk` stream of a job's answer; `routes.py`, the route."""
