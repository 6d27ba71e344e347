"""Scoring decisions of a model on labelled samples (greedy, batched)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from modellab.training.data import Sample, chat_messages
from shared.decision import parse_decision


def score_decisions(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, samples: Sequence[Sample],
                    system_prompt: str, *, max_new_tokens: int, batch_size: int = 64) -> dict[str, Any]:
    """Greedy answers to labelled samples: the share that parse as a decision and the share that match the label.

    A quick check for training runs, batched with left padding through plain `generate`; the evaluation
    harness measures the served models in depth."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    tokenizer.padding_side = "left"
    valid = correct = 0
    try:
        for start in range(0, len(samples), batch_size):
            part = samples[start:start + batch_size]
            encoded = tokenizer.apply_chat_template(
                [chat_messages(system_prompt, s.prompt, s.tools) for s in part], add_generation_prompt=True, tokenize=True,
                return_dict=True, padding=True, return_tensors="pt", sanitize_control_tokens=True,
            ).to(device)
            with torch.inference_mode():
                output = model.generate(
                    input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"], do_sample=False,
                    max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                )
            texts = tokenizer.batch_decode(output[:, encoded["input_ids"].shape[1]:], skip_special_tokens=True)
            for sample, text in zip(part, texts, strict=True):
                decision = parse_decision(text)
                valid += decision is not None
                correct += decision is not None and decision["decision"] == sample.label
    finally:
        model.train(was_training)
    n = len(samples)
    return {"n": n, "valid_rate": valid / n if n else 0.0, "accuracy": correct / n if n else 0.0}
