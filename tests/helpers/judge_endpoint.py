"""A scripted OpenAI-compatible judge on a free loopback port, for the cases a real server of the tiny model cannot
produce (good scores, JSON answers, refusals, silence, a server that goes down): `ScriptedJudge(script)` answers
`POST /v1/chat/completions` with `script(answer, body)` (the "Model's answer:" line of the prompt, the request
body), which returns the reply's text, or (HTTP status, JSON body) for anything else; `GET /v1/models` lists
`models`. It records each request's body and headers, and the most requests it held at once."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def asked_answer(body: dict) -> str:
    """The model's answer a judge prompt shows (the line after "Model's answer:"), else the whole prompt."""
    prompt = body["messages"][0]["content"]
    return prompt.split("Model's answer:")[1].split("\n")[0].strip() if "Model's answer:" in prompt else prompt


class ScriptedJudge:
    def __init__(self, script: Callable[[str, dict], str | tuple[int, object]], models: tuple[str, ...] = ("judge",),
                 hold: threading.Barrier | None = None) -> None:
        self.script, self.models, self.hold = script, models, hold
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path == "/v1/models":
                    self.answer(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in owner.models]})
                else:
                    self.answer(404, {"detail": "Not Found"})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with owner.lock:
                    owner.bodies.append(body)
                    owner.headers.append(dict(self.headers))
                    owner.in_flight += 1
                    owner.most_in_flight = max(owner.most_in_flight, owner.in_flight)
                try:
                    if owner.hold is not None:
                        owner.hold.wait()  # until as many requests as the barrier's parties are held at once
                    result = owner.script(asked_answer(body), body)
                finally:
                    with owner.lock:
                        owner.in_flight -= 1
                if isinstance(result, str):
                    result = (200, {"id": "x", "object": "chat.completion", "model": body.get("model"),
                                    "choices": [{"index": 0, "message": {"role": "assistant", "content": result},
                                                 "finish_reason": "stop"}]})
                if self.path != "/v1/chat/completions":
                    result = (404, {"detail": "Not Found"})
                self.answer(*result)

            def answer(self, status: int, payload) -> None:
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up first (its timeout)
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Down: the port refuses connections from now on."""
        if self.thread.is_alive():
            self.server.shutdown()
            self.server.server_close()

    def __enter__(self) -> ScriptedJudge:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
