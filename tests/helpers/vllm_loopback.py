"""A loopback test server that speaks `vllm serve`'s HTTP protocol (the routes and JSON fields of vLLM's source:
the OpenAI-compatible and dev-mode routers, `GenerateRequest` / `GenerateResponse` and `MultiModalFeatures` of
its disaggregated-serving protocol, the weight-transfer and pause routes), written here from that protocol and
generating with a tiny model, so that the trajectories the tests train on are real. vLLM itself is CUDA-only and
not installed here (its request classes would pull in torch builds and CUDA kernels), so the payloads are plain
JSON, checked field by field below.

What it serves: GET /health, /v1/models, /server_info (dev mode), /get_world_size, /is_paused, /weight_info;
POST /v1/chat/completions/render (images and videos -> features: the processor's pixels, base64 in `kwargs_data`;
a video as vLLM's `video/jpeg` data URL of comma-separated base64 frames, its metadata and frame limit from the
request's `media_io_kwargs` as vLLM's VideoMediaIO reads them, `do_sample_frames` from `mm_processor_kwargs`),
/inference/v1/generate (token ids + features -> n choices with per-token log-probs of the processed distribution
and weight-version spans; a prompt too long for --max-model-len is refused with vLLM's 400 sentence),
/pause, /resume, and the `disk` sync as stock vLLM takes it: /collective_rpc with `reload_weights` and its
`weights_path` (a folder of safetensors, loaded under the checkpoint's names), then /update_weight_version.
The suite's real-vLLM tests (tests/integration/test_vllm_real.py) run vLLM's CPU build itself; this server stays for
what those cannot do cheaply or at all: a stalled sync, several trainer processes, videos, tool trajectories.

Faults for the tests: `stall_updates` makes /collective_rpc hang (a stalled sync); `stop()` ends it (a server
that dies). Run it in-process (`LoopbackServer(...).start()`) or as a process:

    python tests/helpers/vllm_loopback.py --model embedded:tiny-qwen2.5-vl --port 0 --port-file port.txt
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


_SAMPLING = threading.Lock()  # one sampling at a time across every loopback server of this process


class LoopbackServer:
    """The state of one loopback `vllm serve`: its model, weight version, pause state and weight-transfer state."""

    def __init__(self, model: str = "embedded:tiny-qwen2.5-vl", *, served_model_name: str | None = None,
                 max_model_len: int = 8192, backend: str | None = None, dev_mode: bool = True,
                 min_pixels: int = 3136, max_pixels: int = 50176, port: int = 0) -> None:
        from gpg_vl.models.load import load_policy
        from gpg_vl.models.weights import engine_weights

        torch.manual_seed(0)
        self.policy = load_policy(model, dtype="float32", min_pixels=min_pixels, max_pixels=max_pixels)
        self.model, self.family = self.policy.model.eval(), self.policy.family
        self.path = str(self.policy.name_or_path)
        self.name = served_model_name or model
        self.max_model_len, self.backend, self.dev_mode = max_model_len, backend, dev_mode
        # vLLM's loaders take checkpoint names; this model's parameters are named after its classes
        names = [name for name, _ in engine_weights(self.model)]
        params = [param for _, param in self.model.named_parameters()]
        self.params = dict(zip(names, params, strict=True))
        self.version, self.stall_updates = "default", False
        self.running = threading.Event()
        self.running.set()
        self.lock = threading.Lock()  # one generation at a time (CPU), and never during a weight update
        self.calls: list[tuple[str, dict]] = []  # (route, body) of every POST, for the tests
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def start(self) -> LoopbackServer:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # ---- GET --------------------------------------------------------------------------------------
    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.name, "object": "model", "created": int(time.time()),
                                            "owned_by": "vllm", "root": self.path, "parent": None,
                                            "max_model_len": self.max_model_len}]}

    def server_info(self) -> dict:
        config = self.model.config.to_dict()
        return {"vllm_config": {
            "model_config": {"model": self.path, "served_model_name": self.name, "max_model_len": self.max_model_len,
                             "dtype": "float32", "logprobs_mode": "processed_logprobs", "hf_config": config},
            "parallel_config": {"tensor_parallel_size": 1, "data_parallel_size": 1},
            "weight_transfer_config": {"backend": self.backend} if self.backend else None, "lora_config": None}}

    # ---- render: images and videos -> features -----------------------------------------------------
    def render(self, body: dict) -> dict | str:
        from PIL import Image

        items = []  # (modality, raw bytes, decoded)
        for message in body["messages"]:
            for part in message["content"] if isinstance(message["content"], list) else []:
                if part.get("type") == "image_url":
                    header, data = part["image_url"]["url"].split(",", 1)
                    items.append(("image", base64.b64decode(data), Image.open(io.BytesIO(base64.b64decode(data)))))
                elif part.get("type") == "video_url":
                    header, data = part["video_url"]["url"].split(",", 1)
                    if header.lower() != "data:video/jpeg;base64":
                        return f"only video/jpeg data URLs are served here, not {header}"
                    video = self._load_frames(data, (body.get("media_io_kwargs") or {}).get("video") or {})
                    if isinstance(video, str):
                        return video
                    items.append(("video", data.encode(), video))
        processor = self.family.processor
        merge = processor.image_processor.merge_size ** 2
        features = {"mm_hashes": {}, "mm_placeholders": {}, "kwargs_data": {}}
        offset = 0
        for modality, raw, item in items:
            if modality == "image":
                size = {"shortest_edge": self.family.min_pixels, "longest_edge": self.family.max_pixels}
                out = processor.image_processor(images=[item.convert("RGB")], return_tensors="pt", size=size)
                keys, grid = ("pixel_values", "image_grid_thw"), "image_grid_thw"
            else:  # the HF processor on the placeholder, as vLLM's multimodal processor calls it
                frames, metadata = item
                sample = bool((body.get("mm_processor_kwargs") or {}).get("do_sample_frames",
                                                                          metadata["do_sample_frames"]))
                out = processor(text=[self.family.video_placeholder], videos=[frames], return_tensors="pt",
                                video_metadata=[{k: metadata[k] for k in ("fps", "frames_indices",
                                                                          "total_num_frames")}],
                                do_sample_frames=sample)
                keys, grid = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts"), "video_grid_thw"
            tokens = int(out[grid][0].prod()) // merge
            buffer = io.BytesIO()
            torch.save({key: out[key] for key in keys if key in out}, buffer)
            for part in features.values():
                part.setdefault(modality, [])
            features["mm_hashes"][modality].append(hashlib.sha256(raw).hexdigest())
            features["mm_placeholders"][modality].append({"offset": offset, "length": tokens})
            features["kwargs_data"][modality].append(base64.b64encode(buffer.getvalue()).decode())
            offset += tokens + 2
        return {"request_id": f"render-{time.time_ns()}", "token_ids": [], "features": features,
                "sampling_params": {"max_tokens": body.get("max_tokens", 16)}, "model": self.name}

    @staticmethod
    def _load_frames(data: str, kwargs: dict) -> tuple | str:
        """A `video/jpeg` data URL's frames [T, H, W, 3] (uint8) and metadata, as vLLM's VideoMediaIO makes them:
        at most `num_frames` frames (-1: all; its default 32), `fps` (default 1), `frames_indices` (one per frame
        sent), `total_num_frames` (at least the frames sent), `do_sample_frames` (default false); or why not."""
        import numpy as np
        from PIL import Image

        count = int(kwargs.get("num_frames", 32))
        if count == 0:
            return "num_frames must be greater than 0 or -1"
        parts = data.split(",")[:count] if count > 0 else data.split(",")
        frames = np.stack([np.asarray(Image.open(io.BytesIO(base64.b64decode(part))).convert("RGB"))
                           for part in parts])
        fps, indices = float(kwargs.get("fps", 1)), kwargs.get("frames_indices")
        if indices is None:
            indices = list(range(len(frames)))
        if not (isinstance(indices, list) and all(isinstance(i, int) for i in indices)):
            return "frames_indices must be a list of integers"
        if len(indices) != len(frames):
            return f"frames_indices length ({len(indices)}) must match number of frames sent ({len(frames)})"
        total = kwargs.get("total_num_frames", len(frames))
        if not isinstance(total, int) or total < len(frames):
            return f"total_num_frames ({total}) must be >= number of frames sent ({len(frames)})"
        return frames, {"fps": fps, "frames_indices": indices, "total_num_frames": total,
                        "do_sample_frames": bool(kwargs.get("do_sample_frames", False))}

    # ---- generate ----------------------------------------------------------------------------------
    def generate(self, body: dict) -> tuple[int, dict]:
        ids, params = body.get("token_ids"), body.get("sampling_params")
        if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids) or not isinstance(
                params, dict):
            return 400, {"error": {"message": "token_ids must be a list of non-negative ints and sampling_params an "
                                              "object", "type": "BadRequestError", "code": 400}}
        requested = len(ids) + int(params.get("max_tokens", 16))
        if requested > self.max_model_len:
            return 400, {"error": {"message": f"This model's maximum context length is {self.max_model_len} tokens. "
                                              f"However, you requested {requested} tokens ({len(ids)} in the "
                                              f"messages, {params.get('max_tokens', 16)} in the completion). Please "
                                              "reduce the length of the messages or completion.",
                                   "type": "BadRequestError", "code": 400}}
        inputs = self._inputs(ids, body.get("features"))
        if isinstance(inputs, str):
            return 400, {"error": {"message": inputs, "type": "BadRequestError", "code": 400}}
        self.running.wait()  # paused: requests wait for /resume
        with self.lock:
            version = self.version
            choices = self._sample(inputs, params)
        for choice in choices:
            choice["weight_versions"] = [{"version": version, "start": 0, "end": len(choice["token_ids"])}] \
                if choice["token_ids"] else []
        return 200, {"request_id": body.get("request_id", f"gen-{time.time_ns()}"), "model": self.name,
                     "created": int(time.time()), "choices": choices,
                     "usage": {"prompt_tokens": len(ids),
                               "completion_tokens": sum(len(c["token_ids"]) for c in choices)}}

    def _inputs(self, ids: list[int], features: dict | None) -> dict | str:
        """Model inputs from token ids and features (images and videos), or the reason they do not fit together."""
        inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
                  "mm_token_type_ids": torch.zeros(1, len(ids), dtype=torch.long)}  # 1 image, 2 video (M-RoPE)
        processor = self.family.processor
        merge = processor.image_processor.merge_size ** 2
        kinds = {"image": (processor.image_token_id, 1, "image_grid_thw", ("pixel_values",)),
                 "video": (processor.video_token_id, 2, "video_grid_thw",
                           ("pixel_values_videos", "second_per_grid_ts"))}
        for modality, (token, kind, grid, keys) in kinds.items():
            runs = [k for k in range(len(ids)) if ids[k] == token and (k == 0 or ids[k - 1] != token)]
            placeholders = ((features or {}).get("mm_placeholders") or {}).get(modality, [])
            data = ((features or {}).get("kwargs_data") or {}).get(modality) or []
            if len(placeholders) != len(runs) or len(data) != len(placeholders):
                return f"{len(placeholders)} {modality} placeholders for {len(runs)} runs of {modality} tokens"
            parts = {key: [] for key in (grid, *keys)}
            for place, blob in zip(placeholders, data, strict=True):
                item = torch.load(io.BytesIO(base64.b64decode(blob)))
                span = ids[place["offset"]:place["offset"] + place["length"]]
                tokens = int(item[grid][0].prod()) // merge
                if span != [token] * place["length"] or tokens != place["length"]:
                    return f"placeholder at {place['offset']} does not cover its {modality}'s {tokens} tokens"
                inputs["mm_token_type_ids"][0, place["offset"]:place["offset"] + place["length"]] = kind
                for key in parts:
                    if key in item:
                        parts[key].append(item[key])
            inputs.update({key: torch.cat(values) for key, values in parts.items() if values})
        return inputs

    @torch.no_grad()
    def _sample(self, inputs: dict, params: dict) -> list[dict]:
        """n completions, cut as vLLM cuts them (stop token ids, stop strings, max_tokens), each token's log-prob
        under the distribution it was drawn from (temperature, top_p and the banned ids applied)."""
        with _SAMPLING:  # torch's generator is the process's: two servers in one process draw one at a time
            return self._sample_locked(inputs, params)

    def _sample_locked(self, inputs: dict, params: dict) -> list[dict]:
        if params.get("seed") is not None:  # vLLM gives a seeded request its own generator: nothing else draws
            torch.manual_seed(int(params["seed"]))
        greedy = float(params.get("temperature", 1.0)) == 0.0
        banned = [int(t) for t, bias in (params.get("logit_bias") or {}).items() if float(bias) <= -100]
        stop_ids = [int(t) for t in params.get("stop_token_ids") or []]
        how = {"do_sample": False} if greedy else {"do_sample": True, "temperature": float(params["temperature"]),
                                                    "top_p": float(params.get("top_p", 1.0)), "top_k": 0}
        self.family.reset_positions(self.model)
        positions = self.family.position_ids(self.model, inputs)  # where vLLM places them (test_positions_vllm.py)
        if positions is not None and positions.dim() == 3:
            inputs = {**inputs, "position_ids": positions}
        out = self.model.generate(**inputs, max_new_tokens=int(params.get("max_tokens", 16)),
                                  num_return_sequences=int(params.get("n", 1)), suppress_tokens=banned or None,
                                  eos_token_id=stop_ids or None, pad_token_id=self.family.pad_id,
                                  output_scores=True, return_dict_in_generate=True, **how)
        width = inputs["input_ids"].shape[1]
        choices = []
        for row in range(out.sequences.shape[0]):
            tokens = out.sequences[row, width:].tolist()
            cut, reason = self._cut(tokens, stop_ids, params)
            logps = [float(torch.log_softmax(out.scores[t][row].float(), dim=-1)[token]) for t, token in
                     enumerate(tokens[:cut])]
            choices.append({"index": row, "token_ids": tokens[:cut], "finish_reason": reason,
                            "logprobs": {"content": [{"token": f"token_id:{token}", "logprob": lp, "bytes": None,
                                                      "top_logprobs": []}
                                                     for token, lp in zip(tokens[:cut], logps, strict=True)]}})
        return choices

    def _cut(self, tokens: list[int], stop_ids: list[int], params: dict) -> tuple[int, str]:
        stops = params.get("stop") or []
        for k, token in enumerate(tokens):
            if token in stop_ids:
                return k + 1, "stop"
            if stops and any(stop in self.family.tokenizer.decode(tokens[:k + 1]) for stop in stops):
                return k + 1, "stop"
        return len(tokens), "length"

    # ---- weights ------------------------------------------------------------------------------------
    def reload_weights(self, body: dict) -> tuple[int, dict]:
        """/collective_rpc's `reload_weights` (the worker's in-place reload from `weights_path`)."""
        from safetensors.torch import load_file

        if body.get("method") != "reload_weights":
            return 500, {"detail": f"the worker has no method {body.get('method')!r}"}
        while self.stall_updates:
            time.sleep(0.05)
        folder = Path((body.get("kwargs") or {}).get("weights_path") or "")
        if not folder.is_absolute() or not list(folder.glob("*.safetensors")):
            return 500, {"detail": f"{folder} is not an absolute folder of safetensors files"}
        with self.lock, torch.no_grad():
            for file in sorted(folder.glob("*.safetensors")):
                for name, tensor in load_file(str(file)).items():
                    if name == "lm_head.weight" and name not in self.params:
                        continue  # a tied head: its embedding's values, which this model shares
                    if name not in self.params:
                        return 500, {"detail": f"unexpected weight {name}"}
                    self.params[name].copy_(tensor)
        return 200, {}

    def post(self, route: str, query: dict, body: dict) -> tuple[int, dict]:
        self.calls.append((route, body))
        if route == "/inference/v1/generate":
            return self.generate(body)
        if route == "/v1/chat/completions/render":
            rendered = self.render(body)
            if isinstance(rendered, str):
                return 400, {"error": {"message": rendered, "type": "BadRequestError", "code": 400}}
            return 200, rendered
        if not self.dev_mode:
            return 404, {"detail": "Not Found"}
        if route == "/pause":
            self.running.clear()
            return 200, {"status": "paused"}
        if route == "/resume":
            self.running.set()
            return 200, {"status": "resumed"}
        if route == "/collective_rpc":
            return self.reload_weights(body)
        if route in ("/reset_prefix_cache", "/reset_encoder_cache", "/reset_mm_cache"):
            return 200, {}  # it caches nothing
        if route == "/update_weight_version":
            self.version = str(body["new_version"])
            return 200, {"success": True, "new_version": self.version}
        return 404, {"detail": "Not Found"}

    def get(self, route: str, query: dict) -> tuple[int, dict]:
        if route == "/health":
            return 200, {}
        if route == "/v1/models":
            return 200, self.models()
        if not self.dev_mode:
            return 404, {"detail": "Not Found"}
        answers = {"/server_info": self.server_info, "/get_world_size": lambda: {"world_size": 1},
                   "/is_paused": lambda: {"is_paused": not self.running.is_set()},
                   "/weight_info": lambda: {"weight_version": self.version}}
        return (200, answers[route]()) if route in answers else (404, {"detail": "Not Found"})


def _handler(server: LoopbackServer):
    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            parsed = urllib.parse.urlparse(self.path)
            self._answer(*server.get(parsed.path, urllib.parse.parse_qs(parsed.query)))

        def do_POST(self):  # noqa: N802
            parsed = urllib.parse.urlparse(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except ValueError:
                self._answer(400, {"detail": "Invalid JSON format"})
                return
            self._answer(*server.post(parsed.path, urllib.parse.parse_qs(parsed.query), body))

        def log_message(self, *args) -> None:
            pass

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded:tiny-qwen2.5-vl")
    parser.add_argument("--served-model-name")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file", required=True)
    args = parser.parse_args()
    server = LoopbackServer(args.model, served_model_name=args.served_model_name, max_model_len=args.max_model_len,
                            port=args.port)
    Path(args.port_file).write_text(server.url)
    server.httpd.serve_forever()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
