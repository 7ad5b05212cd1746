"""Load an object defined outside the project: `module:name` or `path/to/file.py:name` (tasks, losses,
advantage estimators). Loading a file runs its code, as importing a module does."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from gpg_vl.errors import UserError


def load_reference(reference: str, key: str) -> Any:
    """The attribute `name` of `module:name` or `file.py:name`; `key` (e.g. ``task.name``) names the setting
    in the one-sentence error for a missing file, module or attribute."""
    location, _, attribute = reference.rpartition(":")
    if location.endswith(".py"):
        path = Path(location).expanduser().resolve()
        if not path.is_file():
            raise UserError(f"file {location!r} does not exist; give {key}=path/to/file.py:name.")
        module_name = f"gpg_vl_user_{abs(hash(str(path)))}"
        module = sys.modules.get(module_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(location)
        except ImportError as error:
            raise UserError(f"cannot import module {location!r} ({error}); check {key}.") from None
    if not hasattr(module, attribute):
        raise UserError(f"{location!r} defines no {attribute!r}; check the name after ':' in {key}={reference}.")
    return getattr(module, attribute)
