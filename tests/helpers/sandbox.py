"""`needs_bwrap`: the python tool's tests that run code in the bwrap sandbox are skipped where it cannot start (a
developer's machine without user namespaces), never in CI, where the sandbox must work: .ci/run sets
GPG_VL_NEEDS_SANDBOX=1 (a CI service's own CI=true counts too), and there a missing sandbox fails its tests."""

from __future__ import annotations

import os

import pytest

from gpg_vl.rollout.multiturn.sandbox import SANDBOXES

PROBLEM = SANDBOXES["bwrap"].problem()
REQUIRED = bool(os.environ.get("GPG_VL_NEEDS_SANDBOX") or os.environ.get("CI"))
needs_bwrap = pytest.mark.skipif(PROBLEM is not None and not REQUIRED,
                                 reason=f"no bwrap sandbox here: {PROBLEM}")
