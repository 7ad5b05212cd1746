"""Pushing the trainer's weights into `vllm serve` endpoints, through routes stock vLLM has.

One sync, on EVERY trainer rank (DDP, FSDP2, ZeRO-3 alike), under `rollout.vllm_server.sync_timeout_s`:

1. rank 0 pauses generation on every server (`POST /pause?mode=...`) and opens the update (`nccl`:
   `/start_weight_update`; `disk`: nothing to open);
2. every rank walks the weights (`models/weights.py`: gathered one tensor at a time, which is a collective
   under FSDP2 / ZeRO-3, LoRA merged, checkpoint names); only rank 0 sends them, over
   `rollout.vllm_server.weight_transfer`:
   - `nccl` (separate GPUs; the servers started with `--weight-transfer-config '{"backend": "nccl"}'`): rank 0
     joins one NCCL group with every worker of every server (`init_info`: master address and port, world size,
     each server's rank offset, packed) once, at start; each sync sends buckets of tensors: `/update_weights` with
     their names, dtypes and shapes while rank 0 broadcasts them (vLLM's `packed_nccl_broadcast_producer`). Needs
     CUDA and the vllm package on the trainer's rank 0;
   - `disk` (any device, CPU included; no `--weight-transfer-config`: vLLM has no `disk` backend): rank 0 writes
     the weights as one safetensors file into a folder every server reads at the same path
     (`rollout.vllm_server.transfer_dir`, one sub-folder per version, written whole before it is named), then
     asks each server to load it in place through dev mode's `POST /collective_rpc` with
     `{"method": "reload_weights", "kwargs": {"weights_path": folder}}` (the worker's `reload_weights`, which
     drops the workers' encoder cache), then `/reset_prefix_cache` and `/reset_encoder_cache` (the scheduler's
     record of the encoder outputs too);
3. rank 0 labels the new weights with the sync's number (`nccl`: `/finish_weight_update`; `disk`:
   `/update_weight_version`: the label vLLM writes on every output token sampled after it; both then read back
   from `/weight_info`) and resumes generation (`/resume`);
4. rank 0 tells every rank how it went (one broadcast): a failure raises the same sentence on every rank.

A watchdog on every rank bounds the whole sync: past `sync_timeout_s` (a server or a collective that hangs: the
multi-node hangs users report) the rank prints one sentence and exits at once, so that no rank is left waiting in
a collective its peers will never join.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from gpg_vl.rollout.vllm.client import Rejected, Server, ServerError, ServerGone

SYNC_STALLED_EXIT = 75  # the exit status of a rank whose sync outlived sync_timeout_s
CALL_SHARE = 0.8  # a request within a sync gives up after this share of sync_timeout_s: rank 0 then tells every
# rank (a clean stop, with a checkpoint); the watchdog, at the whole of it, is for what cannot give up (a collective)
BUCKET_BYTES = 512 * 1024 * 1024  # nccl: tensors sent per /update_weights


class Watchdog:
    """Ends this process with one sentence unless `cancel()` comes within `seconds`."""

    def __init__(self, seconds: float, sentence: str, rank: int) -> None:
        self.sentence, self.rank = sentence, rank
        self.timer = threading.Timer(seconds, self._expire)
        self.timer.daemon = True

    def __enter__(self) -> Watchdog:
        self.timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self.timer.cancel()

    def _expire(self) -> None:
        sys.stderr.write(f"error: rank {self.rank}: {self.sentence}\n")
        sys.stderr.flush()
        os._exit(SYNC_STALLED_EXIT)  # a hung collective cannot be unwound: leave it, on every rank


def dtype_name(dtype: torch.dtype) -> str:
    """vLLM's dtype spelling: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


class Transport:
    """How the weights travel (rollout.vllm_server.weight_transfer): `init` once per run, then for each sync (rank 0
    only, but for `send`, which runs on every rank) `open`, `send`, `label`."""

    backend = "none"

    def __init__(self, settings, *, rank: int) -> None:
        self.settings, self.rank = settings, rank
        self.timeout_s = CALL_SHARE * settings.sync_timeout_s  # each request of a sync
        self.limit = (f"rollout.vllm_server.sync_timeout_s={settings.sync_timeout_s:g} s (each request of a weight "
                      f"sync may take {CALL_SHARE:.0%} of it)")

    def init(self, servers: list[Server]) -> None:
        raise NotImplementedError

    def open(self, servers: list[Server]) -> None:
        """After the pause, before the weights go (rank 0)."""

    def send(self, servers: list[Server], weights, version: int) -> None:
        raise NotImplementedError

    def label(self, servers: list[Server], version: int) -> None:
        """After the weights: the servers' weight version becomes `version` (rank 0)."""
        raise NotImplementedError


# after a reload, what was computed with the old weights: the prompts' KV blocks, and the encoder outputs (the
# scheduler's record of them too: else an image seen before is a cache miss)
RESETS = ("/reset_prefix_cache", "/reset_encoder_cache")


class DiskTransport(Transport):
    """`disk`: safetensors in a shared folder, one folder per version (the previous one removed after), loaded by
    each server's `reload_weights` through `/collective_rpc`, labelled through `/update_weight_version`."""

    backend = "disk"

    @property
    def folder(self) -> Path:
        return Path(self.settings.transfer_dir).resolve()

    def init(self, servers: list[Server]) -> None:
        """Nothing to set up: the routes are dev mode's, which the engine has checked."""

    def send(self, servers: list[Server], weights, version: int) -> None:
        from safetensors.torch import save_file

        target = self.folder / f"v{version}"
        tensors = {}
        for name, tensor in weights:  # every rank walks them (gathering is collective); rank 0 keeps them
            if self.rank == 0:
                tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()
        if self.rank != 0:
            return
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        save_file(tensors, str(partial / "model.safetensors"))
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)  # a server never reads a half-written folder
        _each(servers, lambda server: self._reload(server, target))
        for route in RESETS:
            _each(servers, lambda server, route=route: server.post(route, timeout_s=self.timeout_s, retry=False,
                                                                   limit=self.limit))
        for old in self.folder.glob("v*"):
            if old != target and old.name.removeprefix("v").isdigit():
                shutil.rmtree(old, ignore_errors=True)

    def _reload(self, server: Server, target: Path) -> None:
        """The server loads `target` in place; one sentence when it cannot (another model, or a folder it cannot
        read: the reload names the first weight it could not place)."""
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(target)}}
        try:
            server.post("/collective_rpc", body, timeout_s=self.timeout_s, retry=False, limit=self.limit)
        except Rejected as error:
            raise ServerError(f"the vLLM server at {server.url} could not load the trainer's weights from {target} "
                              f"(HTTP {error.status}: {error.detail[:300]}); restart it (after a failed load it still "
                              "answers /health but generates nothing) with the trainer's model, and let it read "
                              "rollout.vllm_server.transfer_dir at the trainer's path.") from None

    def label(self, servers: list[Server], version: int) -> None:
        _each(servers, lambda server: server.post("/update_weight_version", {"new_version": str(version)},
                                                  timeout_s=self.timeout_s, retry=False, limit=self.limit))


class NCCLTransport(Transport):
    """`nccl`: rank 0 broadcasts to every worker of every server (vLLM's own NCCL producer; CUDA only)."""

    backend = "nccl"
    group = None

    def init(self, servers: list[Server]) -> None:
        if self.rank != 0:
            return
        from vllm.distributed.weight_transfer.nccl_common import trainer_init
        from vllm.utils.network_utils import get_ip

        timeout = self.timeout_s
        sizes = [int(server.get("/get_world_size", timeout_s=timeout, limit=self.limit)["world_size"])
                 for server in servers]
        infos, offset = [], 1  # the trainer is rank 0 of the group; each server's workers follow in turn
        common = {"master_address": self.settings.master_address or get_ip(), "master_port": self.settings.master_port,
                  "world_size": 1 + sum(sizes), "packed": True}
        for size in sizes:
            infos.append({**common, "rank_offset": offset})
            offset += size
        with ThreadPoolExecutor(max_workers=len(servers)) as pool:  # the servers block in the rendezvous too
            pending = [pool.submit(server.post, "/init_weight_transfer_engine", {"init_info": info}, timeout_s=timeout,
                                   retry=False, limit=self.limit) for server, info in zip(servers, infos, strict=True)]
            self.group = trainer_init({**common, "rank_offset": 1})
            for future in pending:
                future.result()

    def open(self, servers: list[Server]) -> None:
        _each(servers, lambda server: server.post("/start_weight_update", timeout_s=self.timeout_s, retry=False,
                                                  limit=self.limit))

    def label(self, servers: list[Server], version: int) -> None:
        _each(servers, lambda server: server.post("/finish_weight_update", {"weight_version": str(version)},
                                                  timeout_s=self.timeout_s, retry=False, limit=self.limit))

    def send(self, servers: list[Server], weights, version: int) -> None:
        bucket, size = [], 0
        for name, tensor in weights:
            if self.rank != 0:
                continue  # the walk itself is the collective the other ranks take part in
            bucket.append((name, tensor.detach().contiguous()))
            size += tensor.numel() * tensor.element_size()
            if size >= BUCKET_BYTES:
                self._send_bucket(servers, bucket)
                bucket, size = [], 0
        if bucket:
            self._send_bucket(servers, bucket)

    def _send_bucket(self, servers: list[Server], bucket: list) -> None:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        info = {"names": [n for n, _ in bucket], "dtype_names": [dtype_name(t.dtype) for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket]}
        timeout = self.timeout_s
        with ThreadPoolExecutor(max_workers=len(servers)) as pool:  # the workers receive while rank 0 broadcasts
            pending = [pool.submit(server.post, "/update_weights", {"update_info": info}, timeout_s=timeout,
                                   retry=False, limit=self.limit) for server in servers]
            packed_nccl_broadcast_producer(iterator=iter(bucket), group=self.group, src=0,
                                           post_iter_func=lambda item: item[1])
            for future in pending:
                future.result()


TRANSPORTS = {"nccl": NCCLTransport, "disk": DiskTransport}


def transport_unavailable(settings, cuda: bool, installed: bool) -> str | None:
    """One sentence when the trainer cannot send over rollout.vllm_server.weight_transfer here (None when it can)."""
    if settings.weight_transfer == "nccl" and not (cuda and installed):
        return ("rollout.vllm_server.weight_transfer=nccl needs a CUDA GPU and the vllm package on the trainer "
                "(pip install -e \".[vllm]\"); where the servers share a folder with the trainer, set "
                "rollout.vllm_server.weight_transfer=disk and rollout.vllm_server.transfer_dir (docs/many-nodes.md).")
    if settings.weight_transfer == "disk" and not settings.transfer_dir:
        return ("rollout.vllm_server.weight_transfer=disk needs rollout.vllm_server.transfer_dir: a folder the "
                "trainer writes the weights to and every server reads at the same path.")
    return None


def _each(servers: list[Server], call) -> None:
    """`call(server)` on every server at once; the first failure raised."""
    with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
        for future in [pool.submit(call, server) for server in servers]:
            future.result()


STARTED_WITH = {"nccl": " and --weight-transfer-config '{\"backend\": \"nccl\"}'",
                "disk": " and reads rollout.vllm_server.transfer_dir at the trainer's path"}


def check_version(server: Server, version: int, timeout_s: float, limit: str) -> None:
    """The server's weight version after a sync is the sync's number (`/weight_info`), else one sentence."""
    found = server.get("/weight_info", timeout_s=timeout_s, retry=False, limit=limit).get("weight_version")
    if str(found) != str(version):
        raise ServerError(f"the vLLM server at {server.url} reports weight version {found} after the sync that labels "
                          f"version {version}; check that no other trainer syncs it.")


def push_weights(servers: list[Server], transport: Transport, weights, *, version: int, pause_mode: str,
                 collective) -> None:
    """One sync, on every rank (the module's docstring): pause, start, send, finish with `version`, resume; then
    rank 0's outcome, broadcast by `collective((kind, sentence))` (None when it went well), raised on every rank
    (`ServerGone` for a server that stopped answering: the run checkpoints)."""
    failure = None
    timeout, limit = transport.timeout_s, transport.limit
    try:
        if transport.rank == 0:
            _each(servers, lambda server: server.post(f"/pause?mode={pause_mode}", timeout_s=timeout, retry=False,
                                                      limit=limit))
            transport.open(servers)
        transport.send(servers, weights, version)
        if transport.rank == 0:
            transport.label(servers, version)
            _each(servers, lambda server: check_version(server, version, timeout, limit))
            _each(servers, lambda server: server.post("/resume", timeout_s=timeout, retry=False, limit=limit))
    except ServerGone as error:
        failure = ("gone", str(error))
    except ServerError as error:
        failure = ("error", str(error))
    except Exception as error:  # noqa: BLE001 (a refused route, a transport error: one sentence for every rank)
        failure = ("error", f"the weight sync to the vLLM servers failed ({type(error).__name__}: {error}); check "
                   f"that each was started with VLLM_SERVER_DEV_MODE=1{STARTED_WITH[transport.backend]}, as "
                   "docs/many-nodes.md shows.")
    failure = collective(failure)
    if failure:
        kind, sentence = failure
        raise (ServerGone if kind == "gone" else ServerError)(sentence)


def broadcast_from_main(message):
    """Rank 0's message (any picklable value) on every rank (no process group: unchanged), on this thread's
    collective group (the sampler's own under trainer.max_staleness >= 1: gpg_vl/distributed.py)."""
    from gpg_vl.distributed import collective_group

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return message
    box = [message]
    torch.distributed.broadcast_object_list(box, src=0, group=collective_group())
    return box[0]


def require_transport(settings) -> str | None:
    """What the trainer lacks for its weight-transfer backend, in one sentence (None: nothing)."""
    import importlib.util

    return transport_unavailable(settings, torch.cuda.is_available(), importlib.util.find_spec("vllm") is not None)
