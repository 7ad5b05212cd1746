"""Model loading and the per-family adapters.

`load_policy(...)` reads a hub id or a local directory and returns a `Policy`: the model, its processor
and the adapter of its family. Everything a family does differently lives in its adapter.
"""

from __future__ import annotations

from gpg_vl.models.load import Policy, PromptBatch, load_policy

__all__ = ["Policy", "PromptBatch", "load_policy"]
