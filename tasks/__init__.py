"""Built-in task plugins; importing this package registers them."""

from . import classification, cvbench, geoqa, lisa, shapes, zoom  # noqa: F401
