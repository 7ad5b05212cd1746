"""The one `Registry` behind every kind of plugin (tasks, model families, advantages, policy losses, rollout
engines), and the loader of an object defined outside the project: `module:name` or `path/to/file.py:name`.
Loading a file runs its code, as importing a module does."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from gpg_vl.errors import UserError, raised


def load_reference(reference: str, key: str) -> Any:
    """The attribute `name` of `module:name` or `file.py:name`; `key` (e.g. ``task.name``) names the setting
    in the one-sentence error for a missing file, module or attribute (or, with a space in it, says in words
    where the reference was written: "a task's `tools`")."""
    location, _, attribute = reference.rpartition(":")
    prose = " " in key  # not a setting: say where the reference was written
    given = f"{reference!r} in {key}" if prose else f"{key}={reference}"
    if location.endswith(".py"):
        path = Path(location).expanduser().resolve()
        if not path.is_file():
            fix = f"fix {given} (a path/to/file.py:name)" if prose else f"give {key}=path/to/file.py:name"
            raise UserError(f"file {location!r} does not exist; {fix}.")
        module_name = f"gpg_vl_user_{abs(hash(str(path)))}"
        module = sys.modules.get(module_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            try:
                spec.loader.exec_module(module)
            except Exception as error:  # the file's own code raised: named in one sentence, not a traceback
                del sys.modules[module_name]
                raise UserError(f"{given}: loading {location} raised {raised(error)}; fix that code.") from error
    else:
        try:
            module = importlib.import_module(location)
        except ImportError as error:
            raise UserError(f"cannot import module {location!r} ({error}); check {given if prose else key}.") from None
        except Exception as error:  # the module's own code raised as it was imported
            raise UserError(f"{given}: importing {location} raised {raised(error)}; fix that code.") from error
    if not hasattr(module, attribute):
        raise UserError(f"{location!r} defines no {attribute!r}; check the name after ':' in {given}.")
    return getattr(module, attribute)


class Registry(Mapping):
    """The plugins of one kind (tasks, model families, advantages, policy losses, rollout engines), by name.

    `kind` names them in messages ("rollout engine"), `config_key` is the setting that picks one
    (``rollout.engine``), or says in words where one is named when no setting does ("a task's `tools`").
    `builtins` maps each built-in name to ``"module.path:attr"`` (the tables of gpg_vl/config/names.py, one per
    kind: every kind's built-ins are registered this one way): a built-in is imported on first use (`get`), so
    no module imports another just to register it.
    `accepts(obj)` says whether an object is a plugin of this kind, `expects` says what one is ("a Task
    subclass"). `get` also takes ``module:name`` and ``path.py:name``, loaded by `load_reference`.

    A read-only mapping from name to plugin: `name in registry`, `registry[name]` (`get`), iteration over the
    names (built-ins included, not imported).
    """

    def __init__(self, kind: str, config_key: str, builtins: dict[str, str] | None = None, *,
                 accepts: Callable[[Any], bool] = callable, expects: str = "a function") -> None:
        self.kind, self.config_key = kind, config_key
        self.builtins = dict(builtins or {})
        self.accepts, self.expects = accepts, expects
        self._entries: dict[str, Any] = {}
        self._origins: dict[str, str] = {}

    # ---- registering ---------------------------------------------------------------------------
    def register(self, target: Any = None, /, **attributes: Any):
        """Register under `target` when it is a name (a decorator), else `target` itself under its `name`
        (or `__name__`); `attributes` are set on the object first. Returns the object, or the decorator."""
        if isinstance(target, str):
            return lambda obj: self.add(target, obj, **attributes)
        if target is None:
            return lambda obj: self.add(_name_of(obj), obj, **attributes)
        return self.add(_name_of(target), target, **attributes)

    def add(self, name: str, obj: Any, **attributes: Any) -> Any:
        """Register `obj` as `name`; a second object under a registered (or built-in) name raises UserError."""
        origin = _origin(obj)
        if name in self._entries:
            taken = self._entries[name] is not obj
        else:  # a built-in registers itself when its module is imported; anything else takes the name
            taken = name in self.builtins and self.builtins[name] != origin
        if taken:
            first = self._origins.get(name) or self.builtins[name]
            raise UserError(f"the {self.kind} {name!r} is already registered (by {first}); register {origin} "
                            "under another name.")
        for key, value in attributes.items():
            setattr(obj, key, value)
        self._entries[name] = obj
        self._origins[name] = origin
        return obj

    def unregister(self, name: str) -> None:
        """Forget `name` (tests); a built-in name stays known and is imported again on the next `get`."""
        self._entries.pop(name, None)
        self._origins.pop(name, None)

    # ---- finding -------------------------------------------------------------------------------
    def get(self, name: str) -> Any:
        """The plugin registered (or built in) as `name`, or loaded from ``module:name`` / ``path.py:name``;
        an unknown name raises one sentence listing the valid ones."""
        if ":" in name:
            obj = load_reference(name, self.config_key)
            if not self.accepts(obj):
                given = f"{name!r} in {self.config_key}" if " " in self.config_key else f"{self.config_key}={name}"
                raise UserError(f"{given} is not {self.expects}; name {self.expects} after ':'.")
            return obj
        if name not in self._entries and name in self.builtins:
            obj = load_reference(self.builtins[name], self.config_key)
            self._entries.setdefault(name, obj)  # the module may have registered it itself
            self._origins.setdefault(name, self.builtins[name])
        if name not in self._entries:
            if " " in self.config_key:  # no setting names it: say where it was named
                raise UserError(f"unknown {self.kind} {name!r} in {self.config_key}; valid options: "
                                f"{', '.join(self.names())} (or name a {self.kind} from outside as module:name or "
                                "path.py:name).")
            raise UserError(f"unknown {self.config_key} {name!r}; valid options: {', '.join(self.names())} (or "
                            f"load a {self.kind} from outside with {self.config_key}=module:name or "
                            f"{self.config_key}=path.py:name).")
        return self._entries[name]

    def names(self) -> list[str]:
        """Every registered name, built-in ones included (sorted), without importing the built-ins."""
        return sorted({*self._entries, *self.builtins})

    def load_all(self) -> dict[str, Any]:
        """Name -> plugin for every name, importing each built-in."""
        return {name: self.get(name) for name in self.names()}

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._entries or name in self.builtins)

    def __getitem__(self, name: str) -> Any:
        try:
            return self.get(name)
        except UserError:
            raise KeyError(name) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.config_key!r}, names={self.names()})"


def _name_of(obj: Any) -> str:
    name = getattr(obj, "name", None) if isinstance(obj, type) else None
    return name or getattr(obj, "__name__", "")


def _origin(obj: Any) -> str:
    """`module:qualname` of an object, as a built-in reference spells it."""
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', type(obj).__qualname__)}"
