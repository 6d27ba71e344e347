"""The model libraries must have the features the runtime relies on; an older release fails at start-up with
a message that says what to install, not with a TypeError in the middle of the first batch."""

from __future__ import annotations

import inspect
from importlib.metadata import PackageNotFoundError, version

# Kept in step with the floors in pyproject.toml (the releases this service is tested with).
PEFT_FLOOR = "0.21.0"
TRANSFORMERS_FLOOR = "5.17.0"


def _installed(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def _accepts(function: object, parameter: str) -> bool:
    try:
        return parameter in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def missing_library_features(peft_model: type | None = None, tokenizer: type | None = None) -> list[str]:
    """What the installed peft and transformers lack, one line each (empty when everything is there)."""
    if peft_model is None:
        from peft import PeftModel as peft_model
    if tokenizer is None:
        from transformers import PreTrainedTokenizerBase as tokenizer
    missing = []
    if not _accepts(peft_model.set_adapter, "inference_mode"):
        missing.append(f"peft {_installed('peft')} has no set_adapter(inference_mode=...): "
                       f"install peft>={PEFT_FLOOR}")
    if not _accepts(tokenizer.apply_chat_template, "sanitize_control_tokens"):
        missing.append(f"transformers {_installed('transformers')} has no apply_chat_template("
                       f"sanitize_control_tokens=...): install transformers>={TRANSFORMERS_FLOOR}")
    return missing


def require_library_features() -> None:
    if missing := missing_library_features():
        raise RuntimeError("the model libraries are too old for this worker: " + "; ".join(missing))
