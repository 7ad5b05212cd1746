"""The teacher on vLLM servers (`teacher.urls`, docs/distillation.md): instead of loading the teacher beside the
student (`teacher.model`, gpg_vl/train/teacher/local.py), a `vllm serve TEACHER --enable-scale-out` scores the
student's sampled tokens and the update reads their log-probs, exactly where the in-process teacher's would be.

- A sequence is scored by one `POST /inference/v1/generate` of its prompt's token ids (as the trainer scores them:
  processor-expanded, images and videos as `features`, rendered by the server once per update) followed by its
  completion (a multi-turn trajectory with its observations and their images), generating one token that is
  thrown away. The log-probs come back as vLLM's prompt log-probs of the completion's positions:
  `prompt_logprob_token_ids` + `prompt_logprob_start` (the completion's rows only, returned as an array) where the
  server runs vLLM's V2 model runner, which needs Triton (a GPU); else `prompt_logprobs=0` (every prompt position's
  own token), which every runner answers, vLLM's CPU build included. `connect_teacher` asks the server which.
- vLLM's prompt log-probs are the model's raw distribution: temperature 1 (a run sampling at another temperature
  is refused), over the whole vocabulary. The trainer's scoring leaves the family's vision placeholders (never
  sampled) out of the normalizer: by token ids the request also asks for theirs and the answer is renormalized
  exactly (`renormalized`); by `prompt_logprobs` it cannot be, and each token's log-prob is lower by
  -log(1 - the teacher's mass on the placeholders) there (docs/distillation.md gives the measured gap).
- Checked before any model loads, one sentence each: a server that does not answer (`teacher.timeout_s`), one without
  `--enable-scale-out`, another tokenizer (the server's `/tokenize` of a probe text against the student's) or
  vocabulary size, a context shorter than a prompt and its completion.
"""

from __future__ import annotations

import base64
import io
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from gpg_vl.config.schema import TeacherSettings
from gpg_vl.errors import UserError
from gpg_vl.rollout.vllm.client import Rejected, Server, ServerError, ServerGone, split_urls

LIMIT = "teacher.timeout_s"
FIRST_CHECK_S = 5.0  # the first, short /health check before the run says it waits for a server
V2_ONLY = re.compile(r"V2 model runner", re.IGNORECASE)  # vLLM's refusal of prompt_logprob_token_ids on V1
# a probe whose ids differ between tokenizers that differ: chat markers, digits, accents, symbols, emoji, spaces
PROBE_TEXT = "<|im_start|>user\nWhat is 12 + 7? Réponse : ∑ x² ≥ 0, naïve café 🙂\n\t  done.<|im_end|>"


# ---------------------------------------------------------------------------------------------
# pure parts: requests and answers
# ---------------------------------------------------------------------------------------------
def score_body(model: str, token_ids: list[int], start: int, features: dict | None, *, by_ids: bool,
               suppressed: tuple[int, ...] = ()) -> dict:
    """The /inference/v1/generate request whose answer holds the log-prob of each of token_ids[start + 1:] given the
    tokens before it (`by_ids`: `prompt_logprob_token_ids`, one row per scored token: its token, then the
    `suppressed` ids, which `renormalized` leaves out; else `prompt_logprobs=0`). One greedy token is generated and
    ignored."""
    params = {"max_tokens": 1, "temperature": 0.0, "detokenize": False, "output_kind": 2}  # 2: FINAL_ONLY
    if by_ids:
        params.update(prompt_logprob_token_ids=[[token, *suppressed] for token in token_ids[start + 1:]],
                      prompt_logprob_start=start)
    else:
        params["prompt_logprobs"] = 0
    body = {"model": model, "token_ids": token_ids, "sampling_params": params}
    if features:
        body["features"] = features
    return body


def renormalized(rows: np.ndarray) -> np.ndarray:
    """[count] log-probs of each row's first id in the distribution without the row's other ids: rows [count, 1 + k]
    of full-vocabulary log-probs (the scored token, then the k suppressed ids): log p - log(1 - sum of their p)."""
    rows = rows.astype(np.float64)
    if rows.shape[1] == 1:
        return rows[:, 0]
    return rows[:, 0] - np.log1p(-np.exp(rows[:, 1:]).sum(axis=1))


def answer_logps(answer: dict, token_ids: list[int], start: int) -> list[float]:
    """The log-probs [len(token_ids) - start - 1] of token_ids[start + 1:] in a `score_body` answer: its
    `prompt_token_id_logprobs` (a base64 .npy array [rows, 1 + k], row i scoring token start + i + 1, then the k
    suppressed ids: `renormalized`) or its `prompt_logprobs` (position k: {str(id): {"logprob": ...}}, the
    position's own token always among them)."""
    count = len(token_ids) - start - 1
    encoded = answer.get("prompt_token_id_logprobs")
    if encoded:
        rows = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)  # [count, 1 + k]
        if rows.ndim != 2 or rows.shape[0] != count:
            raise ServerError(f"a teacher server returned scored rows of shape {tuple(rows.shape)} for {count} "
                              "tokens; use a vLLM version whose prompt_logprob_token_ids returns one row per scored "
                              "token.")
        return [float(value) for value in renormalized(rows)]
    entries = answer.get("prompt_logprobs") or []
    found = []
    for position in range(start + 1, len(token_ids)):
        entry = (entries[position] if position < len(entries) else None) or {}
        value = entry.get(str(token_ids[position]))
        if value is None:
            raise ServerError(f"a teacher server gave no log-prob for token {position} of a scored sequence; use a "
                              "vLLM version whose prompt_logprobs include each prompt token's own.")
        found.append(float(value["logprob"]))
    return found


def tokenizer_problem(url: str, served: list[int], ours: list[int], vocab: tuple[int | None, int | None]) -> str | None:
    """One sentence when the teacher server's tokenizer or vocabulary is not the student's: `served` / `ours` the
    probe text's ids, `vocab` (the server's vocab_size or None, the student's)."""
    theirs, student = vocab
    if served != ours or (theirs is not None and student is not None and theirs != student):
        return (f"the teacher server at {url} has another tokenizer or vocabulary than the student (teacher.urls); "
                "on-policy distillation scores the student's tokens, so serve a teacher of the same tokenizer (the "
                "same model family).")
    return None


# ---------------------------------------------------------------------------------------------
# the teacher
# ---------------------------------------------------------------------------------------------
@dataclass
class ServerTeacher:
    """The teacher on vLLM servers: scores a micro-batch's completions there (`logps`, as Teacher.logps)."""

    servers: list[Server]
    model_name: str
    settings: TeacherSettings
    by_ids: bool  # the servers take prompt_logprob_token_ids (V2 model runner), else prompt_logprobs=0
    rank: int = 0
    family: object = None  # the student's family and its image / video tokens (`bind`)
    tokens: dict = field(default_factory=dict)
    requests: int = 0  # requests sent by this process (spread across the servers)

    def bind(self, policy) -> ServerTeacher:
        """The student's family (its prompts' media, its image and video tokens), once the policy is built."""
        from gpg_vl.rollout.vllm.server import media_tokens

        self.family, self.tokens = policy.family, media_tokens(policy.family, policy.model.config)
        return self

    def logps(self, family, chunk, device, *, temperature: float, logits_chunk_tokens: int,
              messages: list[list[dict]] | None = None, cache: dict | None = None) -> torch.Tensor:
        """The teacher's log-probs [n, C] of micro-batch `chunk`'s completions (0 past each one's length).
        `messages`: the messages of chunk.prompts' prompts (their images and videos); `cache`: rendered media,
        shared by the update's micro-batches. `temperature` is 1 (connect_teacher refused another)."""
        del temperature, logits_chunk_tokens  # the server's own distribution, at temperature 1
        if messages is None:
            raise ValueError("the teacher on vLLM servers needs the prompts' messages (Attempt.messages)")
        cache = {} if cache is None else cache
        lengths = chunk.completion_mask.sum(dim=1).tolist()  # [n]
        jobs = [self._job(chunk, row, int(length), messages) for row, length in enumerate(lengths)]
        first, self.requests = self.requests, self.requests + len(jobs)
        servers = [self.servers[(self.rank + first + i) % len(self.servers)] for i in range(len(jobs))]
        workers = max(1, min(self.settings.max_concurrency, len(jobs)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            scored = list(pool.map(lambda i: self._score(servers[i], *jobs[i], cache), range(len(jobs))))
        out = torch.zeros(chunk.completion_ids.shape, dtype=torch.float32)  # [n, C]
        for row, values in enumerate(scored):
            out[row, :len(values)] = torch.tensor(values, dtype=torch.float32)
        return out.to(device)

    def _job(self, chunk, row: int, length: int, messages: list[list[dict]]) -> tuple[list[int], int, dict]:
        """(token ids: the prompt's then the completion's, the last prompt position, the media)."""
        from gpg_vl.rollout.vllm.server import prompt_token_ids, prompt_videos

        b = chunk.prompt_index[row]
        prompt = prompt_token_ids(chunk.prompts, b)
        completion = chunk.completion_ids[row, :length].tolist()
        images = list(self.family.engine_images(messages[b]))
        if chunk.trajectories is not None:  # a trajectory's observations hold the images its tools returned
            images += list(chunk.trajectories[row].images)
        media = {"image": images, "video": prompt_videos(self.family, messages[b], self.tokens)}
        return prompt + completion, len(prompt) - 1, media

    def _score(self, server: Server, token_ids: list[int], start: int, media: dict, cache: dict) -> list[float]:
        from gpg_vl.rollout.vllm.server import place_features, render_features

        if start + 1 >= len(token_ids):  # an empty completion: nothing to score
            return []
        features = place_features(render_features(server, self.model_name, media, cache, limit=LIMIT), token_ids,
                                  self.tokens, server.url)
        try:
            answer = server.post("/inference/v1/generate",
                                 score_body(self.model_name, token_ids, start, features, by_ids=self.by_ids,
                                            suppressed=tuple(self.family.suppressed_ids or ())),
                                 limit=LIMIT)
        except Rejected as error:
            raise ServerError(f"the teacher server at {server.url} refused to score a sequence of {len(token_ids)} "
                              f"tokens ({error.detail}); start it with a --max-model-len of at least "
                              "rollout.max_prompt_tokens + rollout.max_new_tokens (docs/distillation.md).") from None
        return answer_logps(answer, token_ids, start)


# ---------------------------------------------------------------------------------------------
# connecting, before any model loads
# ---------------------------------------------------------------------------------------------
def connect_teacher(teacher: TeacherSettings, *, tokenizer, vocab_size: int | None, rollout,
                    rank: int = 0) -> ServerTeacher | None:
    """The teacher on teacher.urls (None without them), after checking each server (the module's docstring):
    one sentence for each problem, before any model loads. `tokenizer`, `vocab_size`: the student's; `rollout`:
    the run's rollout settings (temperature, the longest sequence)."""
    if teacher.urls is None:
        return None
    if float(rollout.temperature) != 1.0:
        raise UserError(f"teacher.urls scores with the teacher's own distribution at temperature 1 (vLLM's prompt "
                        f"log-probs), but rollout.temperature={rollout.temperature:g}; set rollout.temperature=1 or "
                        "load the teacher beside the student with teacher.model.")
    needed = rollout.max_prompt_tokens + max(rollout.max_new_tokens,
                                             rollout.max_total_tokens if rollout.max_turns > 1 else 0)
    ours = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    servers = [Server(url, timeout_s=teacher.timeout_s) for url in split_urls(teacher.urls, key="teacher.urls")]
    name, by_ids = None, None
    for server in servers:
        _wait(server, teacher.timeout_s)
        served = (server.get("/v1/models", limit=LIMIT).get("data") or [{}])[0]
        name = name or served.get("id")
        length = served.get("max_model_len")
        if length and int(length) < needed:
            raise UserError(f"the teacher server at {server.url} takes {length} tokens per sequence (its "
                            f"--max-model-len), fewer than a prompt and its completion ({needed}); start it with "
                            f"--max-model-len {needed}, or lower rollout.max_prompt_tokens or rollout.max_new_tokens.")
        probe = server.post("/tokenize", {"model": served.get("id"), "prompt": PROBE_TEXT,
                                          "add_special_tokens": False}, limit=LIMIT)
        reason = tokenizer_problem(server.url, list(probe.get("tokens") or []), list(ours),
                                   (_served_vocab(server), vocab_size))
        if reason is not None:
            raise UserError(reason)
        by_ids = _takes_token_ids(server, served.get("id"), ours[:4]) if by_ids is None else by_ids
    return ServerTeacher(servers, name, teacher, by_ids, rank=rank)


def student_tokenizer(student: str) -> tuple[object, int | None]:
    """(tokenizer, vocabulary size) of the student's folder or hub id `student` (model.name_or_path), read before it
    loads (what `connect_teacher` checks a server against)."""
    from transformers import AutoConfig, AutoTokenizer

    from gpg_vl.models.load import resolve_path

    path = resolve_path(str(student))
    try:
        tokenizer, config = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise UserError(f"model.name_or_path={path} has no tokenizer or config that loads ({type(error).__name__}); "
                        "name a model folder or hub id.") from None
    text = getattr(config, "text_config", None) or config
    return tokenizer, getattr(text, "vocab_size", None)


def _wait(server: Server, timeout_s: float) -> None:
    """Until the server answers /health: one short try, then (saying so at once) up to teacher.timeout_s."""
    try:
        try:
            server.get("/health", timeout_s=min(FIRST_CHECK_S, timeout_s), retry=False, limit=LIMIT)
        except ServerGone:
            print(f"waiting up to {timeout_s:g} s (teacher.timeout_s) for the teacher's vLLM server at {server.url} "
                  "to answer GET /health ...", file=sys.stderr, flush=True)
            server.get("/health", limit=LIMIT)
    except ServerGone:
        raise UserError(f"no vLLM server answers at {server.url} (GET /health, for teacher.timeout_s="
                        f"{timeout_s:g} s); start `vllm serve TEACHER --enable-scale-out` there "
                        "(docs/distillation.md) or fix teacher.urls.") from None
    except Rejected as error:
        raise UserError(f"the server at {server.url} is not a vLLM server ({error}); fix teacher.urls.") from None


def _served_vocab(server: Server) -> int | None:
    """The served model's vocab_size, where the server exposes its configuration (VLLM_SERVER_DEV_MODE=1)."""
    try:
        info = server.get("/server_info?config_format=json", retry=False, limit=LIMIT).get("vllm_config") or {}
    except (Rejected, ServerGone):
        return None
    hf_config = (info.get("model_config") or {}).get("hf_config") or {}
    return (hf_config.get("text_config") or hf_config).get("vocab_size")


def _takes_token_ids(server: Server, model: str, probe: list[int]) -> bool:
    """Whether the server scores by `prompt_logprob_token_ids` (vLLM's V2 model runner); else it must answer
    `prompt_logprobs`. One sentence when it has no token-in route (--enable-scale-out)."""
    for by_ids in (True, False):
        try:
            answer_logps(server.post("/inference/v1/generate", score_body(model, probe, 0, None, by_ids=by_ids),
                                     limit=LIMIT), probe, 0)
            return by_ids
        except Rejected as error:
            if error.status == 404:
                raise UserError(f"the teacher server at {server.url} has no /inference/v1/generate route; restart it "
                                "with --enable-scale-out (docs/distillation.md).") from None
            if not (by_ids and V2_ONLY.search(error.detail)):
                raise UserError(f"the teacher server at {server.url} refused a scoring request ({error.detail}); "
                                "serve the teacher with vLLM 0.32 or later (docs/distillation.md).") from None
    return False
