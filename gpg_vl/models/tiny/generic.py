"""Tiny random models of the generic family's classes: real model, config and processor classes, local files.

Each builder writes a Hugging Face directory (seeded weights, a few layers, hidden size 32-64) whose tokenizer
is the embedded tiny model's byte-level BPE with that family's special tokens added and a chat template in
the family's own turn format (with the real template's video placeholder where the model reads video:
LLaVA-OneVision, GLM-4.1V, InternVL, Gemma 4), so nothing is downloaded. `GENERIC_BUILDERS` maps `tiny:<name>`
to its builder.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer

EMBEDDED_TINY = Path(__file__).resolve().parents[2] / "assets" / "tiny-qwen2.5-vl"
# Qwen-style turns; `{image}` is where an image part goes, `{video}` where a video part goes.
_TEMPLATE = (
    "{{% for message in messages %}}{turn_start}{{{{ message['role'] }}}}\n"
    "{{% if message['content'] is string %}}{{{{ message['content'] }}}}{{% else %}}"
    "{{% for content in message['content'] %}}"
    "{{% if content['type'] == 'image' or 'image' in content %}}{image}"
    "{{% elif content['type'] == 'video' or 'video' in content %}}{video}"
    "{{% elif 'text' in content %}}{{{{ content['text'] }}}}{{% endif %}}{{% endfor %}}{{% endif %}}{turn_end}\n"
    "{{% endfor %}}{{% if add_generation_prompt %}}{turn_start}assistant\n{{% endif %}}"
)
TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)
TINY_SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                   patch_size=8)


def chat_template(image: str, turn_start: str = "<|im_start|>", turn_end: str = "<|im_end|>",
                  video: str = "") -> str:
    """The tiny template: `video` is what a video part renders (the real model's placeholder; empty for a model
    without video, whose family refuses video prompts before rendering)."""
    return _TEMPLATE.format(image=image, turn_start=turn_start, turn_end=turn_end, video=video)


def tokenizer_with(specials: list[str], extra: dict[str, str] | None = None, eos: str = "<|im_end|>"):
    """The embedded tiny tokenizer with `specials` added and `extra` named special tokens (image_token, ...)."""
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_TINY, extra_special_tokens=dict(extra or {}))
    tokenizer.add_special_tokens({"additional_special_tokens": [t for t in specials if t not in tokenizer.get_vocab()]},
                                 replace_extra_special_tokens=False)
    tokenizer.eos_token = eos
    return tokenizer


def _save(path: Path, model, processor, tokenizer, seed_state=None) -> torch.nn.Module:
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    model.generation_config.eos_token_id = [eos]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return model


def _ids(tokenizer) -> dict:
    return dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.convert_tokens_to_ids(tokenizer.eos_token),
                bos_token_id=tokenizer.pad_token_id)


def build_llava_onevision(path: Path, seed: int = 0):
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
    )

    tokenizer = tokenizer_with(["<image>", "<video>"], {"image_token": "<image>", "video_token": "<video>"})
    size = {"height": 32, "width": 32}
    image_processor = LlavaOnevisionImageProcessor(size=size, crop_size=size, image_grid_pinpoints=[[32, 32]],
                                                   do_pad=True)
    processor = LlavaOnevisionProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                        video_processor=LlavaOnevisionVideoProcessor(size=size),
                                        num_image_tokens=16, vision_feature_select_strategy="full",
                                        chat_template=chat_template("<image>", video="<video>"))
    config = LlavaOnevisionConfig(
        text_config=dict(TINY_TEXT, model_type="qwen2", **_ids(tokenizer)),
        vision_config=dict(TINY_SIGLIP, model_type="siglip_vision_model", vision_use_head=False),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<video>"),
        image_grid_pinpoints=[[32, 32]], vision_feature_select_strategy="full", vision_feature_layer=-1,
        tie_word_embeddings=True)
    torch.manual_seed(seed)
    return _save(path, LlavaOnevisionForConditionalGeneration(config), processor, tokenizer)


def build_gemma3(path: Path, seed: int = 0):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor, Gemma3Processor

    extra = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer = tokenizer_with([*extra.values(), "<start_of_turn>", "<end_of_turn>"], extra, eos="<end_of_turn>")
    image_processor = Gemma3ImageProcessor(size={"height": 32, "width": 32})
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_length=4,
                                chat_template=chat_template("<start_of_image>", "<start_of_turn>", "<end_of_turn>"))
    text = dict(TINY_TEXT, **_ids(tokenizer), sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    config = Gemma3Config(text_config=text, vision_config=dict(TINY_SIGLIP, vision_use_head=False),
                          mm_tokens_per_image=4,
                          boi_token_index=tokenizer.boi_token_id, eoi_token_index=tokenizer.eoi_token_id,
                          image_token_index=tokenizer.image_token_id, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return _save(path, Gemma3ForConditionalGeneration(config), processor, tokenizer)


def build_gemma4(path: Path, seed: int = 0):
    """Gemma 4: its processor needs an audio feature extractor and audio tokens even for images; 70 soft
    tokens per image (its smallest), 8-px patches pooled 3 x 3, sliding + full attention, per-layer inputs."""
    from transformers import (
        Gemma4AudioFeatureExtractor,
        Gemma4Config,
        Gemma4ForConditionalGeneration,
        Gemma4ImageProcessor,
        Gemma4Processor,
        Gemma4VideoProcessor,
    )

    extra = {"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>", "audio_token": "<|audio|>",
             "boa_token": "<|audio>", "eoa_token": "<audio|>"}
    tokenizer = tokenizer_with([*extra.values(), "<|turn>", "<turn|>"], extra, eos="<turn|>")
    processor = Gemma4Processor(feature_extractor=Gemma4AudioFeatureExtractor(),
                                image_processor=Gemma4ImageProcessor(max_soft_tokens=70, patch_size=8),
                                tokenizer=tokenizer,
                                video_processor=Gemma4VideoProcessor(max_soft_tokens=70, patch_size=8),
                                image_seq_length=70,
                                chat_template=chat_template("<|image|>", "<|turn>", "<turn|>", video="<|video|>"))
    text = dict(TINY_TEXT, **_ids(tokenizer), sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                vocab_size_per_layer_input=len(tokenizer), hidden_size_per_layer_input=8, num_kv_shared_layers=0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=8, pooling_kernel_size=3, position_embedding_size=1024)
    config = Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                          boi_token_id=tokenizer.boi_token_id, eoi_token_id=tokenizer.eoi_token_id,
                          image_token_id=tokenizer.image_token_id, video_token_id=processor.video_token_id,
                          tie_word_embeddings=True)
    torch.manual_seed(seed)
    return _save(path, Gemma4ForConditionalGeneration(config), processor, tokenizer)


def build_smolvlm(path: Path, seed: int = 0):
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor, Idefics3Processor

    specials = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
    tokenizer = tokenizer_with(specials + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)],
                               {"image_token": "<image>"}, eos="<end_of_utterance>")
    image_processor = Idefics3ImageProcessor(size={"longest_edge": 32}, max_image_size={"longest_edge": 32},
                                             do_image_splitting=False)
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4,
                                  chat_template=chat_template("<image>", "<|im_start|>", "<end_of_utterance>"))
    config = Idefics3Config(text_config=dict(TINY_TEXT, model_type="llama", **_ids(tokenizer)),
                            vision_config=dict(TINY_SIGLIP, model_type="idefics3_vision"), scale_factor=2,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=True)
    torch.manual_seed(seed)
    return _save(path, Idefics3ForConditionalGeneration(config), processor, tokenizer)


def build_internvl(path: Path, seed: int = 0):
    from transformers import (
        GotOcr2ImageProcessor,
        InternVLConfig,
        InternVLForConditionalGeneration,
        InternVLProcessor,
        InternVLVideoProcessor,
    )

    extra = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
             "video_token": "<video>"}
    tokenizer = tokenizer_with(list(extra.values()), extra)
    size = {"height": 32, "width": 32}
    image_processor = GotOcr2ImageProcessor(size=size, crop_to_patches=False)
    processor = InternVLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                  video_processor=InternVLVideoProcessor(size=size), image_seq_length=4,
                                  chat_template=chat_template("<IMG_CONTEXT>", video="<video>"))
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=[32, 32],
                  patch_size=[8, 8], use_mean_pooling=False)
    config = InternVLConfig(vision_config=vision, text_config=dict(TINY_TEXT, model_type="qwen2", **_ids(tokenizer)),
                            image_token_id=tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"), image_seq_length=4,
                            downsample_ratio=0.5, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return _save(path, InternVLForConditionalGeneration(config), processor, tokenizer)


def build_glm4v(path: Path, seed: int = 0):
    from transformers import (
        Glm4vConfig,
        Glm4vForConditionalGeneration,
        Glm4vImageProcessor,
        Glm4vProcessor,
        Glm4vVideoProcessor,
    )

    specials = ["<|image|>", "<|video|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
                "<|end_of_video|>", "<|user|>", "<|assistant|>"]
    tokenizer = tokenizer_with(specials, {"image_token": "<|image|>", "video_token": "<|video|>"}, eos="<|user|>")
    pixels = dict(size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112}, patch_size=14, temporal_patch_size=2,
                  merge_size=2)
    template = ("{% for message in messages %}<|{{ message['role'] }}|>\n{% if message['content'] is string %}"
                "{{ message['content'] }}{% else %}{% for content in message['content'] %}"
                "{% if content['type'] == 'image' or 'image' in content %}<|begin_of_image|><|image|><|end_of_image|>"
                "{% elif content['type'] == 'video' or 'video' in content %}<|begin_of_video|><|video|><|end_of_video|>"
                "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    processor = Glm4vProcessor(image_processor=Glm4vImageProcessor(**pixels), tokenizer=tokenizer,
                               video_processor=Glm4vVideoProcessor(**pixels), chat_template=template)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in specials}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], "partial_rotary_factor": 0.5}
    text = dict(TINY_TEXT, **_ids(tokenizer), rope_parameters=rope)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, image_size=112, patch_size=14,
                  out_hidden_size=64, spatial_merge_size=2, temporal_patch_size=2)
    config = Glm4vConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image|>"],
                         video_token_id=ids["<|video|>"], image_start_token_id=ids["<|begin_of_image|>"],
                         image_end_token_id=ids["<|end_of_image|>"], video_start_token_id=ids["<|begin_of_video|>"],
                         video_end_token_id=ids["<|end_of_video|>"], tie_word_embeddings=True)
    torch.manual_seed(seed)
    return _save(path, Glm4vForConditionalGeneration(config), processor, tokenizer)


GENERIC_BUILDERS = {"glm4v": build_glm4v, "llava_onevision": build_llava_onevision, "gemma3": build_gemma3,
                    "gemma4": build_gemma4, "smolvlm": build_smolvlm,
                    "internvl": build_internvl}
