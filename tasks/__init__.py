"""Built-in task plugins; importing this package registers them."""

from . import classification, cvbench, geoqa, lisa, motion, shapes, videor1, vsibench  # noqa: F401
