"""What a setting or a plugin's option may hold (`Rule`), read from its type and its declaration
(gpg_vl/config/keys.py's `Key`): the schema's per-key checks (gpg_vl/config/validate.py) and the options a loss
or a correction declares beside their defaults (`option_rules`, `check_options`). Light: no schema, no torch, so
that the plugins' modules (gpg_vl/objective/options.py, gpg_vl/objective/corrections.py) can import it.
"""

from __future__ import annotations

import inspect
import math
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import Field, dataclass, replace

from gpg_vl.config import names
from gpg_vl.config.keys import Key
from gpg_vl.errors import UserError


@dataclass(frozen=True)
class Rule:
    """What a key may hold: an integer or a number in a range, a bool, a string, or one of some names."""

    kind: str  # "int", "number", "bool", "str" or "choice"
    low: float | None = None  # inclusive lower bound (`above` for an exclusive one)
    above: float | None = None
    high: float | None = None  # inclusive upper bound
    below: float | None = None  # exclusive upper bound
    optional: bool = False  # null is allowed
    choices: Callable[[], Iterable[str]] | tuple[str, ...] = ()
    note: str = ""  # why, appended to what is allowed
    references: bool = False  # a choice that also takes module:name / path.py:name (a plugin from outside)

    def allows(self, value) -> bool:
        if value is None:
            return self.optional
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "str":
            return isinstance(value, str) and bool(value.strip())
        if self.kind == "choice":
            return isinstance(value, str) and (value in self.options() or (self.references and ":" in value))
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.kind == "int" and not isinstance(value, int):
            return False
        return (math.isfinite(value) and (self.low is None or value >= self.low)
                and (self.above is None or value > self.above) and (self.high is None or value <= self.high)
                and (self.below is None or value < self.below))

    def options(self) -> list[str]:
        return list(self.choices() if callable(self.choices) else self.choices)

    def allowed(self) -> str:
        if self.kind == "bool":
            text = "true or false"
        elif self.kind == "str":
            text = "a non-empty string"
        elif self.kind == "choice":
            outside = ", or module:name / path.py:name" if self.references else ""
            text = "one of " + ", ".join(self.options()) + outside
        else:
            bounds = [f">= {_number(self.low)}" if self.low is not None else "",
                      f"> {_number(self.above)}" if self.above is not None else "",
                      f"<= {_number(self.high)}" if self.high is not None else "",
                      f"< {_number(self.below)}" if self.below is not None else ""]
            text = ("an integer" if self.kind == "int" else "a number") + " " + " and ".join(b for b in bounds if b)
        text = text.strip() + (" or null" if self.optional else "")
        return f"{text} ({self.note})" if self.note else text


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def choices_of(source: str) -> list[str]:
    """The names a lazy choice (`Key.choices` naming a source in schema.CHOICE_SOURCES) allows now: the registries
    (plugins included) and the libraries' lists, read from gpg_vl/config/names.py so that checking a config
    imports none of torch, transformers or accelerate."""
    if source in names.REGISTRIES:
        found = names.registered(source)
        return ["auto", *found] if source == "families" else found
    lists = {"schedules": list(names.SCHEDULES), "trackers": ["none", *names.TRACKERS],
             "baselines": list(names.BASELINES), "aggregations": sorted(names.AGGREGATIONS),
             "decoders": list(names.DECODERS), "box_frames": list(names.BOX_FRAMES),
             "segmenters": list(names.SEGMENTERS)}
    if source not in lists:
        raise ValueError(f"unknown choice source {source!r}")
    return lists[source]


def value_type(item) -> tuple[object, bool]:
    """A field's type (or a type) without `None`, and whether null is allowed (`X | None`)."""
    hint = item.type if isinstance(item, Field) else item
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = typing.get_args(hint)
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else typing.Any), len(rest) < len(args)
    return hint, False


def rule_of(hint, optional: bool, key: Key) -> Rule | None:
    """What a value of type `hint` declared by `key` allows (None: its type says all, e.g. a free string)."""
    common = {"optional": optional, "note": key.note}
    if key.choices:
        choices = key.choices
        source = (lambda: choices_of(choices)) if isinstance(choices, str) else tuple(choices)
        return Rule("choice", choices=source, references=key.references, **common)
    if hint is bool:
        return Rule("bool", **common)
    if hint in (int, float):
        return Rule("int" if hint is int else "number", low=key.low, above=key.above, high=key.high, below=key.below,
                    **common)
    if hint is str and key.nonempty:
        return Rule("str", **common)
    return None


def option_rules(fn: Callable) -> dict[str, Rule]:
    """The options of a plugin function (a loss, a correction) that declare what they allow: keyword arguments
    annotated `Annotated[float, option("meaning", above=0)]` (gpg_vl/config/keys.py), or of a plain bool, int or
    float type; an option with neither (or whose annotation cannot be read) is not checked."""
    table = {}
    for name, (hint, key, default) in _keyword_options(fn).items():
        if isinstance(hint, str):
            continue
        hint, optional = value_type(hint)
        # null: what the declared type allows (`int | None`); an undeclared option also by its default None
        optional = optional or (default is None and key is None)
        key = key or Key("")
        key = replace(key, note=key.note or key.help)  # the option's meaning, said with what it allows
        rule = rule_of(hint, optional, key) if hint in (bool, int, float) or key.choices else None
        if rule is not None:
            table[name] = rule
    return table


def _keyword_options(fn: Callable) -> dict[str, tuple[object, Key | None, object]]:
    """name -> (type, its `option(...)` declaration or None, default) of each parameter of `fn` with a default."""
    try:
        parameters = inspect.signature(fn, eval_str=True).parameters
    except Exception:  # an annotation naming what its module does not define: read it unevaluated
        parameters = inspect.signature(fn).parameters
    options = {}
    for name, parameter in parameters.items():
        if parameter.default is parameter.empty:
            continue
        hint, key = parameter.annotation, None
        if typing.get_origin(hint) is typing.Annotated:
            hint, *extras = typing.get_args(hint)
            key = next((extra for extra in extras if isinstance(extra, Key)), None)
        options[name] = (hint, key, parameter.default)
    return options


def undeclared_options(fn: Callable, inputs: Iterable[str] = ()) -> list[str]:
    """The options of a plugin function (its parameters with a default, other than `inputs`: what the trainer
    passes) that declare no range: no `option(...)` beside them (a bool needs none), or a number's without a bound.
    The built-ins have none (tests/unit/test_loss_options.py walks every loss, advantage, aggregation and
    correction)."""
    missing = []
    for name, (hint, key, _) in _keyword_options(fn).items():
        if name in inputs:
            continue
        hint = value_type(hint)[0] if not isinstance(hint, str) else hint
        bounded = hint is bool or key is not None and bool(key.choices or hint is str or any(
            bound is not None for bound in (key.low, key.above, key.high, key.below)))
        if not bounded:
            missing.append(name)
    return missing


def check_options(fn: Callable, given: dict, *, prefix: str, owner: str) -> None:
    """Raise one UserError for the first value of `given` (a plugin's options, `prefix`.<name> in the config) that
    its declaration (`option_rules`) does not allow; `owner` names the plugin in the sentence."""
    declared = option_rules(fn)
    for name, value in given.items():
        rule = declared.get(name)
        if rule is not None and not rule.allows(value):
            raise UserError(f"{prefix}.{name}={value!r} is not allowed for {owner}: give {rule.allowed()}.")


