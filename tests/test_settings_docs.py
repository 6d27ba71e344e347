"""Every setting is documented once and read: `Settings` is a few groups (models with a title and a docstring) and
the roles' profiles, each field with a `description`; the Configuration tables of docs/configuration.md are what
`shared/settings_doc.py` generates from them (so they name each `KEVLAYA_*` variable the settings object takes, and
nothing else); each field has a reader outside `shared/settings.py`, through its group (a setting that nothing reads
would be accepted and ignored)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel

from shared import settings_doc
from shared.settings import FLAT_NAMES, AdapterProfile, Settings
from tests.test_layout import PACKAGES, ROOT, parsed, source_files

REGENERATE = ("run `kevlaya dev settings-doc --write` (and edit the Field descriptions in shared/settings.py, "
              "not docs/configuration.md)")


def variables(model: type[BaseModel] = Settings, prefix: str = "KEVLAYA_") -> set[str]:
    names = set()
    for name, field in model.model_fields.items():
        if field.exclude:  # a field the profile keeps for its type, which no variable sets (RoleProfile.path)
            continue
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
    """The roles' profiles by field name."""
    return {name: field.annotation for name, field in Settings.model_fields.items()
            if settings_doc.is_profile(field)}


def groups() -> dict[str, type[BaseModel]]:
    """The groups of settings by field name (`api`, `engine`, …)."""
    return {name: field.annotation for name, field in Settings.model_fields.items()
            if not settings_doc.is_profile(field)}


def test_every_field_has_a_description():
    missing = [name for name, field in Settings.model_fields.items()
               if settings_doc.is_profile(field) and not (field.description or "").strip()]
    missing += [f"{model.__name__}.{name}" for model in (AdapterProfile, *groups().values())
                for name, field in model.model_fields.items() if not (field.description or "").strip()]
    # A role's profile overrides defaults only; a field of its own would need its own description.
    missing += [f"{model.__name__}.{name}" for model in profiles().values() for name in model.model_fields
                if not settings_doc.profile_description(model, name)]
    assert missing == [], f"settings without a Field(description=...): {missing}"


def test_settings_are_a_few_groups_each_with_a_heading_and_a_note():
    assert len(Settings.model_fields) <= 20, "Settings holds groups, not single settings: put a new one in a group"
    for name, field in Settings.model_fields.items():
        model = field.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel), f"{name} is not a group"
        assert re.fullmatch(r"[a-z]+", name), f"a group's name is one word: {name}"
    models = groups().values()
    assert all(model.model_fields for model in models), "an empty group"
    assert all(not settings_doc.is_profile(field) for model in models for field in model.model_fields.values()), \
        "groups nest one level deep"
    assert all((model.__doc__ or "").strip() for model in models), "a group without a docstring (its note)"
    titles = [settings_doc.title(model) for model in models]
    assert all(title != model.__name__ for title, model in zip(titles, models)), "a group without a title"
    assert len(set(titles)) == len(titles) and "Roles" not in titles, "two tables with one heading"


def test_the_flat_names_of_the_release_before_name_every_old_setting_once():
    """Each deprecated flat name points at a field that exists and is not any other variable's name."""
    targets = list(FLAT_NAMES.values())
    assert len(set(targets)) == len(targets), "two flat names for one field"
    for target in targets:
        group, name = target.split(".")
        assert name in groups()[group].model_fields, f"{target} is not a setting"
    new = {variable.removeprefix("KEVLAYA_").lower() for variable in variables()}
    assert set(FLAT_NAMES) & new == set(), "a flat name that is a variable of its own"


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
    """Every attribute read anywhere in the packages but the settings module itself and its documenter, as
    `name` and, where it is read from a name or an attribute (`settings.engine.max_batch`, `engine.max_batch`), as
    `owner.name` too."""
    read = set()
    for package in PACKAGES:
        for path in source_files(package):
            if path in (ROOT / "shared" / "settings.py", ROOT / "shared" / "settings_doc.py"):
                continue
            for node in ast.walk(parsed(path)):
                if isinstance(node, ast.Attribute):
                    read.add(node.attr)
                    owner = node.value
                    if isinstance(owner, (ast.Attribute, ast.Name)):
                        read.add(f"{owner.attr if isinstance(owner, ast.Attribute) else owner.id}.{node.attr}")
    return read


def test_every_setting_has_a_reader():
    read = attributes_read()
    fields = set(Settings.model_fields) | set(AdapterProfile.model_fields)
    fields |= {f"{group}.{name}" for group, model in groups().items() for name in model.model_fields}
    assert fields - read == set(), "settings nothing reads"
