"""Videos in chat messages: read and sampled once per prompt, with the metadata processors need.

A message part `{"type": "video", "video": <file path | list of frames (PIL images or image paths)>, ...}`
follows qwen-vl-utils' format: `fps` (frames per second to sample, default 2) or `nframes`, `min_frames`,
`max_frames`, and per-frame pixel budgets (`min_pixels`, `max_pixels`, `total_pixels`) that the model family
applies when it encodes the frames. `decode_videos` turns every such part of a prompt's messages into a
*decoded* part once, when the prompt stream checks the row (before any model work):

- `video`: the sampled frames, a list of RGB PIL images (an even count: Qwen's video tower pairs frames);
- `video_metadata`: `{"fps", "frames_indices", "total_num_frames"}` of the source, which the processors turn
  into Qwen2.5-VL's `second_per_grid_ts` (temporal patch / sampled fps) and Qwen3-VL's frame timestamps
  (frame index / fps); without it they assume 24 fps.

A file is decoded with PyAV (`av`, which qwen-vl-utils itself depends on and whose wheels bundle FFmpeg on
CPU and CUDA machines alike), keeping only the sampled frames in memory. Frames are chosen as qwen-vl-utils'
readers choose them: `smart_nframes` (fps x duration within [min_frames, max_frames], even), then evenly
spaced indices `round(linspace(0, total - 1, n))`. A list of frames needs no decoder: it is taken as a clip
sampled at `fps` frames per second (qwen-vl-utils' `sample_fps`, default 2), every frame kept, or an evenly
spaced subset when it holds more than the frame limit. `data.max_video_frames` bounds every video's frame
count. A video that cannot be read is a bad row (`BadRow`) with its reason.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from PIL import Image

from gpg_vl.errors import BadRow

DEFAULT_FPS = 2.0  # qwen-vl-utils' FPS
FRAME_FACTOR = 2  # frames come in pairs (the temporal patch of Qwen's video tower)
DECODED = "video_metadata"  # a part holding this key has been decoded
SAMPLING_KEYS = ("fps", "nframes", "min_frames", "max_frames", "sample_fps", "video_start", "video_end")


def is_video_part(part: Any) -> bool:
    return isinstance(part, dict) and (part.get("type") == "video" or "video" in part)


def message_videos(messages: list[dict]) -> list[dict]:
    """The video parts of a prompt's messages, in order."""
    return [part for message in messages if isinstance(message.get("content"), list)
            for part in message["content"] if is_video_part(part)]


def frame_count(part: dict, total: int, source_fps: float, max_frames: int | None) -> int:
    """How many frames to sample from a clip of `total` frames at `source_fps`: qwen-vl-utils' `smart_nframes`
    (the part's `nframes`, or its `fps` x duration within [min_frames, max_frames]), capped at `max_frames`,
    rounded down to an even count, at least 2 (a single-frame clip is repeated)."""
    from qwen_vl_utils.vision_process import smart_nframes

    ele = {key: part[key] for key in ("fps", "nframes", "min_frames", "max_frames") if key in part}
    if max_frames is not None:
        ele["max_frames"] = min(ele.get("max_frames", max_frames), max_frames)
    if total < FRAME_FACTOR:
        return FRAME_FACTOR
    ele["max_frames"] = max(min(ele.get("max_frames", total), total), FRAME_FACTOR)
    ele["min_frames"] = min(ele.get("min_frames", 4), ele["max_frames"])
    if "nframes" in ele:
        ele["nframes"] = min(max(ele["nframes"], FRAME_FACTOR), ele["max_frames"])
    return int(smart_nframes(ele, total_frames=total, video_fps=source_fps))


def frame_indices(total: int, count: int) -> list[int]:
    """`count` evenly spaced indices over `total` frames, as qwen-vl-utils picks them:
    round(linspace(0, total - 1, count)) (an index repeats only when the clip is shorter than `count`)."""
    if count == 1:
        return [0]
    return [int(_round_half_even(i * (total - 1) / (count - 1))) for i in range(count)]


def _round_half_even(value: float) -> int:
    """torch.round's rule (half to even), which qwen-vl-utils' `torch.linspace(...).round()` uses."""
    return round(value)


def decode_videos(messages: list[dict], *, max_frames: int | None, root: str | None = None,
                  allow_outside: bool = False, row: Any = None) -> list[dict]:
    """The messages with every video part decoded (see the module's docstring); raises BadRow for a video
    that cannot be read. Parts already decoded are kept as they are."""
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        message["content"] = [decode_video(part, max_frames=max_frames, root=root, allow_outside=allow_outside,
                                           row=row) if is_video_part(part) else part for part in content]
    return messages


def decode_video(part: dict, *, max_frames: int | None, root: str | None = None, allow_outside: bool = False,
                 row: Any = None) -> dict:
    """One video part, decoded: sampled RGB frames and the source's metadata."""
    if DECODED in part:
        return part
    value = part.get("video")
    where = "the video" + (f" of row {row}" if row is not None else "")
    if isinstance(value, (list, tuple)):
        frames, metadata = _from_frames(part, list(value), max_frames, root, allow_outside, where)
    elif isinstance(value, (str, os.PathLike)):
        frames, metadata = _from_file(part, _video_file(value, root, allow_outside), max_frames, where)
    else:
        raise BadRow("not a video", f"{where} is a {type(value).__name__}, not a file path or a list of frames; "
                                    "check the video column.")
    kept = {key: item for key, item in part.items() if key not in SAMPLING_KEYS and key != "video"}
    return {**kept, "type": "video", "video": frames, DECODED: metadata}


def _video_file(value, root: str | None, allow_outside: bool) -> Path:
    from gpg_vl.data.sources import data_file

    text = str(value)
    return data_file(text[7:] if text.startswith("file://") else text, root, allow_outside, "video")


def _from_frames(part: dict, values: list, max_frames: int | None, root, allow_outside: bool,
                 where: str) -> tuple[list, dict]:
    """A clip given as frames, taken at `fps` (or `sample_fps`) frames per second; an evenly spaced subset
    when it holds more than the limits allow, the last frame repeated to an even count."""
    from gpg_vl.data.sources import load_image

    if not values:
        raise BadRow("empty video", f"{where} is an empty list of frames; give at least one frame.")
    fps = float(part.get("sample_fps", part.get("fps", DEFAULT_FPS)))
    if not fps > 0:
        raise BadRow("bad video fps", f"{where} has fps {fps}; give a positive fps.")
    limit = min(max_frames or len(values), part.get("max_frames", len(values)), len(values))
    count = max(min(limit, part.get("nframes", len(values))), 1)
    indices = frame_indices(len(values), count) if count < len(values) else list(range(len(values)))
    frames = [load_image(values[i], image_root=root, allow_outside=allow_outside, row=where) for i in indices]
    indices, frames = _even(indices, frames)
    return frames, {"fps": fps, "frames_indices": indices, "total_num_frames": len(values)}


def _even(indices: list[int], frames: list) -> tuple[list[int], list]:
    """An even number of frames: the last one repeated once when the count is odd (as qwen-vl-utils pads)."""
    if len(frames) % FRAME_FACTOR:
        return indices + [indices[-1]], frames + [frames[-1]]
    return indices, frames


def _from_file(part: dict, file: Path, max_frames: int | None, where: str) -> tuple[list, dict]:
    """Sampled frames of a video file, decoded with PyAV; only the sampled frames are kept."""
    import av

    try:
        with av.open(str(file)) as container:
            if not container.streams.video:
                raise BadRow("undecodable video", f"{where} ({file.name}) has no video stream.")
            stream = container.streams.video[0]
            fps = float(stream.average_rate or stream.guessed_rate or 0)
            total = int(stream.frames or 0)
            if total <= 0 or fps <= 0:  # the container does not say: count by decoding
                return _from_counted(part, file, max_frames, where)
            return _sample(container, part, total, fps, max_frames, where)
    except BadRow:
        raise
    except _Recount:
        return _from_counted(part, file, max_frames, where)
    except Exception as error:  # FFmpeg's errors: a truncated file, an unknown codec, not a video at all
        from gpg_vl.data.sources import _reason

        raise BadRow("undecodable video", f"could not decode {where} ({file.name}: {_reason(error)}); check that "
                                          "it is a complete video file.") from error


def _sample(container, part: dict, total: int, fps: float, max_frames: int | None, where: str) -> tuple[list, dict]:
    count = frame_count(part, total, fps, max_frames)
    indices = frame_indices(total, count)
    wanted = set(indices)
    kept: dict[int, Image.Image] = {}
    seen = 0
    for seen, frame in enumerate(container.decode(video=0), start=1):
        if seen - 1 in wanted:
            kept[seen - 1] = frame.to_image().convert("RGB")
        if len(kept) == len(wanted):
            break
    if len(kept) < len(wanted):  # fewer frames than the header said: sample again over those decoded
        if seen == 0:
            raise BadRow("undecodable video", f"{where} has no decodable frame.")
        raise _Recount(seen)
    frames = [kept[i] for i in indices]
    indices, frames = _even(indices, frames)
    return frames, {"fps": fps, "frames_indices": indices, "total_num_frames": total}


class _Recount(Exception):
    def __init__(self, frames: int) -> None:
        super().__init__(frames)
        self.frames = frames


def _from_counted(part: dict, file: Path, max_frames: int | None, where: str) -> tuple[list, dict]:
    """A file whose header lacks the frame count or rate: frames counted by decoding, the rate from the
    stream's time base and the last frame's time."""
    import av

    with av.open(str(file)) as container:
        stream = container.streams.video[0]
        times = [frame.time for frame in container.decode(video=0)]
    if not times:
        raise BadRow("undecodable video", f"{where} ({file.name}) has no decodable frame.")
    span = (times[-1] or 0.0) - (times[0] or 0.0)
    fps = float(stream.average_rate or 0) or ((len(times) - 1) / span if span > 0 else DEFAULT_FPS)
    with av.open(str(file)) as container:
        return _sample(container, part, len(times), fps, max_frames, where)


def video_pixels(part: dict, defaults: dict) -> dict:
    """The part's pixel budgets (`min_pixels`, `max_pixels`, `total_pixels`), the family's defaults where the
    part sets none."""
    return {key: part.get(key, value) for key, value in defaults.items() if value is not None or key in part}

