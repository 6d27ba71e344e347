"""The Configuration tables of docs/configuration.md, generated from the settings: one table per group of
`GROUPS`, one row per variable, the field's description as its meaning (`kevlaya dev settings-doc`). Reads the
class only: building `Settings()` would read the environment, and the tables document the defaults."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

from shared.settings import GROUP_NOTES, GROUPS, Settings

PREFIX = "KEVLAYA_"
BEGIN = "<!-- settings:begin -->"
END = "<!-- settings:end -->"
TARGET = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
HEADER = "| variable | default | meaning |\n|---|---|---|"
UNITS = ((1024 ** 3, "GiB"), (1024 ** 2, "MiB"), (1024, "KiB"))


def is_profile(field: FieldInfo) -> bool:
    """A nested model (a role's profile): its fields are `KEVLAYA_<NAME>__<FIELD>`."""
    return isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)


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


def rows(group: tuple[str, ...]) -> list[str]:
    fields = Settings.model_fields
    profiles = [name for name in group if is_profile(fields[name])]
    lines = []
    for name in group:
        field = fields[name]
        if not is_profile(field):
            lines.append(f"| `{variable(name)}` | {default(name, field.default)} | {description(field)} |")
        elif name == profiles[0]:  # the profiles' fields, once for all of the group's profiles
            model: type[BaseModel] = field.annotation  # type: ignore[assignment]
            for sub in model.model_fields:
                names = ", ".join(f"`{variable(p, sub)}`" for p in profiles)
                defaults = " / ".join(default(sub, getattr(fields[p].default, sub)) for p in profiles)
                lines.append(f"| {names} | {defaults} | {profile_description(model, sub)} |")
    return lines


def render() -> str:
    """The Markdown between the markers (markers excluded)."""
    fields = Settings.model_fields
    parts = ["<!-- generated from shared/settings.py by `kevlaya dev settings-doc --write`: edit the settings' "
             "Field descriptions and GROUPS there, not this block -->"]
    for group, names in GROUPS.items():
        parts.append(f"### {group}")
        if group in GROUP_NOTES:
            parts.append(GROUP_NOTES[group])
        profiles = [f"- `{variable(name)}__*`: {description(fields[name])}"
                    for name in names if is_profile(fields[name])]
        if profiles:
            parts.append("\n".join(profiles))
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
