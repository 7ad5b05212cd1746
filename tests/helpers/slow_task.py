"""A test task whose reward never returns for the completions of one row until the test releases it: a reward
that overruns any budget, so the tests can count the completions the trainer stops waiting for."""

import threading

from gpg_vl.data.task import register_task
from helpers.vowel_task import Vowels, vowel_share

RELEASE = threading.Event()  # set by the test when it is done: the blocked reward calls then return
SLOW_ROWS = ("0", "1000")  # the first row of the train split and of the held-out split


@register_task
class SlowVowels(Vowels):
    name = "slow_vowels"

    def __init__(self, size: int = 4) -> None:
        super().__init__(size=size)
        self.reward_functions = {"vowels": slow_vowels}


def slow_vowels(completion: str, row: dict) -> float:
    if row["id"] in SLOW_ROWS:
        RELEASE.wait()
    return vowel_share(completion)
