"""`needs_bwrap`: the python tool's tests that run code in the bwrap sandbox are skipped where it cannot start (a
developer's machine without user namespaces), never in CI (CI=true), where the sandbox must work."""

from __future__ import annotations

import os

import pytest

from gpg_vl.rollout.multiturn.sandbox import SANDBOXES

PROBLEM = SANDBOXES["bwrap"].problem()
needs_bwrap = pytest.mark.skipif(PROBLEM is not None and not os.environ.get("CI"),
                                 reason=f"no bwrap sandbox here: {PROBLEM}")
