"""Built-in task plugins; importing this package registers them."""

from . import classification, cvbench, deepeyes, geoqa, hrbench, lisa, shapes, vstar  # noqa: F401
