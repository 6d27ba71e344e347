"""SHA-256 manifests of model directories, so a truncated download or a swapped file is caught at load time."""

from __future__ import annotations

import hashlib
from pathlib import Path

MANIFEST_NAME = "MANIFEST.sha256"
# What an adapter's version covers (docs/architecture.md §10): its config and its weights, in either format PEFT saves.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
_CHUNK = 1 << 20  # weights can be several GB: never read a whole file into memory


def file_sha256(path: Path) -> str:
    """The file's SHA-256, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(directory: Path) -> list[str]:
    return sorted(
        p.relative_to(directory).as_posix()
        for p in directory.rglob("*")
        if p.is_file() and p.relative_to(directory).as_posix() != MANIFEST_NAME
    )


def write_manifest(directory: Path) -> Path:
    """Write `<sha256>  <relative posix path>` for every file under `directory`; returns the manifest path."""
    directory = Path(directory)
    lines = [f"{file_sha256(directory / name)}  {name}\n" for name in _files(directory)]
    manifest = directory / MANIFEST_NAME
    manifest.write_text("".join(lines), encoding="utf-8")
    return manifest


def _read_manifest(manifest: Path) -> tuple[dict[str, str], list[str]]:
    expected: dict[str, str] = {}
    problems: list[str] = []
    for number, line in enumerate(manifest.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or not name:
            problems.append(f"{manifest}: line {number} is malformed")
        else:
            expected[name] = digest.lower()
    return expected, problems


def verify_manifest(directory: Path) -> list[str]:
    """Human-readable problems with `directory` against its manifest; an empty list means it is intact."""
    directory = Path(directory)
    if not directory.is_dir():
        return [f"{directory} does not exist or is not a directory"]
    manifest = directory / MANIFEST_NAME
    if not manifest.is_file():
        return [f"{directory} has no {MANIFEST_NAME}"]
    expected, problems = _read_manifest(manifest)
    present = set(_files(directory))
    for name, digest in expected.items():
        if name not in present:
            problems.append(f"missing file {name}")
        elif file_sha256(directory / name) != digest:
            problems.append(f"checksum mismatch for {name}")
    problems.extend(f"extra file {name} (not in the manifest)" for name in sorted(present - expected.keys()))
    return problems


def adapter_sha256(directory: Path) -> str:
    """An adapter's version: the SHA-256 of its manifest lines (`<sha256>  <name>\\n`, names sorted) for its config
    and its weights, so `sha256sum adapter_config.json adapter_model.safetensors | sha256sum` in its directory gives
    the same. Its other files (BASE.json, calibration, training record) are not its weights: recorded beside it."""
    directory = Path(directory)
    names = sorted(name for name in (ADAPTER_CONFIG, *ADAPTER_WEIGHTS) if (directory / name).is_file())
    if ADAPTER_CONFIG not in names or len(names) < 2:
        raise FileNotFoundError(f"{directory} holds no {ADAPTER_CONFIG} with {' or '.join(ADAPTER_WEIGHTS)}")
    lines = "".join(f"{file_sha256(directory / name)}  {name}\n" for name in names)
    return hashlib.sha256(lines.encode()).hexdigest()
