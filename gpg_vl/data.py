"""The prompt stream: an epoch-wise shuffled walk over a split's rows, with a resumable position."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class PromptStream:
    """Yields the row indices of B prompts at a time, global over processes; every process walks the
    same permutation (seeded by seed and epoch) and takes its own share, so no prompt repeats
    within an epoch and `state_dict()` / `load_state_dict()` resume exactly where it was."""

    def __init__(self, rows: Sequence, *, seed: int, rank: int = 0, world_size: int = 1) -> None:
        if len(rows) == 0:
            raise ValueError("the training split has no rows")
        self.rows, self.seed, self.rank, self.world_size = rows, seed, rank, world_size
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(len(self.rows), generator=generator).tolist()

    def next_indices(self, count: int) -> list[int]:
        """The next `count` global indices (crossing into the next epoch when needed)."""
        indices = []
        while len(indices) < count:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            take = min(count - len(indices), len(self._order) - self.position)
            indices += self._order[self.position:self.position + take]
            self.position += take
        return indices

    def next_local(self, global_count: int) -> list[tuple[int, dict]]:
        """This process's share (index, row) of the next `global_count` prompts."""
        indices = self.next_indices(global_count)[self.rank::self.world_size]
        return [(i, self.rows[i]) for i in indices]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
