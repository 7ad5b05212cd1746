"""The Qwen-VL families: Qwen2-VL, Qwen2.5-VL, Qwen3-VL (dense and MoE), Qwen3.5 / Qwen3.6 (dense and MoE).

They share the processor call (images resized by qwen-vl-utils to whole merged patches, flattened into
patch rows with one `image_grid_thw` row per image), 3-D multimodal rotary positions as vLLM places them
(models/positions.py: Qwen2-VL and Qwen2.5-VL computed there, the later families by the model's own
`get_rope_index`, which agrees), and the vision special tokens. They differ in the box frame (Qwen2.5-VL: pixels of the
resized image; the others: 0-1000 relative), the patch size, DeepStack features (Qwen3-VL), and, for
Qwen3.5, a hybrid cache (Gated DeltaNet conv + recurrent states in three of every four layers) and a chat
template that opens a think block by default.
"""

from __future__ import annotations

import torch
from qwen_vl_utils import fetch_image, fetch_video, process_vision_info
from qwen_vl_utils.vision_process import MAX_RATIO
from torch import Tensor

from gpg_vl.data.video import DECODED, decode_video, is_video_part, message_videos, video_pixels
from gpg_vl.models.batch import PromptBatch, image_order, per_prompt_rows
from gpg_vl.models.family import Family, register_family
from gpg_vl.models.positions import model_rope_index, qwen_positions, text_positions

VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>")


@register_family
class QwenVLFamily(Family):
    """Qwen2.5-VL (and the base of the other Qwen families): boxes in absolute pixels of the RESIZED image."""

    name = "qwen2_5_vl"
    model_types = ("qwen2_5_vl",)
    box_frame = "resized-pixels"
    pixel_keys = ("pixel_values", "pixel_values_videos")
    engine_takes_video = True
    vision_tokens = VISION_TOKENS
    image_placeholder = "<|vision_start|><|image_pad|><|vision_end|>"  # the processor expands the pad per image
    video_placeholder = "<|vision_start|><|video_pad|><|vision_end|>"  # ... and per video
    eos_tokens = ("<|im_end|>", "<|endoftext|>")
    max_aspect_ratio = MAX_RATIO  # qwen-vl-utils refuses more elongated images
    placeholder_size = (28, 28)

    def __init__(self, processor, config, **kwargs) -> None:
        super().__init__(processor, config, **kwargs)
        # qwen_vl_utils resizes images to multiples of patch x merge size: 28 for Qwen2/2.5-VL, 32 for Qwen3-VL
        self.image_patch_size = getattr(processor.image_processor, "patch_size", 14)
        self.placeholder_size = (2 * self.image_patch_size, 2 * self.image_patch_size)

    def encode(self, messages_batch: list[list[dict]], ids: list[str] | None = None,
               tools: list[dict] | None = None) -> PromptBatch:
        """Chat messages -> left-padded processor inputs. Images are resized within min/max pixels; videos are
        read once (data/video.py, unless the stream already did), their frames resized within the video pixel
        budgets by qwen-vl-utils, and their metadata handed to the processor (timestamps, `second_per_grid_ts`)."""
        for messages in messages_batch:
            for message in messages:
                for part in message["content"] if isinstance(message["content"], list) else []:
                    if part.get("type") == "image" or "image" in part:
                        if self.min_pixels is not None:
                            part.setdefault("min_pixels", self.min_pixels)
                        if self.max_pixels is not None:
                            part.setdefault("max_pixels", self.max_pixels)
        texts = [self.render(messages, tools) for messages in messages_batch]
        images_per_prompt, images, image_sizes = [], [], []
        videos_per_prompt, videos, metadata = [], [], []
        for messages in messages_batch:
            prompt_images, sizes = self._prompt_images(messages)
            images_per_prompt.append(len(prompt_images))
            images.extend(prompt_images)
            image_sizes.append(sizes)
            prompt_videos = [self._video_frames(part) for part in message_videos(messages)]
            videos_per_prompt.append(len(prompt_videos))
            videos += [frames for frames, _ in prompt_videos]
            metadata += [meta for _, meta in prompt_videos]
        self.tokenizer.padding_side = "left"
        extra = {"videos": videos, "video_metadata": metadata, "do_sample_frames": False} if videos else {}
        inputs = dict(self.processor(text=texts, images=images or None, padding=True, return_tensors="pt", **extra,
                                     **self.processor_kwargs))
        rows = {}
        for grid, pixels, counts in (("image_grid_thw", "pixel_values", images_per_prompt),
                                     ("video_grid_thw", "pixel_values_videos", videos_per_prompt)):
            if grid in inputs:  # flattened patches: grid t * h * w rows per image (video)
                rows.update({pixels: per_prompt_rows(inputs[grid].prod(dim=1).tolist(), counts), grid: list(counts)})
        if isinstance(inputs.get("second_per_grid_ts"), Tensor):
            rows["second_per_grid_ts"] = list(videos_per_prompt)
        return PromptBatch(inputs, images_per_prompt, list(ids or []), image_sizes, rows, texts,
                           videos_per_prompt if videos else [])

    def _prompt_images(self, messages: list[dict]) -> tuple[list, list]:
        """A prompt's images resized by qwen-vl-utils, and (W, H, w, h) per image where the originals are known."""
        without_videos = [{**m, "content": [p for p in m["content"] if not is_video_part(p)]}
                          if isinstance(m.get("content"), list) else m for m in messages]
        originals = [part["image"].size for message in without_videos if isinstance(message["content"], list)
                     for part in message["content"] if hasattr(part.get("image"), "size")]
        prompt_images, _ = process_vision_info(without_videos, image_patch_size=self.image_patch_size)
        prompt_images = prompt_images or []
        if len(originals) != len(prompt_images):  # images given by path: their sizes are unknown here
            originals = []
        return prompt_images, [(*original, *resized.size) for original, resized in zip(originals, prompt_images)]  # noqa: B905

    def _video_frames(self, part: dict) -> tuple[Tensor, dict]:
        """A video part's frames [T, 3, h, w] resized by qwen-vl-utils within the pixel budgets, and its metadata."""
        decoded = decode_video(part, max_frames=None)
        limits = video_pixels(decoded, self.video_pixels)
        frames = fetch_video({"video": decoded["video"], **limits}, image_patch_size=self.image_patch_size)
        return frames, dict(decoded[DECODED])

    def engine_images(self, messages: list[dict]) -> list:
        """The images resized by qwen-vl-utils within min/max pixels, exactly as `encode` gives them."""
        limits = {k: v for k, v in (("min_pixels", self.min_pixels), ("max_pixels", self.max_pixels)) if v is not None}
        messages = [{**m, "content": [{**limits, **part} if isinstance(part, dict) and "image" in part else part
                                      for part in m["content"]]} if isinstance(m.get("content"), list) else m
                    for m in messages]
        return self._prompt_images(messages)[0]

    def engine_videos(self, messages: list[dict]) -> list[tuple[Tensor, dict]]:
        """The videos as `encode` gives them to the processor: (frames [T, 3, h, w], metadata) each."""
        return [self._video_frames(part) for part in message_videos(messages)]

    def fit_image(self, image):
        """Resized by qwen-vl-utils' rule (whole merged patches, within min/max pixels), as `encode` resizes."""
        limits = {k: v for k, v in (("min_pixels", self.min_pixels), ("max_pixels", self.max_pixels)) if v is not None}
        return fetch_image({"image": image.convert("RGB"), **limits}, image_patch_size=self.image_patch_size)

    def engine_processor_kwargs(self) -> dict:
        return {k: v for k, v in (("min_pixels", self.min_pixels), ("max_pixels", self.max_pixels)) if v is not None}

    def position_ids(self, model, inputs: dict[str, Tensor]) -> Tensor:
        """Explicit 3-D rotary positions [3, N, L] for a full (prompt + completion) batch, as vLLM places them
        (models/positions.py; tests/integration/test_positions_vllm.py compares them with vLLM's own function).

        Passing them avoids Qwen-VL's `rope_deltas`, which `generate()` caches on the model for its
        own batch and which would otherwise leak into a training forward of another batch size.
        """
        self.reset_positions(model)
        if "image_grid_thw" not in inputs and "video_grid_thw" not in inputs:
            return text_positions(inputs["attention_mask"]).unsqueeze(0).expand(3, -1, -1)  # [3, N, L]
        return self.vision_positions(model, inputs)

    def vision_positions(self, model, inputs: dict[str, Tensor]) -> Tensor:
        """Positions [3, N, L] of a batch holding images or videos. Qwen2-VL and Qwen2.5-VL: vLLM's rule, computed by
        models/positions.py, whose docstring says where transformers' `get_rope_index` differs (the text after a
        video of several temporal patches) and the upstream references."""
        return qwen_positions(self.config, inputs)

    def shares_vision(self, model: torch.nn.Module) -> bool:
        return True

    def image_features(self, model, prompts: PromptBatch, prompt_index: list[int]):
        """Vision-tower outputs computed once per distinct prompt, listed per sequence (no copy)."""
        return self._features(model, prompts, prompt_index, "image")

    def vision_features(self, model, prompts: PromptBatch, prompt_index: list[int]) -> dict:
        """`mm_encoder_outputs`: the images' and the videos' tower outputs, each once per distinct prompt."""
        features = {}
        if prompts.has_images:
            features["image"] = self._features(model, prompts, prompt_index, "image")
        if prompts.has_videos:
            features["video"] = self._features(model, prompts, prompt_index, "video")
        return features

    def _features(self, model, prompts: PromptBatch, prompt_index: list[int], kind: str):
        subset = prompts.select(sorted(set(prompt_index)))
        base = model.model
        if kind == "image":
            encoded = base.get_image_features(subset.inputs["pixel_values"], subset.inputs["image_grid_thw"],
                                              return_dict=True)
            order = image_order(prompts, prompt_index)
        else:
            encoded = base.get_video_features(subset.inputs["pixel_values_videos"], subset.inputs["video_grid_thw"],
                                              return_dict=True)
            order = image_order(prompts, prompt_index, prompts.videos_per_prompt)
        encoded.pooler_output = [encoded.pooler_output[i] for i in order]
        if getattr(encoded, "deepstack_features", None) is not None:  # Qwen3-VL: one map per DeepStack tap
            encoded.deepstack_features = [[level[i] for i in order] for level in encoded.deepstack_features]
        return encoded


@register_family
class Qwen2VLFamily(QwenVLFamily):
    """Qwen2-VL answers boxes in a 0-1000 frame normalized to the image, whatever its size."""

    name = "qwen2_vl"
    model_types = ("qwen2_vl",)
    box_frame = "relative-1000"


@register_family
class Qwen3VLFamily(Qwen2VLFamily):
    """Qwen3-VL (dense and MoE): boxes in the 0-1000 frame again (as Qwen2-VL), 16-pixel patches, and DeepStack.

    Its processor would resize images a second time to its own pixel limits (at least 65,536 pixels by
    default), so images keep the size qwen_vl_utils gave them (`do_resize=False`, as Qwen's cookbooks do).
    The vision tower returns, besides the merged image tokens, one feature map per DeepStack tap that the
    first decoder layers add at the image positions; shared vision features carry both, so one encoding
    per prompt serves its G sequences exactly as per-sequence pixels would.
    """

    name = "qwen3_vl"
    model_types = ("qwen3_vl", "qwen3_vl_moe")
    video_times_in_text = True  # `<t seconds>` before each frame pair
    processor_kwargs = {"do_resize": False}

    def vision_positions(self, model, inputs: dict[str, Tensor]) -> Tensor:
        """The model's own `get_rope_index`: with a timestamp between a video's frame pairs, every vision run has
        one temporal patch, where transformers' rule and vLLM's coincide (measured: docs/models.md#positions)."""
        return model_rope_index(model, inputs)


@register_family
class Qwen3_5Family(Qwen3VLFamily):
    """Qwen3.5 / Qwen3.6 (dense and MoE): Qwen3-VL's processor and box frame, a hybrid cache, thinking mode.

    Gated DeltaNet layers cache a conv state (the last kernel-size inputs) and a recurrent state instead of
    keys and values; forking the prompt's cache forks both (out of place: `reorder_cache`), and the
    completions' forward replaces them rather than writing into the forked tensors, which the backward
    still needs, so the gradient reaches the prompt through them. The chat template opens `<think>` at the
    generation prompt; `completion_prefix` hands that opening to the task's format reward, and
    `enable_thinking=False` renders the template's closed, empty think block instead.
    """

    name = "qwen3_5"
    model_types = ("qwen3_5", "qwen3_5_moe")
    tool_call_format = "xml"  # <tool_call><function=NAME><parameter=ARG>value</parameter></function></tool_call>

    def fork_cache(self, model, cache, index: Tensor):
        cache = super().fork_cache(model, cache, index)
        for layer in cache.layers:
            if hasattr(layer, "recurrent_states"):
                _replace_states_in_place(layer)
        return cache


def _replace_states_in_place(layer) -> None:
    """Make a linear-attention cache layer assign its new conv and recurrent states instead of copying them
    into the forked tensors (`copy_` would overwrite tensors that the backward of the prompt still reads)."""
    if getattr(layer, "_gpg_assigns_states", False):
        return
    update_conv = layer.update_conv_state

    def update_conv_state(conv_states, state_idx: int = 0, **kwargs):
        if not layer.has_previous_state[state_idx]:
            return update_conv(conv_states, state_idx=state_idx, **kwargs)
        full = torch.cat([layer.conv_states[state_idx], conv_states], dim=-1)
        layer.conv_states[state_idx] = full[..., -layer.conv_kernel_size[state_idx]:]
        return full

    def update_recurrent_state(recurrent_states, state_idx: int = 0, **kwargs):
        layer.recurrent_states[state_idx] = recurrent_states
        layer.is_recurrent_states_initialized[state_idx] = True
        return recurrent_states

    layer.update_conv_state, layer.update_recurrent_state = update_conv_state, update_recurrent_state
    layer._gpg_assigns_states = True
