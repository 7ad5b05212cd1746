"""Reading and sampling videos (gpg_vl/data/video.py): hand-worked frame choices, qwen-vl-utils' rule as the
reference, the metadata the processors read, and the bad rows a broken video makes."""

from __future__ import annotations

import pytest
import torch
from helpers.video_clips import clip_frames, write_clip
from PIL import Image

from gpg_vl.data.video import DECODED, decode_video, frame_count, frame_indices
from gpg_vl.errors import BadRow


def test_frame_indices_are_qwen_vl_utils_linspace_rounded():
    # hand-worked: 32 frames, 8 kept: i * 31 / 7 = 0, 4.43, 8.86, 13.29, 17.71, 22.14, 26.57, 31
    assert frame_indices(32, 8) == [0, 4, 9, 13, 18, 22, 27, 31]
    assert frame_indices(32, 4) == [0, 10, 21, 31]  # 0, 10.33, 20.67, 31
    for total in range(2, 60):  # the reference: qwen-vl-utils' torch.linspace(0, total - 1, n).round()
        for count in range(2, total + 1, 2):
            assert frame_indices(total, count) == torch.linspace(0, total - 1, count).round().long().tolist()


def test_frame_count_follows_fps_within_the_limits():
    assert frame_count({"fps": 2}, 32, 8.0, None) == 8  # 4 s x 2 fps
    assert frame_count({"fps": 1}, 32, 8.0, None) == 4  # 4 s x 1 fps
    assert frame_count({"fps": 2}, 32, 8.0, 6) == 6  # data.max_video_frames
    assert frame_count({"fps": 2}, 32, 8.0, 5) == 4  # an even count
    assert frame_count({"nframes": 10}, 32, 8.0, None) == 10
    assert frame_count({"fps": 0.1}, 32, 8.0, None) == 4  # qwen-vl-utils' min_frames
    assert frame_count({}, 3, 8.0, None) == 2  # a clip shorter than min_frames


@pytest.mark.parametrize("fps, indices", [(2, [0, 4, 9, 13, 18, 22, 27, 31]), (1, [0, 10, 21, 31])])
def test_a_file_is_sampled_once_with_its_own_metadata(tmp_path, fps, indices):
    clip = write_clip(tmp_path / "clip.mp4")  # 4 s at 8 fps
    part = decode_video({"type": "video", "video": str(clip), "fps": fps, "max_pixels": 999}, max_frames=16)
    assert part[DECODED] == {"fps": 8.0, "frames_indices": indices, "total_num_frames": 32}
    assert len(part["video"]) == len(indices) and all(isinstance(f, Image.Image) for f in part["video"])
    assert part["max_pixels"] == 999 and "fps" not in part  # pixel budgets kept for the family, sampling done
    assert decode_video(part, max_frames=16) is part  # decoded once


def test_a_list_of_frames_is_a_clip_at_its_fps_without_a_decoder():
    frames = clip_frames(8)
    part = decode_video({"type": "video", "video": frames, "fps": 2}, max_frames=16)
    assert part[DECODED] == {"fps": 2.0, "frames_indices": list(range(8)), "total_num_frames": 8}
    assert [f.tobytes() for f in part["video"]] == [f.tobytes() for f in frames]
    capped = decode_video({"type": "video", "video": clip_frames(9)}, max_frames=4)  # 9 frames, at most 4
    assert capped[DECODED]["frames_indices"] == [0, 3, 5, 8] and capped[DECODED]["fps"] == 2.0
    odd = decode_video({"type": "video", "video": clip_frames(3)}, max_frames=16)  # padded to a pair
    assert odd[DECODED]["frames_indices"] == [0, 1, 2, 2] and len(odd["video"]) == 4


def test_max_video_frames_bounds_a_file(tmp_path):
    clip = write_clip(tmp_path / "clip.mp4")
    part = decode_video({"video": str(clip), "fps": 8}, max_frames=6)
    assert part[DECODED]["frames_indices"] == frame_indices(32, 6)


@pytest.mark.parametrize("value, reason", [
    ("missing.mp4", "missing video file"), ("corrupt", "undecodable video"), ([], "empty video"),
    (42, "not a video"), ("outside", "video path outside the image root")])
def test_a_video_that_cannot_be_read_is_a_bad_row_with_its_reason(tmp_path, value, reason):
    if value == "corrupt":
        value = str(tmp_path / "corrupt.mp4")
        (tmp_path / "corrupt.mp4").write_bytes(b"\x00\x01 not a video " * 50)
    if value == "outside":
        value = "../elsewhere.mp4"
    with pytest.raises(BadRow) as error:
        decode_video({"type": "video", "video": value}, max_frames=16, root=str(tmp_path), row=3)
    assert error.value.reason == reason
