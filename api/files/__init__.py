"""OpenAI's Files API, for batch input, output and error files (docs/architecture.md §15): the bytes on disk
(store.py), an upload read as it arrives (upload.py), the names shown back (names.py), the file objects
(schemas.py), deleting rows (deletion.py), and `/v1/files` (routes.py)."""
