"""Pushing the trainer's weights into `vllm serve` endpoints through vLLM's weight-transfer API.

One sync, on EVERY trainer rank (DDP, FSDP2, ZeRO-3 alike), under `rollout.vllm_server.sync_timeout_s`:

1. rank 0 pauses generation on every server (`POST /pause?mode=...`) and starts the update
   (`/start_weight_update`);
2. every rank walks the weights (`models/weights.py`: gathered one tensor at a time, which is a collective
   under FSDP2 / ZeRO-3, LoRA merged, checkpoint names); only rank 0 sends them, over the backend the servers
   were started with (`--weight-transfer-config '{"backend": ...}'`):
   - `nccl` (separate GPUs): rank 0 joins one NCCL group with every worker of every server (`init_info`:
     master address and port, world size, each server's rank offset, packed) once, at start; each sync sends
     buckets of tensors: `/update_weights` with their names, dtypes and shapes while rank 0 broadcasts them
     (vLLM's `packed_nccl_broadcast_producer`). Needs CUDA and the vllm package on the trainer's rank 0;
   - `disk`: rank 0 writes the weights as safetensors into a folder every server reads
     (`rollout.vllm_server.transfer_dir`), then `/update_weights` with its `path`. Works on CPU (the tests'
     path);
3. rank 0 finishes the update with the new weight version (`/finish_weight_update`: the label vLLM writes on
   every output token sampled after it) and resumes generation (`/resume`);
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

from gpg_vl.rollout.vllm.client import Server, ServerError, ServerGone

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
    """How the weights travel (rollout.vllm_server.weight_transfer); `init_info` is sent once per server at start,
    `send` runs on every rank for each sync (only rank 0 sends)."""

    backend = "none"

    def __init__(self, settings, *, rank: int) -> None:
        self.settings, self.rank = settings, rank
        self.timeout_s = CALL_SHARE * settings.sync_timeout_s  # each request of a sync

    def init(self, servers: list[Server]) -> None:
        raise NotImplementedError

    def send(self, servers: list[Server], weights, version: int) -> None:
        raise NotImplementedError


class DiskTransport(Transport):
    """`disk`: safetensors in a shared folder, one folder per version (the previous one removed after)."""

    backend = "disk"

    @property
    def folder(self) -> Path:
        return Path(self.settings.transfer_dir).resolve()

    def init(self, servers: list[Server]) -> None:
        if self.rank == 0:
            for server in servers:
                server.post("/init_weight_transfer_engine", {"init_info": {}}, timeout_s=self.timeout_s)

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
        _each(servers, lambda server: server.post("/update_weights", {"update_info": {"path": str(target)}},
                                                  timeout_s=self.timeout_s, retry=False))
        for old in self.folder.glob("v*"):
            if old != target and old.name.removeprefix("v").isdigit():
                shutil.rmtree(old, ignore_errors=True)


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
        sizes = [int(server.get("/get_world_size", timeout_s=timeout)["world_size"]) for server in servers]
        infos, offset = [], 1  # the trainer is rank 0 of the group; each server's workers follow in turn
        common = {"master_address": self.settings.master_address or get_ip(), "master_port": self.settings.master_port,
                  "world_size": 1 + sum(sizes), "packed": True}
        for size in sizes:
            infos.append({**common, "rank_offset": offset})
            offset += size
        with ThreadPoolExecutor(max_workers=len(servers)) as pool:  # the servers block in the rendezvous too
            pending = [pool.submit(server.post, "/init_weight_transfer_engine", {"init_info": info}, timeout_s=timeout,
                                   retry=False) for server, info in zip(servers, infos, strict=True)]
            self.group = trainer_init({**common, "rank_offset": 1})
            for future in pending:
                future.result()

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
                                   retry=False) for server in servers]
            packed_nccl_broadcast_producer(iterator=iter(bucket), group=self.group, src=0,
                                           post_iter_func=lambda item: item[1])
            for future in pending:
                future.result()


TRANSPORTS = {"nccl": NCCLTransport, "disk": DiskTransport}


def transport_unavailable(settings, cuda: bool, installed: bool) -> str | None:
    """One sentence when the trainer cannot send over rollout.vllm_server.weight_transfer here (None when it can)."""
    if settings.weight_transfer == "nccl" and not (cuda and installed):
        return ("rollout.vllm_server.weight_transfer=nccl needs a CUDA GPU and the vllm package on the trainer "
                "(pip install -e \".[vllm]\"); where the servers share a folder with the trainer, start them with "
                "--weight-transfer-config '{\"backend\": \"disk\"}' and set rollout.vllm_server.weight_transfer=disk.")
    if settings.weight_transfer == "disk" and not settings.transfer_dir:
        return ("rollout.vllm_server.weight_transfer=disk needs rollout.vllm_server.transfer_dir: a folder the "
                "trainer writes the weights to and every server reads at the same path.")
    return None


def _each(servers: list[Server], call) -> None:
    """`call(server)` on every server at once; the first failure raised."""
    with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
        for future in [pool.submit(call, server) for server in servers]:
            future.result()


def push_weights(servers: list[Server], transport: Transport, weights, *, version: int, pause_mode: str,
                 collective) -> None:
    """One sync, on every rank (the module's docstring): pause, start, send, finish with `version`, resume; then
    rank 0's outcome, broadcast by `collective((kind, sentence))` (None when it went well), raised on every rank
    (`ServerGone` for a server that stopped answering: the run checkpoints)."""
    failure = None
    timeout = transport.timeout_s
    try:
        if transport.rank == 0:
            _each(servers, lambda server: server.post(f"/pause?mode={pause_mode}", timeout_s=timeout, retry=False))
            _each(servers, lambda server: server.post("/start_weight_update", timeout_s=timeout, retry=False))
        transport.send(servers, weights, version)
        if transport.rank == 0:
            _each(servers, lambda server: server.post("/finish_weight_update", {"weight_version": str(version)},
                                                      timeout_s=timeout, retry=False))
            _each(servers, lambda server: server.post("/resume", timeout_s=timeout, retry=False))
    except ServerGone as error:
        failure = ("gone", str(error))
    except ServerError as error:
        failure = ("error", str(error))
    except Exception as error:  # noqa: BLE001 (a refused route, a transport error: one sentence for every rank)
        failure = ("error", f"the weight sync to the vLLM servers failed ({type(error).__name__}: {error}); check "
                   "that each was started with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config '{\"backend\": "
                   f"\"{transport.backend}\"}}', as docs/many-nodes.md shows.")
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
