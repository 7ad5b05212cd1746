"""Video clips made on the fly for the video tests: a file written with PyAV, or a list of PIL frames.

Each frame is a solid colour with a white dot that moves one step right per frame, so frames differ."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def clip_frames(count: int, size: tuple[int, int] = (64, 48)) -> list[Image.Image]:
    """`count` RGB frames of `size` (W, H): frame i is dark with a white square at x = 2 i."""
    width, height = size
    frames = []
    for i in range(count):
        pixels = np.full((height, width, 3), (20 + 7 * i) % 255, dtype=np.uint8)
        x = (2 * i) % (width - 4)
        pixels[height // 2 - 2:height // 2 + 2, x:x + 4] = 255
        frames.append(Image.fromarray(pixels))
    return frames


def write_clip(path: str | Path, seconds: float = 4.0, fps: int = 8, size: tuple[int, int] = (64, 48)) -> Path:
    """An MPEG-4 file of `seconds` at `fps` frames per second (4 s at 8 fps: 32 frames)."""
    import av

    path = Path(path)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for frame in clip_frames(int(seconds * fps), size):
            for packet in stream.encode(av.VideoFrame.from_image(frame)):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
