"""Every setting is documented and read: the README's table names each `KEVLAYA_*` variable the settings object
takes, and nothing else; each field has a reader outside `shared/settings.py` (a setting that nothing reads would
be accepted and ignored)."""

from __future__ import annotations

import ast
import re

from pydantic import BaseModel

from shared.settings import AdapterProfile, Settings
from tests.test_layout import PACKAGES, ROOT, parsed, source_files


def variables(model: type[BaseModel] = Settings, prefix: str = "KEVLAYA_") -> set[str]:
    names = set()
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            names |= variables(annotation, f"{prefix}{name.upper()}__")
        else:
            names.add(f"{prefix}{name.upper()}")
    return names


def configuration_table() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Configuration"):readme.index("## Monitoring")]
    return "\n".join(line for line in section.splitlines() if line.startswith("| `KEVLAYA_"))


def test_the_readme_table_names_every_setting_and_only_settings():
    documented = set(re.findall(r"`(KEVLAYA_[A-Z_]+)`", configuration_table()))
    assert documented - variables() == set(), "the README names variables no setting reads"
    assert variables() - documented == set(), "settings missing from the README's Configuration table"


def attributes_read() -> set[str]:
    """Every attribute name read anywhere in the packages but the settings module itself."""
    read = set()
    for package in PACKAGES:
        for path in source_files(package):
            if path == ROOT / "shared" / "settings.py":
                continue
            read |= {node.attr for node in ast.walk(parsed(path)) if isinstance(node, ast.Attribute)}
    return read


def test_every_setting_has_a_reader():
    read = attributes_read()
    fields = set(Settings.model_fields) | set(AdapterProfile.model_fields)
    assert fields - read == set(), "settings nothing reads"

