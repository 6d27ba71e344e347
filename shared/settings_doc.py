"""The Configuration tables of docs/configuration.md, generated from the settings (`kevlaya dev settings-doc`): one
table per group of `Settings` in its order, headed by the group model's title with its docstring as the note under
it (the roles' profiles share one table), one row per variable, the field's description as its meaning. Reads the
classes only: building `Settings()` would read the environment, and the tables document the defaults."""

from __future__ import annotations

import inspect
from pathlib import Path

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

from shared.settings import AdapterProfile, Settings

PREFIX = "KEVLAYA_"
BEGIN = "<!-- settings:begin -->"
END = "<!-- settings:end -->"
TARGET = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
HEADER = "| variable | default | meaning |\n|---|---|---|"
UNITS = ((1024 ** 3, "GiB"), (1024 ** 2, "MiB"), (1024, "KiB"))


def is_profile(field: FieldInfo) -> bool:
    """A role's profile: its fields are `KEVLAYA_<ROLE>__<FIELD>`."""
    return isinstance(field.annotation, type) and issubclass(field.annotation, AdapterProfile)


def group_model(name: str) -> type[BaseModel]:
    """The model of a field of `Settings` (a group, or a role's profile)."""
    return Settings.model_fields[name].annotation  # type: ignore[return-value]


def sections() -> list[tuple[str, list[str]]]:
    """(heading, the `Settings` fields it documents) in the class's order; neighbouring profiles share one."""
    out: list[tuple[str, list[str]]] = []
    for name, field in Settings.model_fields.items():
        if is_profile(field) and out and is_profile(Settings.model_fields[out[-1][1][-1]]):
            out[-1][1].append(name)
        else:
            out.append(("Roles" if is_profile(field) else title(group_model(name)), [name]))
    return out


def title(model: type[BaseModel]) -> str:
    return model.model_config.get("title") or model.__name__


def note(model: type[BaseModel]) -> str:
    """The line under a heading: the model's docstring (a profile's is `AdapterProfile`'s)."""
    return cell(inspect.cleandoc(model.__doc__ or ""))


def variable(*names: str) -> str:
    return PREFIX + "__".join(name.upper() for name in names)


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def default(name: str, value: object) -> str:
    """A default as one types it into the variable; unset (None) and secrets as `—`."""
    if value is None or isinstance(value, SecretStr):
        return "—"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    shown = f"`{value}`"
    if (name.endswith("_bytes") or "_bytes_" in name) and isinstance(value, int):
        size, unit = next(((value // n, u) for n, u in UNITS if value % n == 0 and value >= n), (None, None))
        if unit:
            shown += f" ({size} {unit})"
    if name.endswith("_s") and isinstance(value, (int, float)) and value >= 86400 and value % 86400 == 0:
        shown += f" ({value // 86400:.0f} days)"
    return shown


def description(field: FieldInfo) -> str:
    return cell(field.description or "")


def profile_description(model: type[BaseModel], name: str) -> str:
    """A profile field's description: a role's profile overrides only its defaults, so it is the base's."""
    for cls in model.__mro__:
        field = getattr(cls, "model_fields", {}).get(name)
        if field is not None and field.description:
            return description(field)
    return ""


def rows(names: list[str]) -> list[str]:
    """A group's rows (one name), or the profiles' rows (one per profile field, every profile in it)."""
    if not is_profile(Settings.model_fields[names[0]]):
        [group] = names
        return [f"| `{variable(group, name)}` | {default(name, field.default)} | {description(field)} |"
                for name, field in group_model(group).model_fields.items()]
    model = group_model(names[0])
    lines = []
    for sub in model.model_fields:
        having = [p for p in names if not group_model(p).model_fields[sub].exclude]  # a field a profile does not use
        variables = ", ".join(f"`{variable(p, sub)}`" for p in having)
        defaults = " / ".join(default(sub, getattr(Settings.model_fields[p].default, sub)) for p in having)
        lines.append(f"| {variables} | {defaults} | {profile_description(model, sub)} |")
    return lines


def render() -> str:
    """The Markdown between the markers (markers excluded)."""
    fields = Settings.model_fields
    parts = ["<!-- generated from shared/settings.py by `kevlaya dev settings-doc --write`: edit the settings' "
             "Field descriptions and group docstrings there, not this block -->"]
    for heading, names in sections():
        parts.append(f"### {heading}")
        profile = is_profile(fields[names[0]])
        if text := note(AdapterProfile if profile else group_model(names[0])):
            parts.append(text)
        if profile:
            parts.append("\n".join(f"- `{variable(name)}__*`: {description(fields[name])}" for name in names))
        parts.append("\n".join([HEADER, *rows(names)]))
    return "\n\n".join(parts)


def block(text: str) -> str:
    """What `text` (the target file) holds between the markers, without them."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {BEGIN} … {END} block")
    return text[start + len(BEGIN):end].strip("\n")


def with_block(text: str, markdown: str) -> str:
    """`text` with its block replaced by `markdown`."""
    block(text)  # the markers must be there
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return f"{text[:start]}\n\n{markdown}\n\n{text[end:]}"
