"""The slot decoder: rows of any adapter and sampling settings decoded together, one token per step.

`slot_decoder.py` (slots, prefill, step, per-row stop), `graph_step.py` (the fixed-shape step, CUDA graphs),
`graph_prefill.py` (the fixed-shape prefill passes, CUDA graphs), `kv_block.py` (one preallocated key/value block),
`row_lora.py` (each row's adapter as data), `sampling.py` (each row's own temperature, top-p and seed). It knows
neither the database nor Celery (tests/test_layout.py)."""
