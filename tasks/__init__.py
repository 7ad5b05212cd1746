"""Built-in task plugins; importing this package registers them."""

from . import (  # noqa: F401
    classification,
    cvbench,
    deepeyes,
    geoqa,
    hrbench,
    lisa,
    motion,
    shapes,
    videor1,
    vsibench,
    vstar,
    zoom,
)
