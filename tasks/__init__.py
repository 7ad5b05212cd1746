"""Built-in task plugins; importing this package registers them."""

from . import shapes  # noqa: F401
