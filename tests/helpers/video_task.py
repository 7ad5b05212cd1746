"""A small video task for the command-line tests: which way does the dot move? Clips are made on the fly, half
as lists of frames and half as MPEG-4 files written with PyAV next to the rows (so both readers run), and the
reward is the share of vowels in the completion plus the answer (so untrained tiny models get a signal)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from gpg_vl.data.task import Task, register_task
from helpers.video_clips import clip_frames, write_clip
from helpers.vowel_task import vowel_share

QUESTION = "Which way does the dot move, left or right? Answer in one word."


@register_task
class MovingDot(Task):
    name = "moving_dot"

    def __init__(self, size: int = 4, fps: float = 2.0) -> None:
        super().__init__()
        self.size, self.fps = size, fps
        self.folder = Path(tempfile.mkdtemp(prefix="gpg-vl-video-task-"))
        self.image_root = str(self.folder)
        self.reward_functions = {"vowels": lambda completion, row: vowel_share(completion),
                                 "answer": lambda completion, row: float(row["answer"] in completion.lower())}

    def load(self, split: str) -> list[dict]:
        offset = 0 if split == self.train_split else 1000
        return [self.row(offset + i) for i in range(self.size)]

    def row(self, i: int) -> dict:
        right = i % 2 == 0
        if i % 4 < 2:  # a list of frames
            frames = clip_frames(6 + i % 3)
            return {"id": str(i), "video": frames if right else frames[::-1], "answer": "right" if right else "left"}
        file = write_clip(self.folder / f"clip{i}.mp4", seconds=2, fps=4)  # right-moving; reversed by nothing
        return {"id": str(i), "video": file.name, "answer": "right"}

    def messages(self, row: dict) -> list[dict]:
        return [{"role": "user", "content": [{"type": "video", "video": row["video"], "fps": self.fps},
                                             {"type": "text", "text": QUESTION}]}]
