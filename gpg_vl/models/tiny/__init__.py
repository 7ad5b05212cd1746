"""Tiny Qwen-VL models of each family: real classes, local files, no download.

`build_tiny(path)` writes a Hugging Face directory with a random-weight
`Qwen2_5_VLForConditionalGeneration` (about 3M parameters), a small byte-level BPE `Qwen2Tokenizer`
that carries Qwen's special tokens and chat template, and a real `Qwen2_5_VLProcessor`. Everything is
seeded, so the same call writes the same files. `scripts/build_tiny.py` then warm-starts it with a
short supervised pass on the `shapes` task and ships the result under `gpg_vl/assets/`.

`build_tiny_family(path, family)` writes a random-weight tiny model of another family (`qwen2_vl`,
`qwen3_vl`) with the embedded model's tokenizer and that family's real processor; `tiny_model_path`
builds one on first use into a cache folder, which is what `name_or_path: tiny:<family>` means.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoTokenizer,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2Tokenizer,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

# The special tokens of the real Qwen2.5-VL tokenizer, in its order.
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]

# Qwen2-VL / Qwen2.5-VL's published chat template.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TINY_TEXT = dict(
    hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=2048, rope_theta=10000.0,
    rope_scaling={"type": "mrope", "mrope_section": [8, 8, 8]},
)
TINY_VISION = dict(
    depth=4, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=192,
    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
    fullatt_block_indexes=[1, 3],
)
TINY_PIXELS = dict(min_pixels=56 * 56, max_pixels=224 * 224)


def train_tokenizer(corpus: list[str], vocab_size: int = 512) -> Qwen2Tokenizer:
    """A byte-level BPE with Qwen's pre-tokenizer, trained on `corpus`, wrapped as a Qwen2Tokenizer."""
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer=trainer)
    model_state = backend.model
    vocab = backend.get_vocab()
    merges_path = Path(model_state.save(str(_scratch_dir()))[1])
    merges = [tuple(line.split(" ")) for line in merges_path.read_text().splitlines()[1:] if line]
    tokenizer = Qwen2Tokenizer(
        vocab=vocab, merges=merges, unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:], model_max_length=4096,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _scratch_dir() -> Path:
    import tempfile

    return Path(tempfile.mkdtemp(prefix="gpg-vl-tok-"))


def build_tiny(path: str | Path, corpus: list[str], seed: int = 0) -> Qwen2_5_VLForConditionalGeneration:
    """Write a random-weight tiny Qwen2.5-VL with tokenizer and processor to `path`; return the model."""
    tokenizer = train_tokenizer(corpus)
    image_processor = Qwen2VLImageProcessor(
        min_pixels=TINY_PIXELS["min_pixels"], max_pixels=TINY_PIXELS["max_pixels"],
        patch_size=14, temporal_patch_size=2, merge_size=2,
    )
    video_processor = Qwen2VLVideoProcessor(
        min_pixels=TINY_PIXELS["min_pixels"], max_pixels=TINY_PIXELS["max_pixels"],
        patch_size=14, temporal_patch_size=2, merge_size=2,
    )
    processor = Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                    video_processor=video_processor, chat_template=CHAT_TEMPLATE)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    config = Qwen2_5_VLConfig(
        text_config=dict(TINY_TEXT, vocab_size=len(tokenizer), bos_token_id=ids["<|endoftext|>"],
                         eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"]),
        vision_config=TINY_VISION,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.generation_config.bos_token_id = ids["<|endoftext|>"]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return model


# Other families, same text size; each vision tower keeps its family's shape (patch 14 for Qwen2-VL,
# patch 16 with learned position embeddings and DeepStack taps for Qwen3-VL).
TINY_QWEN2_VISION = dict(depth=4, embed_dim=128, num_heads=4, mlp_ratio=2, hidden_size=192, patch_size=14,
                         spatial_merge_size=2, temporal_patch_size=2)
TINY_QWEN3_VISION = dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=192,
                         patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                         deepstack_visual_indexes=[1, 2])
TINY_QWEN3_TEXT = dict(
    hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=48, max_position_embeddings=2048,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 8, 8],
                     "mrope_interleaved": True},
)
# Qwen3.5: three Gated DeltaNet layers and one full-attention layer (its published 3:1 pattern), small heads.
TINY_QWEN3_5_TEXT = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=2048, linear_conv_kernel_dim=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                     "mrope_interleaved": True, "partial_rotary_factor": 0.5},
)
TINY_QWEN3_5_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64)
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# Qwen3.5's chat template at the generation prompt: a think block opened (the default), or, with
# enable_thinking=false, an empty closed one; the rest is Qwen's template.
QWEN3_5_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is "
    "false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")
TINY_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
EMBEDDED_TINY = Path(__file__).resolve().parents[2] / "assets" / "tiny-qwen2.5-vl"
CACHE_ENV = "GPG_VL_CACHE"


def _qwen_tiny(family: str, tokenizer, ids: dict, special: dict, vision_ids: dict, pixels: dict):
    """(model class, config, processor) of a tiny random Qwen model of `family`."""
    import transformers as tf

    image_processor = Qwen2VLImageProcessor(**pixels)
    if family == "qwen2_vl":
        text = {key: value for key, value in TINY_TEXT.items() if key != "rope_scaling"}
        config = Qwen2VLConfig(
            text_config=dict(text, vocab_size=len(tokenizer), **special,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "mrope_section": [8, 8, 8]}),
            vision_config=TINY_QWEN2_VISION, tie_word_embeddings=True, **vision_ids)
        processor = Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                     video_processor=Qwen2VLVideoProcessor(**pixels), chat_template=CHAT_TEMPLATE)
        return Qwen2VLForConditionalGeneration, config, processor
    template = QWEN3_5_CHAT_TEMPLATE if family.startswith("qwen3_5") else CHAT_TEMPLATE
    processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                 video_processor=Qwen3VLVideoProcessor(**pixels), chat_template=template)
    moe = TINY_MOE if family.endswith("_moe") else {}
    if family.startswith("qwen3_vl"):
        text, vision = dict(TINY_QWEN3_TEXT, **moe), TINY_QWEN3_VISION
    else:
        text, vision = dict(TINY_QWEN3_5_TEXT, **moe), TINY_QWEN3_5_VISION
        if moe:
            text.update(shared_expert_intermediate_size=32)
            text.pop("intermediate_size")
    name = {"qwen3_vl": "Qwen3VL", "qwen3_vl_moe": "Qwen3VLMoe", "qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe"}[
        family]
    config = getattr(tf, f"{name}Config")(text_config=dict(text, vocab_size=len(tokenizer), **special),
                                          vision_config=vision, tie_word_embeddings=True, **vision_ids)
    return getattr(tf, f"{name}ForConditionalGeneration"), config, processor


def build_tiny_family(path: str | Path, family: str, seed: int = 0):
    """Write a random-weight tiny model of `family` (its real model, config and processor classes) to `path`.

    The Qwen families share the embedded model's tokenizer, so every tiny Qwen reads the same vocabulary;
    the generic families (gpg_vl/models/tiny/generic.py) each get a tokenizer with their own special tokens.
    """
    if family not in TINY_FAMILIES or family == "qwen2_5_vl":
        from gpg_vl.models.tiny.generic import GENERIC_BUILDERS

        if family not in GENERIC_BUILDERS:
            raise ValueError(f"no tiny builder for family {family!r}; the qwen2_5_vl one is embedded (model=tiny).")
        return GENERIC_BUILDERS[family](Path(path), seed)
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_TINY)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    special = dict(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    vision_ids = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                      vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    patch = 14 if family == "qwen2_vl" else 16
    pixels = dict(min_pixels=TINY_PIXELS["min_pixels"], max_pixels=TINY_PIXELS["max_pixels"], patch_size=patch,
                  temporal_patch_size=2, merge_size=2)
    model_class, config, processor = _qwen_tiny(family, tokenizer, ids, special, vision_ids, pixels)
    torch.manual_seed(seed)
    model = model_class(config)
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.generation_config.bos_token_id = ids["<|endoftext|>"]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return model


def tiny_names() -> tuple[str, ...]:
    """Every tiny model that `tiny:<name>` can build: the Qwen families and the generic family's classes."""
    from gpg_vl.models.tiny.generic import GENERIC_BUILDERS

    return TINY_FAMILIES + tuple(GENERIC_BUILDERS)


def tiny_model_path(family: str) -> Path:
    """The cached tiny model of `family`, built (seeded, so always the same) the first time it is asked for.

    The cache is `$GPG_VL_CACHE` or `~/.cache/gpg-vl`; a build goes to a temporary folder that is renamed
    into place, so concurrent first uses never see half a model.
    """
    if family == "qwen2_5_vl":
        return EMBEDDED_TINY
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "gpg-vl")
    path = root / f"tiny-{family}"
    if not (path / "config.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f"tiny-{family}-", dir=root))
        build_tiny_family(partial, family)
        try:
            partial.rename(path)
        except OSError:  # another process finished first
            shutil.rmtree(partial, ignore_errors=True)
    return path
