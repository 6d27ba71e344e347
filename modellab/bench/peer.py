"""The maintained peer, runtime only: transformers' own continuous batching (`generate_batch`) on the bench's model.

It has no per-request adapter, so it runs one `generate_batch` per adapter with that adapter active, each with a
fresh manager: its CUDA graphs keep the adapter that was active when they were captured. Its cache is sized
explicitly, since its own sizing reads the card's free memory rather than the allocator's cap.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch
from transformers import GenerationConfig

from modellab.bench.workload import BenchJob
from modellab.reference import ReferenceRuntime

CACHE_BLOCKS, BLOCK_TOKENS, BATCH_TOKENS = 512, 32, 4096


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peer_phase(runtime: ReferenceRuntime, jobs: list[BenchJob], graphs: bool = True) -> dict[str, Any]:
    """Jobs per second of `jobs` through transformers' continuous batching, one timed call per adapter (after a
    four-job warm-up call); greedy, end-of-sequence ignored when the runtime ignores it, as in the service."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model, tokenizer, device = runtime.model, runtime.tokenizer, runtime.device
    graphs = graphs and device == "cuda"
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    figures: dict[str, Any] = {"method": "transformers generate_batch, one call per adapter, that adapter active",
                               "cuda_graphs": graphs}
    seconds = tokens = 0.0
    for adapter in sorted({j.adapter for j in jobs}):
        group = [j for j in jobs if j.adapter == adapter]
        inputs = [tokenizer.apply_chat_template(j.messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"] for j in group]
        # ignore_eos: no end-of-sequence id, so each job writes exactly its max_new_tokens, as the service does
        eos = None if runtime.ignore_eos else runtime.eos_ids[0]
        generation = GenerationConfig(max_new_tokens=max(j.max_new_tokens for j in group), do_sample=False,
                                      eos_token_id=eos, pad_token_id=runtime.pad_id)
        batching = ContinuousBatchingConfig(use_cuda_graph=graphs, num_blocks=CACHE_BLOCKS, page_size=BLOCK_TOKENS,
                                            max_batch_tokens=BATCH_TOKENS)
        model.set_adapter(adapter)
        model.generate_batch(inputs[:4], generation_config=generation, continuous_batching_config=batching,
                             progress_bar=False)
        _sync(device)
        started = time.perf_counter()
        outputs = model.generate_batch(inputs, generation_config=generation, continuous_batching_config=batching,
                                       progress_bar=False)
        _sync(device)
        took = time.perf_counter() - started
        made = sum(len(o.generated_tokens) for o in outputs.values())
        figures[adapter] = {"jobs": len(group), "seconds": took, "generated_tokens": made}
        seconds, tokens = seconds + took, tokens + made
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    figures.update(jobs=len(jobs), seconds=seconds, generated_tokens=int(tokens), jobs_per_s=len(jobs) / seconds,
                   peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None)
    return figures
