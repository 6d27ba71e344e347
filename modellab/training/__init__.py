"""Training: LoRA/QLoRA decision adapters (`train_adapter`) and full-parameter pretraining of a small base
(`pretrain_base`), sharing one optimisation loop with gradient clipping, NaN/Inf rollback and a progress bar.

On CUDA an adapter is trained QLoRA-style: the base is loaded 4-bit NF4 and the optimiser is bitsandbytes'
paged 8-bit AdamW. On the CPU the base stays in full precision with torch's AdamW. Either way only the LoRA
weights are saved, so an adapter trained on the NF4 base also loads on the unquantized one.
"""

from modellab.training.adapters import train_adapter
from modellab.training.config import (
    ADAPTER_FILES,
    IGNORE_INDEX,
    OUTPUT_FILES,
    DataError,
    PretrainConfig,
    TrainConfig,
    TrainingDiverged,
    TrainReport,
)
from modellab.training.data import (
    Encoded,
    Sample,
    balance_by_label,
    chat_messages,
    encode_samples,
    read_samples,
)
from modellab.training.pretrain import pack_texts, pretrain_base
from modellab.training.scoring import score_decisions

__all__ = [
    "ADAPTER_FILES", "IGNORE_INDEX", "OUTPUT_FILES", "DataError", "Encoded", "PretrainConfig", "Sample",
    "TrainConfig", "TrainReport", "TrainingDiverged", "balance_by_label", "chat_messages", "encode_samples",
    "pack_texts", "pretrain_base", "read_samples", "score_decisions", "train_adapter",
]
