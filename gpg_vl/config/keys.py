"""The vocabulary every settings declaration uses: a setting's meaning and range (`meta`, read back by `key_of`),
the leaf keys of a settings dataclass (`declared`), and `with_sections`, which adds the sections that engines and
tools declare for themselves (`rollout.<engine>.*`, `rollout.tools.<tool>.*`) to a settings dataclass.

Light on purpose (dataclasses only): the schema (gpg_vl/config/schema.py), the built-in engines' and tools'
settings (gpg_vl/rollout/settings.py) and an out-of-tree plugin's own settings all import it before torch loads.
"""

import typing
from dataclasses import MISSING, Field, dataclass, field, fields, make_dataclass


@dataclass(frozen=True)
class Key:
    """What one setting means and allows, beyond its type (bool, int, float, str; `| None`: null allowed)."""

    help: str  # its one-line meaning
    low: float | None = None  # inclusive lower bound
    above: float | None = None  # exclusive lower bound
    high: float | None = None  # inclusive upper bound
    below: float | None = None  # exclusive upper bound
    choices: tuple[str, ...] | str = ()  # the names allowed, or the name of a lazy source (`CHOICE_SOURCES`)
    references: bool = False  # `module:name` / `path/to/file.py:name` is allowed too (a plugin)
    nonempty: bool = False  # a string with something in it
    note: str = ""  # why, appended to what is allowed in an error


def meta(help: str, **allowed) -> dict:
    """A field's metadata: `field(default=1e-6, metadata=meta("AdamW learning rate", above=0))`."""
    return {"key": Key(help, **allowed)}


def option(help: str, **allowed):
    """A plugin option's meaning and range, for `typing.Annotated` on its keyword argument, beside its default:
    `cap: Annotated[float, option("the most weight a token gets", above=0)] = 2.0` (gpg_vl/config/rules.py's
    `check_options` reads it; an option without one is checked against nothing)."""
    return Key(help, **allowed)


def key_of(item: Field) -> Key | None:
    return item.metadata.get("key")


def is_section(item: Field) -> bool:
    """Whether a field holds a nested settings dataclass (a section: `rollout.hf`, `model.lora`, ...)."""
    nested = item.default_factory if item.default_factory is not MISSING else None
    return isinstance(nested, type) and hasattr(nested, "__dataclass_fields__")


def declared(cls, prefix: str = "") -> list[tuple[str, Field]]:
    """Every leaf setting of a settings dataclass as (dotted key, field), sections expanded, in order (a type
    written as a string, in a plugin's file with `from __future__ import annotations`, resolved)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for item in fields(cls):
        if isinstance(item.type, str):
            item.type = hints[item.name]
        if is_section(item):
            keys += declared(item.default_factory, f"{prefix}{item.name}.")
        else:
            keys.append((f"{prefix}{item.name}", item))
    return keys


def default_of(item: Field):
    if item.default is not MISSING:
        return item.default
    return item.default_factory() if item.default_factory is not MISSING else None


def as_sections(settings) -> None:
    """Turn the sections of a settings object that arrived as plain dicts (`Settings(**container)`) into their
    dataclasses, in place."""
    for item in fields(settings):
        value = getattr(settings, item.name)
        if is_section(item) and isinstance(value, dict):
            setattr(settings, item.name, item.default_factory(**value))


def with_sections(cls, sections: dict[str, type], *, doc: str | None = None):
    """`cls` with one more section per entry of `sections` (name -> settings dataclass, its defaults when the
    config sets none; a section of that name already there is replaced): a subclass of the same name, so a
    Hydra schema, `declared` and the reference page all read the sections as they read any other. `cls` itself
    when there is none to add."""
    have = {item.name: item.default_factory for item in fields(cls) if is_section(item)}
    added = {name: section for name, section in sections.items() if have.get(name) is not section}
    if not added:
        return cls
    extended = make_dataclass(cls.__name__, [(name, section, field(default_factory=section))
                                             for name, section in added.items()], bases=(cls,))
    extended.__module__, extended.__qualname__ = cls.__module__, cls.__qualname__
    extended.__doc__ = doc or cls.__doc__
    return extended
