"""What several processes need beyond accelerate: the rules that keep their collectives in step.

Under DDP and DeepSpeed ZeRO-1/2 only the gradient all-reduce is collective. Under FSDP and ZeRO-3 every
forward is collective too: each wrapped module all-gathers its parameters when it runs, so every process
must call the same modules, in the same order, the same number of times (a process that skips the
vision tower while another runs it deadlocks both). The trainer keeps to that rule by

* giving every process the same number of forward/backward calls in an update (`placeholder_chunk` in
  gpg_vl/train/step/placeholder.py fills the ones a process has no data for, with a real sequence holding an
  image, weighted zero);
* requiring an image in every prompt batch and micro-batch when there are several processes
  (`require_images`), so that every forward runs the vision tower;
* making every process call `generate` for every attempt and evaluation batch, even with no prompt of
  its own (`placeholder_prompts`, ibid.), with `synced_gpus` so that their decoding steps stay in step too;
* encoding images inside the wrapped forward in the update (models/scoring.py's
  `encode_shared_vision_in_forward`), and with the FSDP root's parameters gathered during generation
  (`gathered_for_generation`), since transformers encodes a prompt's images before its first forward.

With trainer.max_staleness >= 1 the sampling stage runs on a thread beside the learner (train/step/pipeline.py), and
its collectives (AGE's counts, the server engine's sync outcome) would interleave with the learner's gradient
all-reduce on the default process group. The sampler thread runs them on a process group of its own (`collectives_on`;
gloo, so that two NCCL communicators never run at once on one GPU): the code that issues them asks
`collective_group()` for it.
"""

from __future__ import annotations

import contextlib
import re
import threading

import torch

from gpg_vl.errors import UserError

_THREAD = threading.local()


@contextlib.contextmanager
def collectives_on(group):
    """Within it, this thread's sampling-stage collectives run on `group` (None: the default group)."""
    before = getattr(_THREAD, "group", None)
    _THREAD.group = group
    try:
        yield
    finally:
        _THREAD.group = before


def collective_group():
    """The process group this thread's sampling-stage collectives run on (None: the default one)."""
    return getattr(_THREAD, "group", None)


def forward_is_collective(model: torch.nn.Module) -> bool:
    """True under FSDP or DeepSpeed ZeRO-3 with several processes (transformers' own `synced_gpus` test)."""
    from torch.distributed.fsdp import FSDPModule
    from transformers.integrations import is_deepspeed_zero3_enabled
    from transformers.integrations.fsdp import is_fsdp_managed_module

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    # transformers recognises FSDP1 and its own FSDP2, not accelerate's FSDP2 modules: test those too
    sharded = is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model) or isinstance(model, FSDPModule)
    return torch.distributed.get_world_size() > 1 and sharded


def require_images(has_images: bool, num_processes: int, what: str) -> None:
    """Several processes need an image in every prompt batch and micro-batch (see the module doc)."""
    if num_processes > 1 and not has_images:
        raise UserError(f"{what} holds no image, and training on {num_processes} processes needs one in each "
                        "(every process must run the vision tower: DDP reduces its gradients, FSDP and ZeRO-3 "
                        "gather its weights); give every training row an image, or train on one process.")


@contextlib.contextmanager
def gathered_for_generation(model: torch.nn.Module):
    """During `generate` under FSDP2, hold the root module's own parameters (embeddings, the vision tower's
    patch embedding and merger, the head) gathered: transformers encodes images before the first forward,
    outside the root's forward pre-hook that would otherwise gather them. A no-op for other engines
    (ZeRO-3 gathers per module wherever it is called; DDP and ZeRO-1/2 hold full weights)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield
        return
    # The first FSDP module to run becomes FSDP's root; make it the model itself, not the vision tower's
    # first block (which runs first when generation starts with images, before any training forward).
    model._get_fsdp_state()._lazy_init()
    model.unshard()  # collective (all-gather): every process calls generate the same number of times
    try:
        yield
    finally:
        model.reshard()


# DeepSpeed's zero_optimization keys -> the accelerate config file's keys that set them
DEEPSPEED_FILE_KEYS = {"stage": "zero_stage", "offload_optimizer.device": "offload_optimizer_device",
                       "offload_param.device": "offload_param_device"}


# how gloo and NCCL say that another process of the group is gone (killed, crashed, its machine lost) or stopped
# answering within the process group's timeout (torch's default: 30 minutes for gloo, 10 for NCCL)
LOST_PEER = re.compile(r"Connection closed by peer|Connection reset by peer|remote worker crashing|Broken pipe|"
                       r"Timed out waiting|communicator was aborted|Socket Timeout", re.IGNORECASE)


def lost_peer(error: BaseException) -> str | None:
    """What a failed collective says, in its first sentence, when another trainer process is gone (gloo's
    "Connection closed by peer", a wait past the timeout, NCCL's aborted communicator); None for any other error."""
    errors = tuple(getattr(torch.distributed, name) for name in ("DistError",) if hasattr(torch.distributed, name))
    if not (isinstance(error, errors) or (isinstance(error, RuntimeError) and LOST_PEER.search(str(error)))):
        return None
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    first = re.sub(r"^\[[^\]]*\]\s*", "", first)  # gloo names its source file first
    return first.split(". ")[0].rstrip(".")


def _once(expected: str) -> str:
    """pydantic's list of an enum's values ("0, 1, 2, 3 or 3") with each value once ("0, 1, 2 or 3")."""
    values = list(dict.fromkeys(part.strip() for part in re.split(r",| or ", expected) if part.strip()))
    return ", ".join(values[:-1]) + " or " + values[-1] if len(values) > 1 else "".join(values)


def check_deepspeed_config(config: dict) -> None:
    """DeepSpeed's own check of the config's zero_optimization section (its pydantic model), run when the
    Accelerator is made: a bad value (zero_stage: 7) fails in one sentence on every process, before the model
    loads, instead of a ValidationError inside accelerator.prepare."""
    import pydantic
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    try:
        DeepSpeedZeroConfig(**config.get("zero_optimization", {}))
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        if first["type"] == "enum":  # pydantic lists an enum's aliases again (stage: "0, 1, 2, 3 or 3")
            first["msg"] = f"input should be {_once(first['ctx']['expected'])}"
        key = ".".join(str(part) for part in first["loc"])
        where = f" ({DEEPSPEED_FILE_KEYS[key]} in the accelerate config file)" if key in DEEPSPEED_FILE_KEYS else ""
        raise UserError(f"the DeepSpeed config has zero_optimization.{key}={first.get('input')!r}{where}, which "
                        f"DeepSpeed refuses: {first['msg'][0].lower()}{first['msg'][1:].rstrip('.')}; fix it in the "
                        "file given to `accelerate launch --config_file` (configs/accelerate/zero2.yaml and "
                        "zero3.yaml are valid).") from None
