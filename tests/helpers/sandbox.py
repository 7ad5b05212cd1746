"""`needs_bwrap`: the python tool's tests that run code in the bwrap sandbox are skipped where it cannot start (not
installed, no libseccomp, or a machine without user namespaces: one interpreter is started to find out, as the
trainer does before the model loads), never in CI, where the sandbox must work: .ci/run sets
GPG_VL_NEEDS_SANDBOX=1 (a CI service's own CI=true counts too), and there a missing sandbox fails its tests."""

from __future__ import annotations

import os

import pytest

from gpg_vl.rollout.multiturn.sandbox import SandboxSpec, sandbox_problem
from gpg_vl.rollout.settings import PythonToolSettings

REQUIRED = bool(os.environ.get("GPG_VL_NEEDS_SANDBOX") or os.environ.get("CI"))
PROBLEM = None if REQUIRED else sandbox_problem(SandboxSpec.from_settings(PythonToolSettings(sandbox="bwrap"), 1))
needs_bwrap = pytest.mark.skipif(PROBLEM is not None, reason=f"no bwrap sandbox here: {PROBLEM}")
