"""The settings of the built-in rollout engines and tools, each declared once: `rollout.hf.*` (the HF engine,
rollout/hf.py), `rollout.vllm.*` (the vLLM engine, rollout/vllm/colocated.py), `rollout.vllm_server.*` (the vLLM server
engine, rollout/vllm/server.py), `rollout.tools.zoom_in.*` (the zoom_in tool, rollout/multiturn/tools.py) and
`rollout.tools.python.*` (the python tool, rollout/multiturn/python_tool.py).

An engine or a tool owns its settings: it names its dataclass (`Engine.settings`, `register_tool(...,
settings=)`), and the config takes the section from there: it is typed, range-checked and listed in
docs/configuration.md from this one declaration (gpg_vl/config/names.py lists where each built-in's settings are,
so the config reads them without importing the engine). The built-ins' settings sit here, in a module that
imports nothing heavy, because the config is read and checked before torch loads; an out-of-tree engine or tool
declares its dataclass in its own file, beside its code (docs/extending.md).
"""

from dataclasses import dataclass, field

from gpg_vl.config.keys import meta


@dataclass
class HFEngineSettings:
    """`rollout.hf.*`: the Hugging Face engine (gpg_vl/rollout/hf.py), sampling with the trained model itself."""

    prefill_once: bool = field(default=True, metadata=meta(
        "prefill each prompt once and fork its cache G ways (false = prefill all B x G rows)"))
    static_cache: bool = field(default=False, metadata=meta(
        "preallocate the decoding cache (a cache that cannot be, e.g. one holding linear-attention "
        "recurrent states, stays dynamic); exact, but not measured faster on CPU"))
    reserve_cache: bool = field(default=True, metadata=meta(
        "reserve the dynamic cache's room for the whole completion once (written in place, not copied per "
        "token; exact); static_cache takes precedence"))
    decode: str = field(default="loop", metadata=meta(
        "loop: gpg-vl's own decode loop over the model's forward; generate: transformers' generate",
        choices="decoders"))
    multiturn: str = field(default="incremental", metadata=meta(
        "multi-turn rollouts (rollout.max_turns > 1): incremental prefills each observation onto the trajectory's "
        "cache; naive re-prefills the whole conversation every turn (for comparison)",
        choices=("incremental", "naive")))


@dataclass
class VLLMEngineSettings:
    """`rollout.vllm.*`: the vLLM engine (gpg_vl/rollout/vllm/colocated.py), colocated: one engine in every training
    process."""

    gpu_memory_utilization: float = field(default=0.4, metadata=meta(
        "the share of GPU memory vLLM takes for weights and its KV cache", low=0.01, high=1))
    tensor_parallel_size: int = field(default=1, metadata=meta(
        "processes that shard one engine (within the training processes)", low=1))
    enable_sleep_mode: bool = field(default=True, metadata=meta(
        "free vLLM's memory while the update runs (sleep level 1, woken per rollout)"))
    max_model_len: int | None = field(default=None, metadata=meta(
        "prompt + completion tokens vLLM plans for (null = rollout's max_prompt_tokens + max_new_tokens; with "
        "rollout.max_turns > 1, max_prompt_tokens + max(max_new_tokens, max_total_tokens))", low=1))
    max_images: int = field(default=4, metadata=meta(
        "most images in one prompt (vLLM plans its encoder memory for them; with rollout.max_turns > 1, "
        "rollout.max_images more for the tools' images)", low=1))
    max_videos: int = field(default=1, metadata=meta(
        "most videos in one prompt (vLLM plans its encoder memory for them; none for a family that passes an "
        "engine no video)", low=0))
    enforce_eager: bool = field(default=False, metadata=meta(
        "no CUDA graphs (slower decoding, faster start, less memory)"))
    max_logp_mismatch: float = field(default=0.05, metadata=meta(
        "warn once when a step's mean |vLLM log-prob - trainer log-prob| is above this", low=0))
    tis_cap: float = field(default=0.0, metadata=meta(
        "> 0: token-level truncated importance weight min(p_trainer / p_vllm, cap) multiplies the loss (0 = off)",
        low=0, note="0 = off"))
    seed: int = field(default=0, metadata=meta("vLLM's sampling seed (each process adds its rank)", low=0))


@dataclass
class VLLMServerSettings:
    """`rollout.vllm_server.*`: the vLLM server engine (gpg_vl/rollout/vllm/server.py): stock `vllm serve` endpoints
    on other GPUs or nodes, weights pushed through vLLM's weight-transfer API (docs/many-nodes.md)."""

    urls: str = field(default="http://localhost:8000", metadata=meta(
        "the `vllm serve` endpoints, comma-separated (http://host:port,...); prompts are spread across them",
        nonempty=True))
    timeout_s: float = field(default=300.0, metadata=meta(
        "how long a request (and its retries, while a server is unreachable) may take before the run checkpoints "
        "and stops", above=0))
    sync_timeout_s: float = field(default=600.0, metadata=meta(
        "how long one weight sync may take on every rank before every rank exits", above=0))
    max_concurrency: int = field(default=64, metadata=meta(
        "requests in flight at once, over all servers", low=1))
    weight_transfer: str = field(default="nccl", metadata=meta(
        "how the weights reach the servers: nccl (vLLM's weight-transfer backend, separate GPUs; the servers started "
        "with --weight-transfer-config) or disk (safetensors in a folder every server reads, reloaded in place through "
        "dev mode's /collective_rpc reload_weights; any device)", choices=("nccl", "disk")))
    transfer_dir: str | None = field(default=None, metadata=meta(
        "weight_transfer=disk: the shared folder the weights are written to (the servers read the same path)"))
    master_address: str | None = field(default=None, metadata=meta(
        "weight_transfer=nccl: the trainer's address the servers connect to (null: this host's address)"))
    master_port: int = field(default=29551, metadata=meta(
        "weight_transfer=nccl: the port of that rendezvous", low=1, high=65535))
    max_logp_mismatch: float = field(default=0.05, metadata=meta(
        "warn once when a step's mean |server log-prob - trainer log-prob| is above this", low=0))
    tis_cap: float = field(default=0.0, metadata=meta(
        "> 0: token-level truncated importance weight min(p_trainer / p_server, cap) multiplies the loss (0 = off)",
        low=0, note="0 = off"))
    seed: int = field(default=0, metadata=meta(
        "the servers' sampling seed, varied per request and sync (0 = unseeded: the servers' own randomness)", low=0))



@dataclass
class ZoomInSettings:
    """`rollout.tools.zoom_in.*`: DeepEyes' crop tool (gpg_vl/rollout/multiturn/tools.py)."""

    min_side: int = field(default=30, metadata=meta(
        "zoom_in refuses a box whose short side, in original pixels, is at most this (DeepEyes: 30)", low=0))
    max_aspect_ratio: float = field(default=100.0, metadata=meta(
        "zoom_in refuses a box more elongated than this (DeepEyes: 100)", above=0))


@dataclass
class PythonToolSettings:
    """`rollout.tools.python.*`: the `python` tool (gpg_vl/rollout/multiturn/python_tool.py), the model's code run in
    a sandboxed interpreter per trajectory (gpg_vl/rollout/multiturn/sandbox.py)."""

    sandbox: str = field(default="bwrap", metadata=meta(
        "bwrap: bubblewrap namespaces, a read-only file system of what the interpreter needs, no network, no new "
        "process (seccomp); unsandboxed: a plain child process with this user's files and network (trusted code only)",
        choices=("bwrap", "unsandboxed")))
    seconds: float = field(default=5.0, metadata=meta(
        "wall-clock budget of one call: past it the interpreter is killed (below rollout.tool_seconds, which also "
        "covers encoding the observation)", above=0))
    cpu_seconds: float = field(default=5.0, metadata=meta(
        "CPU seconds one call may use (RLIMIT_CPU, moved per call)", above=0))
    memory_mb: int = field(default=1024, metadata=meta(
        "address space of the interpreter, MiB (RLIMIT_AS; imports included)", low=64))
    file_mb: int = field(default=16, metadata=meta("largest file the code may write, MiB (RLIMIT_FSIZE)", low=0))
    disk_mb: int = field(default=64, metadata=meta(
        "size of its one writable folder, MiB (bwrap: an in-memory tmpfs at /tmp)", low=1))
    open_files: int = field(default=64, metadata=meta("file descriptors it may hold (RLIMIT_NOFILE)", low=16))
    output_chars: int = field(default=4000, metadata=meta(
        "characters of printed output a call may return; past them the code is stopped", low=1))
    max_image_pixels: int = field(default=2048 * 2048, metadata=meta(
        "pixels of one image the code shows (a larger one is an error: resize it first)", low=1))
    max_images: int = field(default=4, metadata=meta("images one call returns (the first ones shown)", low=0))
    pool: int = field(default=4, metadata=meta(
        "interpreters kept started and ready (0: each trajectory's first call starts one)", low=0))
    packages: str = field(default="PIL,numpy", metadata=meta(
        "the packages the code may import besides the standard library, comma-separated (bound read-only)"))
