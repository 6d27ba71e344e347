"""The decoder the worker serves: its options from the settings (`decoder_options`, which the benchmark and the
evaluation build their decoders from too) and its slots from the memory budget (`build_decoder`). torch is imported
only when a decoder is built: the Celery parent imports the engine too."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from shared.settings import Settings
from worker.decoder.options import DecoderOptions
from worker.engine.scheduler import reserved_slots
from worker.memory import GIB, SlotBudget, fit_slots, kv_bytes_per_token

if TYPE_CHECKING:  # torch is imported only in the worker child
    from worker.decoder.slot_decoder import SlotDecoder
    from worker.model.loading import LoadedModel

log = logging.getLogger("kevlaya.worker")


def decoder_options(settings: Settings, device: str) -> DecoderOptions:
    """The decoder's variants as `settings.engine` sets them on `device` ("cuda" or "cpu")."""
    from worker.decoder.kv_block import STORAGE_DTYPES

    engine = settings.engine
    return DecoderOptions(graphs=engine.cuda_graphs and device == "cuda", kv_dtype=STORAGE_DTYPES[engine.kv_dtype],
                          prefill_chunk_tokens=engine.prefill_chunk_tokens, ignore_eos=engine.ignore_eos,
                          lora_min_rank=settings.model.adapter_max_rank, spare_adapters=settings.model.spare_roles)


def build_decoder(loaded: LoadedModel, settings: Settings) -> SlotDecoder:
    """A decoder with `max_batch` slots plus the reserved ones, fewer where the memory budget holds fewer (CUDA:
    worker/memory.py sizes it by arithmetic, then by its measured peak). Its results carry no text: the result
    writer makes it, on its own thread."""
    import torch

    from worker.decoder.kernels.fused_projections import decoded_scales_bytes, join_weights
    from worker.decoder.kv_block import kv_shape
    from worker.decoder.slot_decoder import SlotDecoder

    window = min(settings.engine.window_tokens, loaded.context or settings.engine.window_tokens)
    # Reserved slots come on top of max_batch, so a role's backlog keeps max_batch rows when memory allows.
    reserved = reserved_slots(settings, loaded.adapters, settings.engine.max_batch)
    wanted = settings.engine.max_batch + sum(reserved.values())
    options = dataclasses.replace(decoder_options(settings, loaded.device), texts=False)

    def build(slots: int) -> SlotDecoder:
        return SlotDecoder(loaded.model, loaded.tokenizer, sorted(loaded.adapters), slots=slots, window=window,
                           eos_ids=loaded.eos_ids, options=options)

    if loaded.device != "cuda":
        return build(wanted)  # the decoder joins the projections itself
    torch.cuda.empty_cache()  # what loading left cached is not the decoder's to count
    element_bytes = options.kv_dtype.itemsize if options.kv_dtype else 2  # fp8, else the compute dtype (fp16)

    budget = SlotBudget(
        budget_bytes=int(settings.engine.vram_budget_gb * GIB), resident_bytes=torch.cuda.memory_allocated(),
        workspace_bytes=int(settings.engine.workspace_gb * GIB),
        kv_per_token=kv_bytes_per_token(*kv_shape(loaded.model.config), dtype_bytes=element_bytes), window=window)
    # q/k/v and gate/up weights joined once, before the memory the model holds is measured; their NF4 scales are
    # kept decoded (faster steps) unless that memory would cost a slot (a 7B model on a 6 GB card)
    extra = decoded_scales_bytes(loaded.model)
    decoded = not budget.costs_a_slot(extra, wanted)
    join_weights(loaded.model, decoded_scales=decoded)
    log.info("q/k/v and gate/up joined; NF4 scales %s (%.0f MiB decoded)", "kept decoded" if decoded else
             "decoded at each step, since keeping them would cost a slot", extra / 2**20)
    budget = dataclasses.replace(budget, resident_bytes=torch.cuda.memory_allocated())
    return fit_slots(build, budget, wanted, settings.engine.prefill_tokens)
