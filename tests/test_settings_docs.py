"""Every setting is documented once and read: each field has a `description` and a place in exactly one of
`GROUPS`; the Configuration tables of docs/configuration.md are what `shared/settings_doc.py` generates from them
(so they name each `KEVLAYA_*` variable the settings object takes, and nothing else); each field has a reader
outside `shared/settings.py` (a setting that nothing reads would be accepted and ignored)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from pydantic import BaseModel

from shared import settings_doc
from shared.settings import GROUP_NOTES, GROUPS, AdapterProfile, Settings
from tests.test_layout import PACKAGES, ROOT, parsed, source_files

REGENERATE = ("run `kevlaya dev settings-doc --write` (and edit the Field descriptions in shared/settings.py, "
              "not docs/configuration.md)")


def variables(model: type[BaseModel] = Settings, prefix: str = "KEVLAYA_") -> set[str]:
    names = set()
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            names |= variables(annotation, f"{prefix}{name.upper()}__")
        else:
            names.add(f"{prefix}{name.upper()}")
    return names


CONFIGURATION = ROOT / "docs" / "configuration.md"


def configuration() -> str:
    return CONFIGURATION.read_text()


def configuration_table() -> str:
    return "\n".join(line for line in configuration().splitlines() if line.startswith("| `KEVLAYA_"))


def test_the_generator_writes_docs_configuration():
    assert settings_doc.TARGET == CONFIGURATION


def test_the_configuration_block_is_what_the_generator_makes():
    text = configuration()
    assert settings_doc.BEGIN in text and settings_doc.END in text, \
        f"docs/configuration.md lost its {settings_doc.BEGIN} … {settings_doc.END} markers"
    assert settings_doc.block(text) == settings_doc.render(), \
        f"docs/configuration.md's settings tables are stale: {REGENERATE}"


def test_the_configuration_table_names_every_setting_and_only_settings():
    documented = set(re.findall(r"`(KEVLAYA_[A-Z0-9_]+)`", configuration_table()))
    assert documented - variables() == set(), "docs/configuration.md names variables no setting reads"
    assert variables() - documented == set(), "settings missing from docs/configuration.md's tables"


def test_the_readme_links_to_the_configuration():
    assert "(docs/configuration.md)" in (ROOT / "README.md").read_text()


def profiles() -> dict[str, type[BaseModel]]:
    """The nested settings (the roles' profiles) by field name."""
    return {name: field.annotation for name, field in Settings.model_fields.items()
            if settings_doc.is_profile(field)}


def test_every_field_has_a_description():
    missing = [name for name, field in Settings.model_fields.items() if not (field.description or "").strip()]
    missing += [f"AdapterProfile.{name}" for name, field in AdapterProfile.model_fields.items()
                if not (field.description or "").strip()]
    # A role's profile overrides defaults only; a field of its own would need its own description.
    missing += [f"{model.__name__}.{name}" for model in profiles().values() for name in model.model_fields
                if not settings_doc.profile_description(model, name)]
    assert missing == [], f"settings without a Field(description=...): {missing}"


def test_every_field_is_in_exactly_one_group_in_the_class_order():
    fields = list(Settings.model_fields)
    grouped = [name for names in GROUPS.values() for name in names]
    twice = sorted(name for name, n in Counter(grouped).items() if n > 1)
    assert twice == [], f"settings in more than one group of GROUPS: {twice}"
    assert sorted(set(fields) - set(grouped)) == [], "settings in no group of GROUPS"
    assert sorted(set(grouped) - set(fields)) == [], "GROUPS names fields Settings does not have"
    assert grouped == fields, "Settings' fields must come in the order of GROUPS (group by group)"
    assert all(GROUPS.values()), "an empty group"
    assert set(GROUP_NOTES) <= set(GROUPS), "a note for a group GROUPS does not have"


def test_the_roles_profiles_have_the_same_fields():
    assert {name: list(model.model_fields) for name, model in profiles().items()} == {
        name: list(AdapterProfile.model_fields) for name in profiles()}


def test_settings_doc_write_replaces_only_the_block(tmp_path: Path):
    stale = tmp_path / "configuration.md"
    stale.write_text(f"# title\n\nprose before\n\n{settings_doc.BEGIN}\n| old | table |\n{settings_doc.END}\n\n"
                     "prose after\n")
    done = subprocess.run([sys.executable, "-m", "cli", "dev", "settings-doc", "--write", "--target", str(stale)],
                          capture_output=True, text=True, cwd=ROOT, env=os.environ.copy(), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    text = stale.read_text()
    assert settings_doc.block(text) == settings_doc.render()
    assert text.startswith("# title\n\nprose before\n\n") and text.endswith("\n\nprose after\n")
    assert "| old | table |" not in text


def attributes_read() -> set[str]:
    """Every attribute name read anywhere in the packages but the settings module itself and its documenter."""
    read = set()
    for package in PACKAGES:
        for path in source_files(package):
            if path in (ROOT / "shared" / "settings.py", ROOT / "shared" / "settings_doc.py"):
                continue
            read |= {node.attr for node in ast.walk(parsed(path)) if isinstance(node, ast.Attribute)}
    return read


def test_every_setting_has_a_reader():
    read = attributes_read()
    fields = set(Settings.model_fields) | set(AdapterProfile.model_fields)
    assert fields - read == set(), "settings nothing reads"
