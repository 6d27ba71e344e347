"""The A/B pairs of the benchmark's decoder phase (CUDA): the served decoder against one with one thing changed.
Names and what each changes; the decoder options are in run.py (PAIR_OPTIONS)."""

PAIRS = {
    "lora_fp32": "the LoRA products in fp32, as PEFT keeps adapters",
    "unfused": "one matmul per projection: q/k/v and gate/up not joined",
    "unfused_norms": "RMSNorm as transformers' formula, not PyTorch's one operator (worker/decoder/kernels/fused_norms.py)",
    "unfused_rotary": "the rotary embedding as transformers' ten kernels a layer, not one (worker/decoder/kernels/fused_rotary.py)",
    "unfused_lora": "each LoRA product's row mask and expand as two kernels, not one (worker/decoder/kernels/lora_expand.py)",
    "whole_window": "captured steps read the whole window, not only its first half or quarter when the rows fit "
                    "there (worker/decoder/graph_step.py)",
    "bitsandbytes_nf4": "the NF4 matmuls of 2 to 64 rows through bitsandbytes' dequantize-then-GEMM, not the Triton "
                        "kernel (worker/decoder/kernels/nf4_matmul.py)",
    "eager_prefill": "prefill passes run eagerly, not replayed as CUDA graphs",
    "step_by_step": "each step launched when the host has read the one before, not one step ahead",
}
# pairs that leave an eager step's kernels as served (the census counts eager steps): no census of their own
SAME_KERNEL_PAIRS = {"eager_prefill", "step_by_step", "whole_window"}
# the others were measured (results README)
DEFAULT_PAIRS = ("step_by_step", "whole_window", "bitsandbytes_nf4")
