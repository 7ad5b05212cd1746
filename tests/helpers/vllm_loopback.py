"""A loopback stand-in for `vllm serve`, kept for the one fault vLLM itself cannot be made to produce: **a stalled
weight sync** (`stall_updates`: `/collective_rpc`'s reload never answers, while the server stays up and reachable).
A real server can be killed, refused, or given another model (tests/integration/test_vllm_real.py does each), but
not made to hang inside one request of a sync and nowhere else.

Everything else runs against vLLM itself (its CPU build): image prompts, the sync's requests, several trainer
processes, FSDP2 and ZeRO-3, two servers, a prompt too long for one (tests/integration/test_vllm_real.py and
test_vllm_real_launch.py), videos and tool trajectories (test_vllm_video_tools_real.py).

What it serves, as stock vLLM's routes and JSON fields do (read from its source: the OpenAI-compatible and dev-mode
routers, `GenerateRequest` / `GenerateResponse` and `MultiModalFeatures` of its disaggregated-serving protocol), with
the tiny model generating so that the run it serves trains on real trajectories: GET /health, /v1/models,
/server_info (dev mode), /is_paused, /weight_info; POST /v1/chat/completions/render (an image -> its processed
pixels, base64 in `kwargs_data`), /inference/v1/generate (token ids + features -> n choices with per-token log-probs
of the processed distribution and weight-version spans), /pause, /resume, the caches' resets, and the `disk` sync as
stock vLLM takes it: /collective_rpc with `reload_weights` and its `weights_path` (a folder of safetensors, loaded
under the checkpoint's names), then /update_weight_version.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch


class LoopbackServer:
    """The state of one loopback `vllm serve`: its model, weight version, pause state, and the stall switch."""

    def __init__(self, model: str = "embedded:tiny-qwen2.5-vl", *, min_pixels: int = 3136,
                 max_pixels: int = 50176) -> None:
        from gpg_vl.models.load import load_policy
        from gpg_vl.models.weights import engine_weights

        torch.manual_seed(0)
        self.policy = load_policy(model, dtype="float32", min_pixels=min_pixels, max_pixels=max_pixels)
        self.model, self.family = self.policy.model.eval(), self.policy.family
        self.path, self.name, self.max_model_len = str(self.policy.name_or_path), model, 8192
        # vLLM's loaders take checkpoint names; this model's parameters are named after its classes
        names = [name for name, _ in engine_weights(self.model)]
        params = [param for _, param in self.model.named_parameters()]
        self.params = dict(zip(names, params, strict=True))
        self.version, self.stall_updates = "default", False
        self.running = threading.Event()
        self.running.set()
        self.lock = threading.Lock()  # one generation at a time (CPU), and never during a weight update
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
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
            "weight_transfer_config": None, "lora_config": None}}

    # ---- render: an image -> its features ---------------------------------------------------------
    def render(self, body: dict) -> dict:
        from PIL import Image

        processor = self.family.processor
        features = {"mm_hashes": {"image": []}, "mm_placeholders": {"image": []}, "kwargs_data": {"image": []}}
        for message in body["messages"]:
            for part in message["content"] if isinstance(message["content"], list) else []:
                if part.get("type") != "image_url":
                    continue
                raw = base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
                size = {"shortest_edge": self.family.min_pixels, "longest_edge": self.family.max_pixels}
                out = processor.image_processor(images=[Image.open(io.BytesIO(raw)).convert("RGB")],
                                                return_tensors="pt", size=size)
                buffer = io.BytesIO()
                torch.save({key: out[key] for key in ("pixel_values", "image_grid_thw")}, buffer)
                tokens = int(out["image_grid_thw"][0].prod()) // processor.image_processor.merge_size ** 2
                features["mm_hashes"]["image"].append(hashlib.sha256(raw).hexdigest())
                features["mm_placeholders"]["image"].append({"offset": 0, "length": tokens})
                features["kwargs_data"]["image"].append(base64.b64encode(buffer.getvalue()).decode())
        return {"request_id": f"render-{time.time_ns()}", "token_ids": [], "features": features,
                "sampling_params": {"max_tokens": body.get("max_tokens", 16)}, "model": self.name}

    # ---- generate ----------------------------------------------------------------------------------
    def generate(self, body: dict) -> tuple[int, dict]:
        ids, params = body["token_ids"], body["sampling_params"]
        inputs = self._inputs(ids, body.get("features"))
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

    def _inputs(self, ids: list[int], features: dict | None) -> dict:
        """Model inputs from token ids and the images' features (each at its placeholder's run of image tokens)."""
        inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
                  "mm_token_type_ids": torch.zeros(1, len(ids), dtype=torch.long)}  # 1: image (M-RoPE)
        pixels, grids = [], []
        places = ((features or {}).get("mm_placeholders") or {}).get("image", [])
        blobs = ((features or {}).get("kwargs_data") or {}).get("image", [])
        for place, blob in zip(places, blobs, strict=True):
            item = torch.load(io.BytesIO(base64.b64decode(blob)))
            inputs["mm_token_type_ids"][0, place["offset"]:place["offset"] + place["length"]] = 1
            pixels.append(item["pixel_values"])
            grids.append(item["image_grid_thw"])
        if pixels:
            inputs.update(pixel_values=torch.cat(pixels), image_grid_thw=torch.cat(grids))
        return inputs

    @torch.no_grad()
    def _sample(self, inputs: dict, params: dict) -> list[dict]:
        """n completions, cut after a stop token id as vLLM cuts them, each token's log-prob under the distribution
        it was drawn from (temperature, top_p and the banned ids applied)."""
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
            hit = next((k for k, token in enumerate(tokens) if token in stop_ids), None)
            cut = len(tokens) if hit is None else hit + 1
            logps = [float(torch.log_softmax(out.scores[t][row].float(), dim=-1)[token]) for t, token in
                     enumerate(tokens[:cut])]
            choices.append({"index": row, "token_ids": tokens[:cut], "finish_reason": "length" if hit is None
                            else "stop",
                            "logprobs": {"content": [{"token": f"token_id:{token}", "logprob": lp, "bytes": None,
                                                      "top_logprobs": []}
                                                     for token, lp in zip(tokens[:cut], logps, strict=True)]}})
        return choices

    # ---- weights ------------------------------------------------------------------------------------
    def reload_weights(self, body: dict) -> tuple[int, dict]:
        """/collective_rpc's `reload_weights` (the worker's in-place reload from `weights_path`); with
        `stall_updates` it never answers (until the switch is turned off)."""
        from safetensors.torch import load_file

        while self.stall_updates:
            time.sleep(0.05)
        folder = Path((body.get("kwargs") or {}).get("weights_path") or "")
        with self.lock, torch.no_grad():
            for file in sorted(folder.glob("*.safetensors")):
                for name, tensor in load_file(str(file)).items():
                    if name == "lm_head.weight" and name not in self.params:
                        continue  # a tied head: its embedding's values, which this model shares
                    self.params[name].copy_(tensor)
        return 200, {}

    def post(self, route: str, query: dict, body: dict) -> tuple[int, dict]:
        if route == "/inference/v1/generate":
            return self.generate(body)
        if route == "/v1/chat/completions/render":
            return 200, self.render(body)
        if route == "/pause":
            self.running.clear()
            return 200, {"status": "paused"}
        if route == "/resume":
            self.running.set()
            return 200, {"status": "resumed"}
        if route == "/collective_rpc":
            return self.reload_weights(body)
        if route in ("/reset_prefix_cache", "/reset_encoder_cache"):
            return 200, {}  # it caches nothing
        if route == "/update_weight_version":
            self.version = str(body["new_version"])
            return 200, {"success": True, "new_version": self.version}
        return 404, {"detail": "Not Found"}

    def get(self, route: str, query: dict) -> tuple[int, dict]:
        answers = {"/health": dict, "/v1/models": self.models, "/server_info": self.server_info,
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
            body = json.loads(self.rfile.read(length) or b"{}")
            self._answer(*server.post(parsed.path, urllib.parse.parse_qs(parsed.query), body))

        def log_message(self, *args) -> None:
            pass

    return Handler
