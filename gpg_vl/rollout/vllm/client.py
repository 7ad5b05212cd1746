"""Talking to stock `vllm serve` endpoints over HTTP (the standard library's urllib: no new dependency).

The routes and JSON fields are vLLM's own (read from its source; the loopback test server in
tests/helpers/vllm_loopback.py speaks the same):

- `GET /health`, `GET /v1/models` (`data[0].id`, `root`, `max_model_len`), `GET /server_info?config_format=json`
  (`vllm_config`: `model_config`, `weight_transfer_config`, ...; with `VLLM_SERVER_DEV_MODE=1`);
- `POST /v1/chat/completions/render`: messages -> a `GenerateRequest` whose `features` (`MultiModalFeatures`:
  `mm_hashes`, `mm_placeholders`, `kwargs_data`) hold the processed images (`--enable-scale-out`);
- `POST /inference/v1/generate`: `token_ids` (+ `features`) and `sampling_params` -> `choices` with `token_ids`,
  `logprobs.content[*].logprob`, `finish_reason` and, where the server has them, `weight_versions`;
- `POST /pause?mode=...`, `POST /resume`, `POST /init_weight_transfer_engine` (`init_info`),
  `/start_weight_update`, `/update_weights` (`update_info`), `/finish_weight_update` (`weight_version`),
  `GET /get_world_size` (with `VLLM_SERVER_DEV_MODE=1`).

Every request has a deadline. A server that cannot be reached (refused connection, reset, 502/503/504, a socket
timeout) is retried until the deadline, then `ServerGone` says so in one sentence; a request the server refuses
(4xx) raises `Rejected` with the server's own message, which the engine decides about (a prompt too long for the
server is a bad row).
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from gpg_vl.errors import UserError
from gpg_vl.rollout.engine import EngineUnreachable

RETRY_STATUSES = (502, 503, 504)  # a proxy in front of a server that is restarting, or an overloaded server
BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)  # waits between retries (the last repeats)
# a request unanswered this long is said once per server (one whose weight load failed answers /health but never
# generates, and the wait would otherwise run its whole deadline without a word)
NOTE_AFTER_S = 20.0


class ServerError(UserError):
    """A server answered in a way the run cannot go on from (one sentence)."""


class ServerGone(ServerError, EngineUnreachable):
    """A server could not be reached within its deadline: the run checkpoints and stops (gpg_vl/train/loop.py)."""


class Rejected(Exception):
    """The server refused the request (HTTP 4xx); `detail` is its own message."""

    def __init__(self, url: str, status: int, detail: str) -> None:
        super().__init__(f"{url} refused the request (HTTP {status}): {detail}")
        self.status, self.detail = status, detail


def split_urls(urls: str, key: str = "rollout.vllm_server.urls") -> list[str]:
    """`urls` (the setting `key`: rollout.vllm_server.urls, teacher.urls) -> base URLs without a trailing slash; one
    sentence for a malformed one."""
    found = [url.strip().rstrip("/") for url in str(urls).split(",") if url.strip()]
    for url in found:
        parsed = urllib.parse.urlparse(url)
        try:
            port = parsed.port  # urllib refuses one outside 0-65535
        except ValueError:
            port = 0
        if port == 0:  # (None: no port given, the scheme's own)
            raise UserError(f"{key} holds {url!r}, whose port {parsed.netloc.rsplit(':', 1)[1]} "
                            "is not a port (1-65535); give the port `vllm serve --port` listens on.")
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise UserError(f"{key} holds {url!r}, which is not an http(s)://host:port address; "
                            "write each `vllm serve` endpoint as http://host:port, separated by commas.")
    if not found:
        raise UserError(f"{key} is empty; give the `vllm serve` endpoints as http://host:port,...")
    return found


class Server:
    """One `vllm serve` endpoint (`headers`: sent with every request besides the JSON content type, e.g. a bearer
    token for an OpenAI-compatible API: gpg_vl/reward/judge.py)."""

    def __init__(self, url: str, *, timeout_s: float, headers: dict[str, str] | None = None) -> None:
        self.url, self.timeout_s, self.headers = url, timeout_s, dict(headers or {})
        self.said_waiting = False  # a long wait on this server was said (once)

    def get(self, route: str, *, timeout_s: float | None = None, retry: bool = True, **named) -> dict:
        return self.request("GET", route, None, timeout_s=timeout_s, retry=retry, **named)

    def post(self, route: str, body: dict | None = None, *, timeout_s: float | None = None,
             retry: bool = True, **named) -> dict:
        return self.request("POST", route, {} if body is None else body, timeout_s=timeout_s, retry=retry, **named)

    def request(self, method: str, route: str, body: dict | None, *, timeout_s: float | None = None,
                retry: bool = True, limit: str = "rollout.vllm_server.timeout_s") -> dict:
        """The JSON answer of `method route` (body as JSON); retried while the server is unreachable, until
        `timeout_s` (default: the server's) has passed. Raises ServerGone past it, naming `limit` (the setting
        that gave `timeout_s`), Rejected on a 4xx."""
        budget = self.timeout_s if timeout_s is None else timeout_s
        waiting = threading.Timer(NOTE_AFTER_S, self._still_waiting, (f"{method} {route}", budget, limit))
        waiting.daemon = True
        if budget > NOTE_AFTER_S and not self.said_waiting:
            waiting.start()
        try:
            return self._request(method, route, body, budget, retry, limit)
        finally:
            waiting.cancel()

    def _still_waiting(self, what: str, budget: float, limit: str) -> None:
        if not self.said_waiting:
            self.said_waiting = True
            print(f"still waiting for the vLLM server at {self.url} to answer {what} ({NOTE_AFTER_S:g} s so far, up "
                  f"to {limit}={budget:g} s); a server whose weight load failed still answers /health but never "
                  "generates: restart it.", file=sys.stderr, flush=True)

    def _request(self, method: str, route: str, body: dict | None, budget: float, retry: bool, limit: str) -> dict:
        deadline = time.monotonic() + budget
        data = None if body is None else json.dumps(body).encode()
        attempt, last = 0, ""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            request = urllib.request.Request(self.url + route, data=data, method=method,
                                             headers={"Content-Type": "application/json", **self.headers})
            try:
                with urllib.request.urlopen(request, timeout=left) as response:  # noqa: S310 (http(s) only)
                    text = response.read().decode() or "{}"
                    return json.loads(text)
            except urllib.error.HTTPError as error:
                detail = _detail(error)
                if error.code not in RETRY_STATUSES:
                    raise Rejected(self.url + route, error.code, detail) from None
                last = f"HTTP {error.code}: {detail}"
            except (urllib.error.URLError, ConnectionError, http.client.HTTPException, TimeoutError) as error:
                last = str(getattr(error, "reason", error)) or type(error).__name__
            if not retry:
                break
            time.sleep(min(BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)], max(0.0, deadline - time.monotonic())))
            attempt += 1
        tries = f"{attempt + 1} {'try' if attempt == 0 else 'tries'}"
        raise ServerGone(f"the vLLM server at {self.url} did not answer {method} {route} within {budget:g} s "
                         f"({tries}; last: {last or 'no answer'}); check that `vllm serve` is running there and "
                         f"reachable, or raise {limit}.")


def _detail(error: urllib.error.HTTPError) -> str:
    """The message of an HTTP error answer: FastAPI's `detail`, vLLM's `error.message` / `message`, or the text."""
    try:
        text = error.read().decode()
    except Exception:  # noqa: BLE001 (a broken body still gets its status reported)
        return error.reason or ""
    try:
        answer = json.loads(text)
    except ValueError:
        return text.strip()[:500]
    if isinstance(answer, dict):
        inner = answer.get("error")
        if isinstance(inner, dict):
            return str(inner.get("message", inner))
        return str(answer.get("detail") or answer.get("message") or inner or answer)
    return str(answer)
