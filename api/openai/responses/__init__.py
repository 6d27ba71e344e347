"""OpenAI's Responses API on the durable job (docs/architecture.md §17): `schemas.py`, the request and the `response`
object, and how each maps to a job; `stream.py`, the Responses event stream of a job's answer; `routes.py`,
`/v1/responses`."""
