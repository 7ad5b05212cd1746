"""The vLLM server engine: rollouts on stock `vllm serve` endpoints (other GPUs, other nodes), the trainer's
weights pushed to them through vLLM's weight-transfer API after each optimizer step (docs/many-nodes.md).

- Prompts: the token ids the trainer scores (the family's processor-expanded ids: one run of image tokens per
  image, one run of video tokens per video), never text re-tokenised by the server, go to
  `POST /inference/v1/generate`. A prompt with images or videos gets `features`: each image, as the family's
  processor receives it (PNG, lossless), and each video, as the frames the trainer sampled and resized (a
  `video/jpeg` data URL of PNG frames, with the trainer's metadata as `media_io_kwargs` and
  `do_sample_frames: false`, so the server samples nothing itself: `video_render_body`), is processed by the
  server once (`POST /v1/chat/completions/render`) and its features are pointed at its run of tokens in the
  prompt. The server's own count of tokens for an image or video must equal the trainer's (the same pixel
  budgets on both sides: `--mm-processor-kwargs`), else one sentence says so before anything is sampled.
- Sampling: `n = G` per prompt, temperature, top_p, max tokens, ignore-EOS, the family's banned ids as a logit
  bias, `logprobs=0`: each sampled token's log-prob comes back (`logprobs.content[*].logprob`; vLLM's
  `--logprobs-mode processed_logprobs` makes it the distribution it drew from) for the sampler check and the
  correction (rollout.vllm_server.tis_cap).
- Weight versions: every sync labels the servers' weights with the step they are the weights after, the number the
  pipeline owns (gpg_vl/train/step/pipeline.py: a resumed run labels them as the uninterrupted one did; the per-request
  seeds include it), sent with `/finish_weight_update`, and
  each rollout row records the oldest label that sampled any of its tokens (`Rollout.weight_versions`, from the
  choice's `weight_versions` where the server reports them, else the label in force: generation is paused around
  each update).
- Multi-turn (rollout.max_turns > 1): each later turn sends everything so far (the prompt's ids and the
  trajectory's, observations processor-expanded as the trainer scores them) with the features of every image
  and of the prompt's videos; the tool calls are run by the HF engine's own code (rollout/multiturn/decoding.py).
- Spread: each trainer process sends its own prompts, request i to server (rank + i) mod n, at most
  rollout.vllm_server.max_concurrency at once.

Faults, each in one sentence: no server at a URL when the settings are built (before the model loads); a server
whose model differs from the trainer's (architecture and sizes from `/server_info`, name from `/v1/models`); a
server unreachable for timeout_s mid-run (`ServerGone`: the run checkpoints and stops, gpg_vl/train/loop.py); a
sync past sync_timeout_s (every rank exits: rollout/vllm/weight_transfer.py); a prompt the server refuses as too long
(`Rollout.rejected`: the prompt is skipped, as an over-long prompt is).
"""

from __future__ import annotations

import base64
import io
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from gpg_vl.data.video import DEFAULT_FPS
from gpg_vl.errors import UserError
from gpg_vl.rollout.engine import (
    EnginePrompts,
    Sampling,
    register_engine,
)
from gpg_vl.rollout.multiturn.trajectory import Trajectory
from gpg_vl.rollout.settings import VLLMServerSettings
from gpg_vl.rollout.types import Rollout
from gpg_vl.rollout.vllm.client import Rejected, Server, ServerError, ServerGone, split_urls
from gpg_vl.rollout.vllm.common import BANNED_BIAS, VLLMEngineBase, banned_tokens, padded_rollout, sampling_fields

FINAL_ONLY = 2  # vLLM's RequestOutputKind.FINAL_ONLY: every one of the n sequences in one answer
TOO_LONG = re.compile(r"maximum (context|model) length|too long|max_model_len|exceeds", re.IGNORECASE)
CONFIG_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
FIRST_CHECK_S = 5.0  # the first, short /health check of a server before the run says it waits for it


# ---------------------------------------------------------------------------------------------
# pure parts: payloads and answers
# ---------------------------------------------------------------------------------------------
def sampling_params(family, sampling: Sampling, n: int, *, seed: int | None = None, stops: bool = False,
                    max_tokens: int | None = None, tool_stops: tuple[str, ...] = ()) -> dict:
    """`sampling_params` of a /inference/v1/generate request (vLLM's SamplingParams fields), sampled as the HF
    engine samples; `stops`: a multi-turn segment also stops at the family's tool-call stop strings and at
    `tool_stops` (the offered tools' plain-text calls')."""
    params = {**sampling_fields(family, sampling, n, max_tokens), "skip_special_tokens": not stops,
              "detokenize": stops, "output_kind": FINAL_ONLY}
    if stops:
        params.update(stop=[*family.tool_stop_strings, *tool_stops], include_stop_str_in_output=True)
    banned = banned_tokens(family, sampling)
    if banned:
        params["logit_bias"] = {str(token): BANNED_BIAS for token in banned}
    if seed is not None:
        params["seed"] = seed
    return params


def prompt_token_ids(batch, b: int) -> list[int]:
    """Prompt b of a PromptBatch as token ids, as the trainer scores it (left padding dropped)."""
    inputs = batch.inputs
    return inputs["input_ids"][b][inputs["attention_mask"][b].bool()].tolist()


def token_runs(token_ids: list[int], token: int) -> list[dict]:
    """The runs of one token in a prompt (an image's or a video's tokens), one per image or video:
    [{"offset", "length"}] (vLLM's PlaceholderRange)."""
    runs, k = [], 0
    while k < len(token_ids):
        if token_ids[k] != token:
            k += 1
            continue
        start = k
        while k < len(token_ids) and token_ids[k] == token:
            k += 1
        runs.append({"offset": start, "length": k - start})
    return runs


def _miscounted(modality: str, runs: int, items: int) -> str:
    if modality == "video":
        return (f"a prompt holds {runs} runs of video tokens for {items} videos (the family writes something between "
                "a video's tokens, as Qwen3-VL writes frame timestamps), which rollout.engine=vllm_server does not "
                "place yet; use rollout.engine=vllm or hf for this model's video tasks.")
    return f"a prompt holds {runs} runs of image tokens for {items} images; the family's prompt does not mark each " \
           "image once."


def place_features(features: dict[str, list[dict]], token_ids: list[int], tokens: dict[str, int],
                   url: str) -> dict | None:
    """One request's `features`: the rendered features of its images and videos (per modality, in order) merged,
    each pointed at its run of tokens (`tokens`: the image token, the video token) in `token_ids`; one sentence
    when the server counts an image's or a video's tokens differently."""
    features = {modality: rendered for modality, rendered in features.items() if rendered}
    if not features:
        return None
    merged = {"mm_hashes": {}, "mm_placeholders": {}, "kwargs_data": {}}
    for modality, rendered in features.items():
        runs = token_runs(token_ids, tokens[modality])
        if len(runs) != len(rendered):
            raise UserError(_miscounted(modality, len(runs), len(rendered)))
        for part in merged.values():
            part[modality] = []
        for k, (feature, run) in enumerate(zip(rendered, runs, strict=True)):
            (server_run,) = feature["mm_placeholders"][modality]
            if int(server_run["length"]) != run["length"]:
                budgets = "min/max pixels" if modality == "image" else "video pixel budgets"
                raise UserError(f"the vLLM server at {url} makes {server_run['length']} tokens of {modality} {k} "
                                f"where the trainer's processor makes {run['length']}; start `vllm serve` with the "
                                f"trainer's {budgets} (--mm-processor-kwargs, docs/many-nodes.md).")
            merged["mm_hashes"][modality] += feature["mm_hashes"][modality]
            merged["mm_placeholders"][modality].append(run)
            merged["kwargs_data"][modality] += (feature.get("kwargs_data") or {}).get(modality) or [None]
    return merged


def choice_logps(choice: dict) -> list[float]:
    """The sampler's log-prob of each token of one choice (0 where the server gave none)."""
    entries = ((choice.get("logprobs") or {}).get("content")) or []
    tokens = choice.get("token_ids") or []
    return [float(entries[t]["logprob"]) if t < len(entries) and entries[t].get("logprob") is not None else 0.0
            for t in range(len(tokens))]


def oldest_version(choice: dict, current: int) -> int:
    """The oldest weight version that sampled any token of a choice (the spans' labels: our sync numbers), or
    `current` where the server reports none."""
    labels = [span.get("version") for span in choice.get("weight_versions") or []]
    numbers = [int(label) for label in labels if str(label).isdigit()]
    return min(numbers) if numbers else current


def png_data_url(image) -> str:
    """An image as a lossless data URL (the server decodes exactly the pixels the trainer's processor got)."""
    return "data:image/png;base64," + _png(image.convert("RGB"))


def _png(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def video_data_url(frames) -> str:
    """A video's frames ([T, 3, h, w], or a list of images) as vLLM's `video/jpeg` data URL: each frame base64 on its
    own, the frames joined by commas (vLLM's VideoMediaIO.load_base64 splits them and decodes each with PIL, which
    reads the format from the bytes, so the frames go as PNG: lossless). The server sees 8-bit frames: the Qwen
    families' frames are whole 8-bit values already (qwen-vl-utils resizes uint8 frames, then casts them to
    float), so nothing changes; a frame holding other values would be rounded to the nearest 8-bit value."""
    from PIL import Image

    if isinstance(frames, torch.Tensor):
        pixels = frames.detach().float().clamp(0, 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        images = [Image.fromarray(frame) for frame in pixels]
    else:
        images = [frame.convert("RGB") for frame in frames]
    return "data:video/jpeg;base64," + ",".join(_png(image) for image in images)


def video_io_kwargs(metadata: dict, count: int) -> dict:
    """A video's `media_io_kwargs` (vLLM's VideoMediaIO, `video/jpeg` path): every frame sent is kept
    (`num_frames: -1`), none is sampled again (`do_sample_frames: false`), and the metadata is the trainer's
    (`fps`, `frames_indices`, `total_num_frames`), from which the processor computes what the trainer's computes
    (Qwen2.5-VL's `second_per_grid_ts` = temporal patch / sampled fps, sampled fps = frames / total x fps). vLLM
    refuses a total below the frames sent, which a clip whose last frame was repeated to an even count has; then
    the total is the count sent and the rate is scaled by the same factor, so the sampled fps and the duration
    stay the trainer's (Qwen3-VL's timestamps, frame index / fps, would not; its videos are refused anyway)."""
    total = int(metadata.get("total_num_frames") or count)
    fps = float(metadata.get("fps") or DEFAULT_FPS)
    indices = [int(i) for i in metadata.get("frames_indices") or range(count)]
    if total < count:
        fps, total = fps * count / total, count
    return {"num_frames": -1, "fps": fps, "frames_indices": indices, "total_num_frames": total,
            "do_sample_frames": False}


def image_render_body(model: str, image) -> dict:
    """The /v1/chat/completions/render request that processes one image."""
    part = {"type": "image_url", "image_url": {"url": png_data_url(image)}}
    return {"model": model, "messages": [{"role": "user", "content": [part]}], "max_tokens": 1}


def video_render_body(model: str, video: tuple) -> dict:
    """The /v1/chat/completions/render request that processes one video, (frames, metadata) as the family's
    `engine_videos` gives them: the frames the trainer sampled, with its metadata (ChatCompletionRequest's
    `media_io_kwargs` and `mm_processor_kwargs`), so that the server samples nothing itself."""
    frames, metadata = video
    part = {"type": "video_url", "video_url": {"url": video_data_url(frames)}}
    return {"model": model, "messages": [{"role": "user", "content": [part]}], "max_tokens": 1,
            "media_io_kwargs": {"video": video_io_kwargs(metadata, len(frames))},
            "mm_processor_kwargs": {"do_sample_frames": False}}


RENDER_BODIES = {"image": image_render_body, "video": video_render_body}


def media_tokens(family, config) -> dict[str, int | None]:
    """The token the family's processor repeats for an image's patches (Qwen: `<|image_pad|>`) and for a video's
    frames (`<|video_pad|>`): {"image": id, "video": id or None}."""
    image = getattr(family.processor, "image_token_id", None)
    if image is None:
        image = family.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    video = getattr(family.processor, "video_token_id", None)
    if video is None:
        video = getattr(config, "video_token_id", None)
    return {"image": image, "video": video}


def prompt_videos(family, messages: list[dict], tokens: dict[str, int | None]) -> list:
    """A prompt's videos as the trainer's processor gets them, (frames, metadata) each: one sentence where the family
    hands a server no videos, or writes frame timestamps between a video's tokens (not placed yet)."""
    videos = family.engine_videos(messages)
    if videos and family.video_times_in_text:
        raise UserError(f"the {family.name} family writes frame timestamps between a video's tokens, which "
                        "a vLLM server (rollout.engine=vllm_server, teacher.urls) does not take yet; use "
                        "rollout.engine=vllm or hf (teacher.model) for this model's video tasks.")
    if videos and (not family.engine_takes_video or tokens["video"] is None):
        raise UserError(f"the {family.name} family's videos do not go through a vLLM server (rollout.engine="
                        "vllm_server, teacher.urls); use rollout.engine=hf (teacher.model) for this model's video "
                        "tasks.")
    return videos


def render_features(server: Server, model: str, media: dict[str, list], cache: dict, *,
                    limit: str = "rollout.vllm_server.timeout_s") -> dict[str, list[dict]]:
    """The rendered features of each image and video of `media` ({"image": [...], "video": [...]}), each rendered
    once per `cache` (id(item) -> its features, which hold the processed pixels themselves: any server takes
    them) by `POST /v1/chat/completions/render`; `limit`: the setting its deadline comes from."""
    out = {}
    for modality, items in media.items():
        out[modality] = []
        for item in items:
            if id(item) not in cache:
                try:
                    cache[id(item)] = server.post("/v1/chat/completions/render",
                                                  RENDER_BODIES[modality](model, item), limit=limit)["features"]
                except Rejected as error:
                    raise ServerError(render_refusal(server.url, modality, error.detail)) from None
            out[modality].append(cache[id(item)])
    return out


def render_refusal(url: str, modality: str, detail: str) -> str:
    """The sentence for a server that refused to process an image or a video (`detail`: its own message)."""
    if "trust-request-mm-kwargs" in detail:  # vLLM 0.32 refuses per-request mm_processor_kwargs by default
        return (f"the vLLM server at {url} refused to process a {modality} because it takes no per-request processor "
                "settings, which the trainer sends with each video so that the server samples no frames itself; "
                "restart it with --trust-request-mm-kwargs (docs/many-nodes.md#video-prompts).")
    return f"the vLLM server at {url} refused to process a {modality} ({detail}); check its --limit-mm-per-prompt."


def rejected_for_length(error: Rejected) -> bool:
    return error.status == 400 and bool(TOO_LONG.search(error.detail))


def compare_model(url: str, models: dict, info: dict | None, config, needed_len: int) -> str | None:
    """One sentence when the server's model is not the trainer's: its architecture or sizes differ (from
    /server_info, where the server exposes it), or its context is too short for a prompt and its completion."""
    served = (models.get("data") or [{}])[0]
    name = served.get("root") or served.get("id")
    model_config = ((info or {}).get("model_config")) or {}
    hf_config = model_config.get("hf_config") or {}
    text = hf_config.get("text_config") or hf_config
    ours = getattr(config, "text_config", config)
    theirs = hf_config.get("architectures") or model_config.get("architectures")
    if theirs and list(theirs) != list(getattr(config, "architectures", None) or theirs):
        return (f"the vLLM server at {url} serves {name} ({', '.join(theirs)}), not the trainer's "
                f"{', '.join(config.architectures)}; start `vllm serve` with the trainer's model.")
    for key in CONFIG_KEYS:
        if key in text and getattr(ours, key, text[key]) != text[key]:
            return (f"the vLLM server at {url} serves {name}, whose {key} is {text[key]} where the trainer's model "
                    f"has {getattr(ours, key)}; start `vllm serve` with the trainer's model.")
    length = served.get("max_model_len") or model_config.get("max_model_len")
    if length and int(length) < needed_len:
        return (f"the vLLM server at {url} takes {length} tokens per sequence (its --max-model-len), fewer than "
                f"rollout.max_prompt_tokens + the completion ({needed_len}); lower rollout.max_prompt_tokens or "
                f"rollout.max_new_tokens to fit {length}, or start the server with --max-model-len {needed_len}.")
    return None


def seed_problem(url: str, info: dict | None, seed: int) -> str | None:
    """One sentence when seeded requests would kill the server: vLLM's CPU build (0.32) rewinds a seeded request's
    generator when a chunked prefill discards its sample, which a CPU generator cannot do ("CPU Generator does not
    use offset": the engine dies)."""
    config = info or {}
    chunked = (config.get("scheduler_config") or {}).get("enable_chunked_prefill")
    if seed and (config.get("device_config") or {}).get("device") == "cpu" and chunked:
        return (f"the vLLM server at {url} runs on CPU with chunked prefill, where a seeded request kills its engine "
                "(vLLM 0.32 rewinds the request's generator, which a CPU generator cannot do); start it with "
                "--no-enable-chunked-prefill (docs/engines.md) or set rollout.vllm_server.seed=0.")
    return None


# ---------------------------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------------------------
@dataclass
class _Row:
    """One trajectory rolled out through the servers (multi-turn)."""

    prompt: int
    trajectory: Trajectory
    context: object
    segment: list[int] = field(default_factory=list)
    ended_by: str = ""
    version: int = 0


@register_engine
class VLLMServerEngine(VLLMEngineBase):
    """Rollouts on `vllm serve` endpoints; the trainer's weights pushed to them after every optimizer step (under
    trainer.max_staleness >= 1 the sampler's `sync` pushes the version it samples with)."""

    name = "vllm_server"
    settings_class = VLLMServerSettings
    section, sampler_label = "rollout.vllm_server", "the servers'"
    mismatch_checks = "the weight sync, the dtype and --logprobs-mode processed_logprobs"

    @classmethod
    def unavailable(cls, rollout) -> str | None:
        if rollout.engine != cls.name:
            return None
        settings = cls.settings_in(rollout)
        from gpg_vl.rollout.vllm.weight_transfer import require_transport

        split_urls(settings.urls)  # a url that is not one (its port outside 1-65535): one sentence, contacting none
        return require_transport(settings)  # nccl without CUDA or vllm, disk without a folder

    @classmethod
    def unreachable(cls, rollout) -> str | None:
        if rollout.engine != cls.name:
            return None
        settings = cls.settings_in(rollout)
        for url in split_urls(settings.urls):  # refused before any model loads: a server that is not there
            server = Server(url, timeout_s=settings.timeout_s)
            try:
                try:  # one short try first; a server still starting is then waited for, saying so at once
                    server.get("/health", timeout_s=min(FIRST_CHECK_S, settings.timeout_s), retry=False)
                except ServerGone:
                    print(f"waiting up to {settings.timeout_s:g} s (rollout.vllm_server.timeout_s) for the vLLM "
                          f"server at {url} to answer GET /health ...", file=sys.stderr, flush=True)
                    server.get("/health")
            except ServerGone:
                return (f"no vLLM server answers at {url} (GET /health, for rollout.vllm_server.timeout_s="
                        f"{settings.timeout_s:g} s); start `vllm serve` there (docs/many-nodes.md) or fix "
                        "rollout.vllm_server.urls.")
            except Rejected as error:
                return f"the server at {url} is not a vLLM server ({error}); fix rollout.vllm_server.urls."
        return None

    def __init__(self, policy, rollout, *, accelerator=None) -> None:
        from gpg_vl.rollout.vllm.weight_transfer import TRANSPORTS

        self.policy, self.family, self.settings = policy, policy.family, self.settings_in(rollout)
        self.rank = accelerator.process_index if accelerator is not None else 0
        self.servers = [Server(url, timeout_s=self.settings.timeout_s) for url in split_urls(self.settings.urls)]
        self.model_name = self._check_models(rollout)
        self.transport = TRANSPORTS[self.settings.weight_transfer](self.settings, rank=self.rank)
        self.version = 0  # the weights the servers hold: those after this step (the pipeline's number)
        self.tokens = media_tokens(self.family, policy.model.config)
        self.requests = 0  # requests sent by this process (spread across the servers)
        self.transport.init(self.servers)
        self.sync(policy.model, 0)  # the servers hold the trainer's weights, whatever they loaded (a resumed run's
        # pipeline labels them with its step before the first rollout)

    def _check_models(self, rollout) -> str:
        """The served model's name, after checking each server serves the trainer's model (one sentence if not)."""
        needed = rollout.max_prompt_tokens + max(rollout.max_new_tokens,
                                                 rollout.max_total_tokens if rollout.max_turns > 1 else 0)
        name = None
        for server in self.servers:
            models = server.get("/v1/models")
            try:
                info = server.get("/server_info?config_format=json", retry=False).get("vllm_config")
            except Rejected:
                raise UserError(f"the vLLM server at {server.url} does not expose its development routes, which the "
                                "weight sync uses; restart it with VLLM_SERVER_DEV_MODE=1 (docs/many-nodes.md).") \
                    from None
            reason = compare_model(server.url, models, info, self.policy.model.config, needed) or \
                seed_problem(server.url, info, self.settings.seed)
            if reason is not None:
                raise UserError(reason)
            name = name or (models.get("data") or [{}])[0].get("id")
        return name

    def _videos(self, messages: list[dict]) -> list:
        return prompt_videos(self.family, messages, self.tokens)

    def _features(self, server: Server, media: dict[str, list], cache: dict) -> dict[str, list[dict]]:
        return render_features(server, self.model_name, media, cache)

    def _generate_one(self, server: Server, token_ids: list[int], media: dict[str, list], params: dict,
                      cache: dict) -> list[dict] | Rejected:
        """The choices of one /inference/v1/generate request (`media`: its images and videos), or the server's
        refusal (a prompt too long)."""
        body = {"model": self.model_name, "token_ids": token_ids, "sampling_params": params,
                "features": place_features(self._features(server, media, cache), token_ids, self.tokens,
                                           server.url)}
        try:
            return server.post("/inference/v1/generate", body)["choices"]
        except Rejected as error:
            if rejected_for_length(error):
                return error
            raise ServerError(f"{error}; check that the server runs with --enable-scale-out (docs/many-nodes.md).") \
                from None

    def _generate_all(self, jobs: list[tuple[list[int], dict, dict]]) -> list:
        """Every request of a turn at once (at most max_concurrency in flight), request i to server
        (rank + i + requests so far) mod n: their choices, in order."""
        first, self.requests = self.requests, self.requests + len(jobs)
        servers = [self.servers[(self.rank + first + i) % len(self.servers)] for i in range(len(jobs))]
        cache: dict = {}
        workers = max(1, min(self.settings.max_concurrency, len(jobs)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(lambda i: self._generate_one(servers[i], *jobs[i], cache), range(len(jobs))))

    # ---- rollout ----------------------------------------------------------------------------------
    def generate(self, prompts: EnginePrompts, group_size: int, sampling: Sampling) -> Rollout:
        if prompts.messages is None:
            raise ValueError("the vLLM server engine sends each prompt's images; EnginePrompts.messages is None")
        if self.multiturn.multi_turn:
            return self.generate_trajectories(prompts, group_size, sampling)
        jobs = [(prompt_token_ids(prompts.batch, b), {"image": self.family.engine_images(messages),
                                                "video": self._videos(messages)},
                 sampling_params(self.family, sampling, group_size, seed=self._seed(b)))
                for b, messages in enumerate(prompts.messages)]
        answers = self._generate_all(jobs)
        rejected = [b for b, answer in enumerate(answers) if isinstance(answer, Rejected)]
        rows, logps, versions = [], [], []
        for answer in answers:
            choices = [{}] * group_size if isinstance(answer, Rejected) else answer
            if len(choices) != group_size:
                raise ServerError(f"a vLLM server returned {len(choices)} completions for a prompt, not "
                                  f"{group_size}; use a vLLM version whose /inference/v1/generate honours n.")
            for choice in choices:
                rows.append(list(choice.get("token_ids") or []))
                logps.append(choice_logps(choice))
                versions.append(oldest_version(choice, self.version))
        rollout = padded_rollout(self.family, rows, logps, sampling, group_size, self.policy.model.device)
        rollout.weight_versions, rollout.rejected = versions, rejected
        rollout.rejected_reasons = {b: answers[b].detail for b in rejected}
        return rollout

    def _seed(self, index: int) -> int | None:
        return None if not self.settings.seed else self.settings.seed + 7919 * self.rank + index + 104729 * self.version

    def generate_trajectories(self, prompts: EnginePrompts, group_size: int, sampling: Sampling) -> Rollout:
        """B x G trajectories (row b * G + g continues prompt b), turn by turn (the module's docstring)."""
        from gpg_vl.rollout.multiturn.decoding import answer_segments, prompt_context, segment_end, trajectory_rollout

        family, settings = self.family, self.multiturn
        base = [(prompt_token_ids(prompts.batch, b), family.engine_images(messages), self._videos(messages))
                for b, messages in enumerate(prompts.messages)]
        rows = [_Row(b, Trajectory(), prompt_context(family, prompts, b, settings))
                for b in range(len(base)) for _ in range(group_size)]
        live, eos = list(range(len(rows))), set(family.eos_ids) if not sampling.ignore_eos else set()
        for turn in range(settings.max_turns):
            going = [rows[i] for i in live]
            n = group_size if turn == 0 else 1
            jobs = []
            for row in going[::n]:
                ids, images, videos = base[row.prompt]
                room = min(sampling.max_new_tokens, settings.max_total_tokens - len(row.trajectory.token_ids))
                media = {"image": images + list(row.trajectory.images), "video": videos}  # tools return images
                jobs.append((ids + row.trajectory.token_ids, media,
                             sampling_params(family, sampling, n, stops=True, max_tokens=max(room, 1),
                                             tool_stops=settings.stop_strings)))
            answers = self._generate_all(jobs)
            choices = []
            for answer in answers:
                if isinstance(answer, Rejected):
                    raise ServerError(f"a vLLM server refused a trajectory's turn {turn} as too long "
                                      f"({answer.detail}); start it with a larger --max-model-len "
                                      "(docs/many-nodes.md).")
                choices += answer
            for row, choice in zip(going, choices, strict=True):
                row.segment = list(choice.get("token_ids") or [])
                row.trajectory.logps.extend(choice_logps(choice))
                row.version = min(row.version, oldest_version(choice, self.version)) if turn else \
                    oldest_version(choice, self.version)
                ended = segment_end(family, row, row.segment[-1], eos, sampling, settings) if row.segment else ""
                row.ended_by = ended or "length"
            keep = answer_segments(family, going, turn, settings, self.tools)
            live = [i for i, alive in zip(live, keep, strict=True) if alive]
            if not live:
                break
        rollout = trajectory_rollout(family, rows, group_size, settings)
        logps = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32)  # [B * G, C], 0 on observations
        for n, row in enumerate(rows):
            logps[n, :len(row.trajectory.logps)] = torch.tensor(row.trajectory.logps, dtype=torch.float32)
        device = self.policy.model.device
        return replace(rollout, completion_ids=rollout.completion_ids.to(device),
                       completion_mask=rollout.completion_mask.to(device), loss_mask=rollout.loss_mask.to(device),
                       sampler_logps=logps.to(device), weight_versions=[row.version for row in rows])

    # ---- weights ----------------------------------------------------------------------------------
    def sync(self, model, version: int) -> None:
        """Push the trainer's weights to every server, on every rank, within sync_timeout_s
        (rollout/vllm/weight_transfer.py)."""
        from gpg_vl.models.weights import merged_lora
        from gpg_vl.rollout.vllm.common import vllm_weights
        from gpg_vl.rollout.vllm.weight_transfer import Watchdog, broadcast_from_main, push_weights

        self.version = version
        limit = self.settings.sync_timeout_s
        sentence = (f"the weight sync to the vLLM servers ({', '.join(s.url for s in self.servers)}) did not end "
                    f"within rollout.vllm_server.sync_timeout_s={limit:g} s; every rank exits. Check the servers' "
                    "logs and the network between the nodes, then continue with resume=auto.")
        with Watchdog(limit, sentence, self.rank), torch.no_grad(), merged_lora(model):
            push_weights(self.servers, self.transport, vllm_weights(model, self.family), version=self.version,
                         pause_mode="wait", collective=broadcast_from_main)

