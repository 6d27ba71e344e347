"""The model libraries must have the features the worker relies on; an older release fails at start-up with
a message that says what to install, not with a TypeError in the middle of the first job."""

from __future__ import annotations

import inspect
from importlib.metadata import PackageNotFoundError, version
from typing import Any

# Kept in step with the floors in pyproject.toml (the releases this service is tested with).
PEFT_FLOOR = "0.21.0"
TRANSFORMERS_FLOOR = "5.24.0"


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


def forwards_forged_role_markers(tokenizer: Any) -> bool:
    """True when a control token written inside a message's content still reaches the model as that token, i.e.
    `apply_chat_template(sanitize_control_tokens=True)` is missing or silently ignored (older transformers take
    unknown options through **kwargs, so the signature alone cannot tell)."""
    marker, marker_id = tokenizer.eos_token, tokenizer.eos_token_id

    def count(content: str, **options: Any) -> int:
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=True,
                                                return_dict=True, **options)
        return list(encoded["input_ids"]).count(marker_id)

    try:
        return count(marker, sanitize_control_tokens=True) > count("x")
    except TypeError:
        return True


def missing_library_features(peft_model: type | None = None, tokenizer: Any = None) -> list[str]:
    """What the installed peft and transformers lack, one line each (empty when everything is there).
    `tokenizer` is a loaded one: the sanitising is checked by what it does, not by a signature."""
    if peft_model is None:
        from peft import PeftModel as peft_model
    missing = []
    if not _accepts(peft_model.set_adapter, "inference_mode"):
        missing.append(f"peft {_installed('peft')} has no set_adapter(inference_mode=...): "
                       f"install peft>={PEFT_FLOOR}")
    if tokenizer is not None and forwards_forged_role_markers(tokenizer):
        missing.append(f"transformers {_installed('transformers')} does not apply apply_chat_template("
                       f"sanitize_control_tokens=...): install transformers>={TRANSFORMERS_FLOOR}")
    return missing


def require_library_features(tokenizer: Any) -> None:
    if missing := missing_library_features(tokenizer=tokenizer):
        raise RuntimeError("the model libraries are too old for this worker: " + "; ".join(missing))
