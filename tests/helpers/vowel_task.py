"""A task whose reward differs inside almost every group even for a random-weight model: the share of vowels in
the completion. The model tests use it to train untrained tiny models through the real trainer."""

from PIL import Image, ImageDraw

from gpg_vl.data.task import Task, image_question, register_task


@register_task
class Vowels(Task):
    name = "vowels"

    def __init__(self, size: int = 8) -> None:
        super().__init__()
        self.size = size
        self.reward_functions = {"vowels": lambda completion, row: vowel_share(completion)}

    def load(self, split: str) -> list[dict]:
        offset = 0 if split == self.train_split else 1000
        return [self.row(offset + i) for i in range(self.size)]

    def row(self, i: int) -> dict:
        image = Image.new("RGB", (112, 84), (40 + 50 * (i % 4), 80, 200 - 30 * (i % 5)))
        ImageDraw.Draw(image).ellipse((10 + i % 30, 10, 60 + i % 30, 60), fill=(230, 200, 40))
        return {"id": str(i), "image": image, "answer": "a"}

    def messages(self, row: dict) -> list[dict]:
        return image_question(row["image"], "Say something with many vowels.")


def vowel_share(text: str) -> float:
    return sum(c in "aeiou" for c in text.lower()) / max(len(text), 1)
