"""The slot decoder: rows of any adapter and sampling settings decoded together, one token per step.

`slot_decoder.py` (slots, prefill, step, per-row stop), `graph_step.py` (the fixed-shape step, CUDA graphs),
`graph_prefill.py` (the fixed-shape prefill passes, CUDA graphs), `kv_block.py` (one preallocated key/value block),
`sampling.py` (each row's own temperature, top-p and seed), `grammar.py` (each row's grammar mask), and `kernels/`
(what replaces the model's own operations while a decoder holds it: per-row LoRA, joined projections, the Triton
kernels). It knows neither the database nor Celery (tests/test_layout.py)."""
