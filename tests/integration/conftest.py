"""Fixtures the integration tests share."""

import pytest


@pytest.fixture()
def no_model(monkeypatch):
    """Fail the test if the policy model starts loading: the checks under test must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the check")

    monkeypatch.setattr("gpg_vl.train.build.build_policy", refuse)
