"""The keyword a model takes its key/value cache under (`gpg_vl.models.cache.cache_keyword`): transformers 5.24
renamed `past_key_values` to `cache`; a cache passed under the name the installed transformers does not take is
ignored (tests/integration/test_vllm_real.py runs the forked-cache paths on transformers 5.19)."""

from __future__ import annotations

import torch

from gpg_vl.models.cache import cache_keyword


class Before(torch.nn.Module):  # transformers < 5.24
    def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
        return input_ids


class After(torch.nn.Module):  # transformers >= 5.24
    def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs):
        return input_ids


def test_the_cache_keyword_is_the_one_the_models_forward_names():
    assert cache_keyword(Before()) == "past_key_values" and cache_keyword(After()) == "cache"


def test_the_installed_transformers_model_names_its_keyword_through_its_deprecation_wrapper(policy):
    """transformers >= 5.24 wraps forward in `deprecate_kwarg("past_key_values", ..., new_name="cache")`: the
    signature seen through the wrapper is the new one (the outer model and its inner language model alike)."""
    import transformers

    expected = "cache" if tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (5, 24) else \
        "past_key_values"
    assert cache_keyword(policy.model) == cache_keyword(policy.model.model) == expected
