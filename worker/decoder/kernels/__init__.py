"""What replaces the model's own operations while a decoder holds it, each where it was measured to pay: per-row
LoRA as stacked products (`row_lora.py`) and its masked expand as one Triton kernel (`lora_expand.py`), q/k/v and
gate/up joined into one matmul each (`fused_projections.py`), the NF4 matmul of 2 to 64 rows as one Triton kernel
(`nf4_matmul.py`), RMSNorm as PyTorch's one operator (`fused_norms.py`), the rotary embedding as one Triton kernel
(`fused_rotary.py`), and whether those kernels build and run here (`triton_kernels.py`). Each is installed on the
model by the slot decoder and removed by its `close()`; none knows the decoder, its rows or who runs next
(tests/test_layout.py). The Triton kernels are checked in Triton's interpreter on the CPU (tests/test_nf4_matmul.py,
test_fused_rotary.py, test_lora_expand.py), the joined projections against each projection alone
(test_fused_projections.py), and all of them compiled on CUDA (tests/gpu/)."""
