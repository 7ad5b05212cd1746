"""The generic family: any `AutoModelForImageTextToText` model whose `AutoProcessor` has a chat template.

It follows transformers' multimodal conventions only: the processor's chat template renders the prompt,
the processor turns texts and images into tensors, the model's forward takes `input_ids`, `attention_mask`,
the pixel tensors, and, where it can (`mm_encoder_outputs`), image features computed beforehand, which is
how a group shares one encoding of its images. Prompt-once runs on the forked cache with positions from
the attention mask, or, for a model with multimodal rotary positions (`get_rope_index`, GLM-4.1V), from
the model's own rule on the whole sequence. `describe` says in one line which paths a model takes.
The box frame is the model's published convention where one is known (`BOX_FRAME_OF`), else none.
Video prompts go to the model types listed in `VIDEO_PLACEHOLDERS` (GLM-4.1V, InternVL, Gemma 4): frames read once
per prompt (data/video.py) and given to the processor with their metadata; the others refuse them in one sentence
naming the model and why (`NO_VIDEO`), see docs/video.md.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from gpg_vl.data.video import DECODED, decode_video, message_videos
from gpg_vl.errors import UserError
from gpg_vl.models.batch import PromptBatch, image_order, message_images, per_prompt_rows, unwrap
from gpg_vl.models.family import Family, register_family
from gpg_vl.models.positions import model_rope_index

# Published box conventions of some model types (their model cards); others declare none.
BOX_FRAME_OF = {"glm4v": "relative-1000", "glm4v_moe": "relative-1000", "glm46v": "relative-1000",
                "internvl": "relative-1000", "llava_onevision": "relative-1"}
# Special tokens of image placeholders, suppressed in sampling and scoring where the vocabulary has them.
VISION_TOKENS = ("<image>", "<image_soft_token>", "<start_of_image>", "<end_of_image>", "<IMG_CONTEXT>", "<img>",
                 "</img>", "<fake_token_around_image>", "<global-img>", "<|image|>", "<|begin_of_image|>",
                 "<|end_of_image|>", "<video>", "<|video|>", "<|image_pad|>", "<|vision_start|>",
                 "<|vision_end|>", "<|image_soft_token|>", "<|image>", "<image|>")
# Model types whose later-turn images do not match their placeholders (measured on the tiny models,
# tests/integration/test_observations.py): they refuse rollout.max_turns > 1.
NO_LATER_IMAGES = {
    "llava_onevision": "its processor counts a tool image's tokens as a lone image's (any-resolution tiles) while "
                       "the model reads a conversation's several images without tiles, so they would not match",
}
# Model types that take video prompts: their processor reads the frames with the source's metadata and their model
# takes the video tensors (checked on transformers' processors and tested on the tiny models, docs/video.md).
# GLM-4.1V: flattened patches per frame pair with `video_grid_thw`, a timestamp written after each frame pair.
# InternVL: each frame an image tile ("Frame1: <img>...</img>") in `pixel_values`, no timestamps; its processor
# stacks one call's videos into one tensor, so it is called once per prompt (`_encode_each`).
# `VIDEO_PLACEHOLDERS`: what stands for a video in a raw-text prompt (the real chat templates' video part).
# Gemma 4: frames concatenated in `pixel_values_videos` with `num_frames_per_video`, an `mm:ss` timestamp before each.
VIDEO_PLACEHOLDERS = {"glm4v": "<|begin_of_video|><|video|><|end_of_video|>", "internvl": "<video>",
                      "gemma4": "<|video|>"}
VIDEO_MODEL_TYPES = tuple(VIDEO_PLACEHOLDERS)
ONE_CALL_PER_PROMPT = ("internvl",)
# Why other model types refuse video (what their processors and models do in transformers 5.x).
NO_VIDEO = {
    "llava_onevision": "its model stacks a batch's videos into one tensor, so clips with different frame counts "
                       "cannot share a batch",
    "gemma3": "its processor takes no video",
    "idefics3": "its processor (Idefics3Processor) takes no video",
}
EOS_TOKENS = ("<end_of_turn>", "<|im_end|>", "<end_of_utterance>", "<|endoftext|>", "<|user|>", "<eos>",
              "<turn|>")


@register_family
class GenericFamily(Family):
    name = "generic"
    pixel_keys = ("pixel_values", "pixel_values_videos")
    vision_tokens = VISION_TOKENS
    eos_tokens = EOS_TOKENS

    def __init__(self, processor, config, **kwargs) -> None:
        super().__init__(processor, config, **kwargs)
        self.box_frame = BOX_FRAME_OF.get(getattr(config, "model_type", ""), "none")
        self.image_placeholder = getattr(processor, "image_token", None) or "<image>"
        self.video_placeholder = VIDEO_PLACEHOLDERS.get(getattr(config, "model_type", ""))
        image_processor = getattr(processor, "image_processor", None)
        size = getattr(image_processor, "size", None) or {}
        side = size.get("height") or size.get("shortest_edge") or size.get("longest_edge") or 32
        self.placeholder_size = (int(side), int(side))

    def encode(self, messages_batch: list[list[dict]], ids: list[str] | None = None,
               tools: list[dict] | None = None) -> PromptBatch:
        """Chat messages -> left-padded processor inputs, images and video frames as the processor resizes them;
        videos are read once (data/video.py, unless the stream already did) and go in with their metadata."""
        videos = [[decode_video(part, max_frames=None) for part in message_videos(messages)]
                  for messages in messages_batch]
        if any(videos) and self.videos_unsupported():
            raise UserError(self.videos_unsupported())
        texts = [self.render(messages, tools) for messages in messages_batch]
        images = [message_images(messages) for messages in messages_batch]
        images_per_prompt = [len(prompt_images) for prompt_images in images]
        videos_per_prompt = [len(prompt_videos) for prompt_videos in videos]
        self.tokenizer.padding_side = "left"
        kwargs = {"images": images} if sum(images_per_prompt) else {}
        if sum(videos_per_prompt):  # frames sampled already: the processor must not sample again
            flat = [video for prompt_videos in videos for video in prompt_videos]
            kwargs.update(videos=[video["video"] for video in flat], do_sample_frames=False,
                          video_metadata=[dict(video[DECODED]) for video in flat])
        sizes = [[(*image.size, *image.size) for image in prompt_images] for prompt_images in images]
        if sum(videos_per_prompt) and getattr(self.config, "model_type", "") in ONE_CALL_PER_PROMPT:
            inputs, rows = self._encode_each(texts, images, videos)
            return PromptBatch(inputs, images_per_prompt, list(ids or []), sizes, rows, texts, videos_per_prompt)
        inputs = dict(self.processor(text=texts, padding=True, return_tensors="pt", **kwargs,
                                     **self.processor_kwargs))
        rows = _video_rows(inputs, videos_per_prompt)
        rows.update(_row_layout({k: v for k, v in inputs.items() if k not in rows}, images_per_prompt,
                                self._image_token_id()))
        return PromptBatch(inputs, images_per_prompt, list(ids or []), sizes, rows, texts,
                           videos_per_prompt if sum(videos_per_prompt) else [])

    def videos_unsupported(self) -> str | None:
        return video_refusal(getattr(self.config, "model_type", "generic"))

    def _encode_each(self, texts: list[str], images: list[list], videos: list[list[dict]]) -> tuple[dict, dict]:
        """One processor call per prompt, merged: per-token inputs left-padded, the others concatenated, each
        prompt owning the rows its call returned."""
        outputs = []
        for text, prompt_images, prompt_videos in zip(texts, images, videos, strict=True):
            if len({len(video["video"]) for video in prompt_videos}) > 1:
                raise UserError(f"the {self.config.model_type} model's processor cannot take videos of different "
                                "frame counts in one prompt; give each video part the same `nframes`.")
            kwargs = {"videos": [video["video"] for video in prompt_videos], "do_sample_frames": False,
                      "video_metadata": [dict(video[DECODED]) for video in prompt_videos]} if prompt_videos else {}
            outputs.append(dict(self.processor(text=[text], images=prompt_images or None, return_tensors="pt",
                                               **kwargs, **self.processor_kwargs)))
        return _merge_prompts(outputs, self.pad_id)

    def vision_features(self, model, prompts: PromptBatch, prompt_index: list[int]) -> dict:
        """`mm_encoder_outputs`: the images' and the videos' tower outputs, each once per distinct prompt (a model
        whose processor folds video frames into `pixel_values`, InternVL, encodes them with the images)."""
        folded = prompts.has_videos and "pixel_values_videos" not in prompts.inputs
        features = {}
        if prompts.has_images or folded:
            features["image"] = self.image_features(model, prompts, prompt_index)
        if prompts.has_videos and not folded:
            features["video"] = self._video_features(model, prompts, prompt_index)
        return features

    def _video_features(self, model, prompts: PromptBatch, prompt_index: list[int]):
        """The video tower's outputs for each distinct prompt's videos, listed per sequence (no copy)."""
        subset = prompts.select(sorted(set(prompt_index)))
        encoder = model.model.get_video_features
        accepted = inspect.signature(encoder).parameters
        extra = {key: value for key, value in subset.inputs.items() if key in accepted and key != "pixel_values_videos"}
        encoded = encoder(subset.inputs["pixel_values_videos"], **extra, return_dict=True)
        order = image_order(prompts, prompt_index, prompts.videos_per_prompt)
        pooled = encoded.pooler_output  # per video: a list, or a tensor with that first dimension
        encoded.pooler_output = pooled[torch.tensor(order, device=pooled.device)] if isinstance(pooled, Tensor) \
            else [pooled[i] for i in order]
        return encoded

    def multi_turn_unsupported(self) -> str | None:
        reason = NO_LATER_IMAGES.get(getattr(self.config, "model_type", ""))
        if reason is not None:
            return f"a {self.config.model_type} model cannot take images in a later turn ({reason})"
        return super().multi_turn_unsupported()

    def _image_token_id(self) -> int | None:
        token_id = getattr(self.processor, "image_token_id", None)
        if token_id is None and getattr(self.processor, "image_token", None):
            token_id = self.tokenizer.convert_tokens_to_ids(self.processor.image_token)
        return token_id if isinstance(token_id, int) else None

    def position_ids(self, model, inputs: dict[str, Tensor]) -> Tensor | None:
        """Positions [N, L] from the attention mask, or the model's own multimodal rotary positions [3, N, L]
        (`get_rope_index`, given whichever of the batch's inputs it takes: GLM-4.1V's rule)."""
        self.reset_positions(model)
        if not _multimodal_rope(model):
            return super().position_ids(model, inputs)
        return model_rope_index(model, inputs)  # GLM-4.1V: a timestamp between frames, so vLLM's rule (measured)

    def prompt_once_unsupported(self, model: torch.nn.Module) -> str | None:
        return None

    def prefill_once_unsupported(self, model: torch.nn.Module) -> str | None:
        # Measured on tiny Gemma 3 (tests/integration/test_fast_paths.py): with prompts longer than the sliding window,
        # generate's continuation of a forked sliding-window cache gives other greedy tokens than its own prefill.
        text = getattr(unwrap(model).config, "text_config", unwrap(model).config)
        if "sliding_attention" in (getattr(text, "layer_types", None) or []):
            return "its sliding-window layers do not continue a forked prefill exactly in generate"
        return None


def _multimodal_rope(model: torch.nn.Module) -> bool:
    """Whether the bare `model` computes multimodal rotary positions itself (`get_rope_index`)."""
    return hasattr(getattr(model, "model", None), "get_rope_index")


def _merge_prompts(outputs: list[dict[str, Tensor]], pad_id: int) -> tuple[dict, dict]:
    """Single-prompt processor outputs as one left-padded batch, and each prompt's rows of the other keys."""
    length = max(output["input_ids"].shape[1] for output in outputs)
    keys = dict.fromkeys(key for output in outputs for key in output)
    inputs, rows = {}, {}
    for key in keys:
        example = next(output[key] for output in outputs if key in output)
        if all(key in output and output[key].shape == output["input_ids"].shape for output in outputs):
            fill = pad_id if key == "input_ids" else 0
            inputs[key] = torch.cat([torch.nn.functional.pad(output[key], (length - output[key].shape[1], 0),
                                                             value=fill) for output in outputs])  # [B, P]
            continue
        parts = [output.get(key, example[:0]) for output in outputs]
        inputs[key], rows[key] = torch.cat(parts), [part.shape[0] for part in parts]
    return inputs, rows


def _video_rows(inputs: dict[str, Tensor], videos_per_prompt: list[int]) -> dict[str, list[int]]:
    """How many rows of the video outputs belong to each prompt: flattened patches (with a `video_grid_thw`,
    GLM-4.1V) get each prompt's patch count, the grid one row per video; frames (with `num_frames_per_video`,
    Gemma 4) each prompt's frame count, in the pixels and the patch positions."""
    if isinstance(inputs.get("video_grid_thw"), Tensor):
        patches = per_prompt_rows(inputs["video_grid_thw"].prod(dim=1).tolist(), videos_per_prompt)
        return {"pixel_values_videos": patches, "video_grid_thw": list(videos_per_prompt)}
    if isinstance(inputs.get("num_frames_per_video"), Tensor):
        frames = per_prompt_rows(inputs["num_frames_per_video"].tolist(), videos_per_prompt)
        return {"pixel_values_videos": frames, "video_position_ids": frames,
                "num_frames_per_video": list(videos_per_prompt)}
    return {}


def _row_layout(inputs: dict[str, Tensor], images_per_prompt: list[int],
                image_token_id: int | None = None) -> dict[str, list[int]]:
    """How many rows of each processor output belong to each prompt (see `PromptBatch.rows`).

    A tensor with one row per prompt needs no entry; one row per image gets the prompts' image counts;
    flattened patches (with an `image_grid_thw`) get each prompt's patch count; tiles (with a per-image
    tile count, `num_patches`) each prompt's tile count. Otherwise (InternVL's tiles), rows in proportion to
    each prompt's image tokens, when every row stands for the same number of them.
    """
    batch, images = inputs["input_ids"].shape[0], sum(images_per_prompt)

    def per_prompt(per_image: list[int]) -> list[int]:
        return per_prompt_rows(per_image, images_per_prompt)

    layouts = {"image": list(images_per_prompt)}
    if isinstance(inputs.get("image_grid_thw"), Tensor):
        layouts["patches"] = per_prompt(inputs["image_grid_thw"].prod(dim=1).tolist())
    for key in ("num_patches", "image_num_patches"):
        if isinstance(inputs.get(key), Tensor):
            layouts["tiles"] = per_prompt(inputs[key].tolist())
    rows = {}
    for key, value in inputs.items():
        if not isinstance(value, Tensor) or value.ndim == 0:
            continue
        first = value.shape[0]
        if first == batch and (images == batch and images_per_prompt == [1] * batch or images != batch):
            continue  # one row per prompt
        for layout in ("patches", "tiles", "image"):
            if layout in layouts and first == sum(layouts[layout]):
                rows[key] = layouts[layout]
                break
        else:
            if image_token_id is not None and first > 0:
                tokens = (inputs["input_ids"] == image_token_id).sum(dim=1).tolist()  # [B]
                if sum(tokens) % first == 0 and all(t % (sum(tokens) // first) == 0 for t in tokens):
                    rows[key] = [t // (sum(tokens) // first) for t in tokens]
    return rows


def video_refusal(model_type: str) -> str | None:
    """Why a model of `model_type` on the generic family cannot take video prompts (None when it can)."""
    if model_type in VIDEO_MODEL_TYPES:
        return None
    reason = NO_VIDEO.get(model_type, "its video inputs are not tested in gpg-vl yet")
    return (f"the {model_type} model (generic family) does not take video prompts ({reason}); train video tasks "
            "on a model that does (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, GLM-4.1V, InternVL, Gemma 4) or drop "
            "the video parts.")


def model_video_refusal(model_cfg) -> str | None:
    """`video_refusal` of the model `model.*` names, read before it loads: the Qwen families take video; a generic
    model's type comes from `tiny:<type>` or a local folder's config.json (a hub id is left to its processor)."""
    from pathlib import Path

    family, name = str(model_cfg.get("family") or "auto"), str(model_cfg.get("name_or_path") or "")
    if family not in ("auto", "generic"):
        return None
    if name.startswith("tiny:"):
        model_type = name[len("tiny:"):]
    elif (Path(name).expanduser() / "config.json").is_file():
        import json

        model_type = json.loads((Path(name).expanduser() / "config.json").read_text()).get("model_type", "")
    else:
        return None
    if model_type.startswith(("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")):
        return None
    return video_refusal(model_type)
