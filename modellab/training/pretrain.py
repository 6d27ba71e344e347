"""Full-parameter pretraining of a small base model on packed text."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from modellab.training.config import PretrainConfig, TrainReport
from modellab.training.data import block_batches
from modellab.training.loop import LoopSettings, make_report, run_loop, seed_everything
from worker.model.loading import resolve_device

log = logging.getLogger("kevlaya.training")


def pack_texts(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], seq_len: int) -> torch.Tensor:
    """All texts, each ended by EOS, concatenated and cut into (n_blocks, seq_len) blocks (the tail is dropped)."""
    ids: list[int] = []
    for start in range(0, len(texts), 4096):
        for row in tokenizer(list(texts[start:start + 4096]), add_special_tokens=False)["input_ids"]:
            ids.extend(row)
            ids.append(tokenizer.eos_token_id)
    n_blocks = len(ids) // seq_len
    if n_blocks == 0:
        raise ValueError(f"the texts hold {len(ids)} tokens, fewer than one block of {seq_len}")
    return torch.tensor(ids[:n_blocks * seq_len], dtype=torch.long).view(n_blocks, seq_len)


def pretrain_base(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: Sequence[str],
                  config: PretrainConfig) -> TrainReport:
    """Train every weight of `model` in place on next-token prediction over `texts`, packed into blocks.

    Full precision (TF32 matmuls on CUDA): the model is small, so speed is bound by kernel launches, not math."""
    device = resolve_device(config.device)
    generator = seed_everything(config.seed)
    blocks = pack_texts(tokenizer, texts, config.seq_len)
    total = config.max_steps or math.ceil(config.epochs * len(blocks) / config.batch_size)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]  # no weight decay on norms
    rest = [p for p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=config.lr, betas=(0.9, 0.95), fused=device == "cuda",
    )
    log.info("pretraining %.2fM parameters on %s: %d blocks of %d tokens, %d steps of %d blocks",
             sum(p.numel() for p in params) / 1e6, device, len(blocks), config.seq_len, total, config.batch_size)
    settings = LoopSettings(
        lr=config.lr, total_steps=total, grad_accum=1, warmup_steps=min(config.warmup_steps, max(1, total // 10)),
        checkpoint_every=config.checkpoint_every, log_every=config.log_every, max_rollbacks=config.max_rollbacks,
        inject_nan_at_step=config.inject_nan_at_step, progress=config.progress, desc="pretrain",
    )
    result = run_loop(model, optimizer, params, block_batches(blocks, config.batch_size, generator),
                       torch.device(device), settings)
    model.eval()
    return make_report(result, total, len(blocks), device)
