"""The interpreter that runs one trajectory's code, inside its sandbox (started by gpg_vl/rollout/multiturn/sandbox.py).

Standalone on purpose: it imports the standard library and the packages the sandbox lets in (Pillow, numpy), never
gpg_vl (the project's files are not in the sandbox; this one file is bound into it read-only).

    python -I -S sandbox_worker.py '{"memory_mb": 1024, ...}'

At start it sets its own limits (hard = soft, so the code cannot raise them: address space, file size, open files,
no core dumps, CPU seconds), moves the protocol to private descriptors (the code's stdin, stdout and stderr are
/dev/null), imports the preloaded modules and answers `{"op": "ready"}`. Then, per request `{"op": "run", "code",
"cpu_seconds", "images"}` (the trajectory's images, sent with the first request only), it runs the code as a
notebook cell in one namespace kept across requests (`image_1`, `image_2`, ... the trajectory's images as PIL
images, `images` their list, `show`, `Image`, `np`), and answers `{"output", "error", "images"}` with the raw RGB
bytes of every image the code showed (`show(image)`, `image.show()`, a cell's last expression) or saved in its
folder.

Frames, both ways: a 4-byte big-endian length, that many bytes of JSON, then the binary blobs the JSON's `blobs`
lists by length (raw RGB pixels). The parent trusts nothing it reads here (sandbox.py checks every frame).
"""

from __future__ import annotations

import ast
import io
import json
import linecache
import os
import resource
import signal
import struct
import sys
import traceback

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
HEADER = struct.Struct(">I")


class CpuLimit(BaseException):
    """Raised in the code by SIGXCPU: the call's CPU seconds are spent (BaseException: `except Exception` in the code
    does not swallow it)."""


class OutputLimit(BaseException):
    """Raised in the code once it has printed more than the sandbox's `output_chars`."""


class Capped(io.TextIOBase):
    """stdout and stderr of a cell: kept up to `limit` characters; past it the writing code gets OutputLimit."""

    def __init__(self, limit: int) -> None:
        self.limit, self.parts, self.size = limit, [], 0

    def writable(self) -> bool:
        return True

    def write(self, text) -> int:
        text = str(text)
        room = self.limit - self.size
        if len(text) > room:
            self.parts.append(text[:max(room, 0)])
            self.size = self.limit
            raise OutputLimit(f"the code printed more than {self.limit} characters; the rest was dropped")
        self.parts.append(text)
        self.size += len(text)
        return len(text)

    def value(self) -> str:
        return "".join(self.parts)


def read_exact(fd: int, count: int) -> bytes:
    chunks, left = [], count
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive(fd: int) -> tuple[dict, list[bytes]]:
    (length,) = HEADER.unpack(read_exact(fd, HEADER.size))
    header = json.loads(read_exact(fd, length))
    return header, [read_exact(fd, size) for size in header.get("blobs", [])]


def send(fd: int, header: dict, blobs: list[bytes] = ()) -> None:
    data = json.dumps({**header, "blobs": [len(blob) for blob in blobs]}).encode()
    for part in (HEADER.pack(len(data)), data, *blobs):
        view = memoryview(part)
        while view:
            view = view[os.write(fd, view):]


def set_limits(config: dict) -> None:
    """This process's limits, hard = soft (what the code cannot raise); CPU: the whole sandbox's seconds as hard,
    each call's as soft (`run` moves the soft limit)."""
    mb = 1 << 20
    for name, value in ((resource.RLIMIT_AS, config["memory_mb"] * mb), (resource.RLIMIT_FSIZE, config["file_mb"] * mb),
                        (resource.RLIMIT_NOFILE, config["open_files"]), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(name, (value, value))
    total = int(config["cpu_total_seconds"])
    resource.setrlimit(resource.RLIMIT_CPU, (total, total))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the file-size limit fails (EFBIG), never kills


def on_cpu_limit(signum, frame):
    raise CpuLimit("the code used up its CPU seconds and was stopped")


class Cell:
    """The namespace kept across a trajectory's calls and what one call showed."""

    def __init__(self, config: dict) -> None:
        self.config = config
        self.shown: list = []
        self.count = 0
        from PIL import Image

        self.Image = Image
        Image.Image.show = lambda image, *args, **kwargs: self.show(image)
        self.namespace = {"__name__": "__main__", "__builtins__": __builtins__, "show": self.show, "Image": Image}
        try:
            import numpy

            self.namespace["np"] = numpy
        except ImportError:
            pass

    def show(self, *images) -> None:
        """Return these images to the model (PIL images or numpy arrays)."""
        for image in images:
            if not isinstance(image, self.Image.Image):
                if type(image).__module__ != "numpy" or not hasattr(image, "shape"):
                    raise TypeError(f"show takes PIL images or numpy arrays, not {type(image).__name__}")
                image = self.Image.fromarray(image)
            width, height = image.size
            if width * height > self.config["max_image_pixels"]:
                raise ValueError(f"the image is {width} x {height} pixels, more than the "
                                 f"{self.config['max_image_pixels']} an observation may hold; resize it first")
            if width < 1 or height < 1:
                raise ValueError(f"the image is {width} x {height} pixels: nothing to show")
            self.shown.append(image.convert("RGB"))

    def give_images(self, images: list[dict], blobs: list[bytes]) -> None:
        pictures = [self.Image.frombytes("RGB", tuple(item["size"]), blob)
                    for item, blob in zip(images, blobs, strict=True)]
        self.namespace["images"] = pictures
        for k, picture in enumerate(pictures):
            self.namespace[f"image_{k + 1}"] = picture

    def run(self, code: str, cpu_seconds: float) -> dict:
        """Run `code` as a notebook cell: its output, an error sentence or traceback, the images it showed."""
        self.shown, self.count = [], self.count + 1
        capture = Capped(self.config["output_chars"])
        name = f"<cell {self.count}>"
        linecache.cache[name] = (len(code), None, code.splitlines(keepends=True), name)
        before = folder_state()
        used = resource.getrusage(resource.RUSAGE_SELF)
        soft = int(used.ru_utime + used.ru_stime + cpu_seconds) + 1
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        resource.setrlimit(resource.RLIMIT_CPU, (min(soft, hard), hard))
        error = None
        sys.stdout = sys.stderr = capture
        try:
            tree = ast.parse(code, name)
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            exec(compile(tree, name, "exec"), self.namespace)
            if last is not None:
                value = eval(compile(ast.Expression(last.value), name, "eval"), self.namespace)
                if isinstance(value, self.Image.Image):
                    self.show(value)
                elif value is not None:
                    print(repr(value))
        except (CpuLimit, OutputLimit) as stop:
            error = f"Error: {stop}."
        except SyntaxError as failure:  # the parser's frames say nothing about the cell
            error = "".join(traceback.format_exception_only(type(failure), failure)).rstrip()
        except SystemExit as stop:
            error = f"Error: the code called exit({stop.code!r}); the interpreter goes on."
        except BaseException as failure:  # noqa: BLE001  the code's own exception is its observation
            error = "".join(traceback.format_exception(type(failure), failure, _user_frames(failure.__traceback__),
                                                       limit=-6)).rstrip()
        finally:
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
            resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))  # no SIGXCPU while the answer is written
        try:
            self.collect_saved(before)
        except BaseException as failure:  # noqa: BLE001
            error = error or f"Error: a saved image could not be read ({type(failure).__name__}: {failure})."
        shown = self.shown[:self.config["max_images"]]
        note = ""
        if len(self.shown) > len(shown):
            note = f"\n(only the first {len(shown)} of the {len(self.shown)} images shown are returned)"
        self.shown = []
        return {"output": capture.value() + note, "error": error, "images": shown}

    def collect_saved(self, before: dict) -> None:
        """Images the cell wrote in its folder (new or changed files with an image suffix), oldest first."""
        after = folder_state()
        changed = sorted((stamp, path) for path, stamp in after.items()
                         if before.get(path) != stamp and path.lower().endswith(IMAGE_SUFFIXES))
        for _, path in changed:
            with self.Image.open(path) as image:
                image.load()
                self.show(image)


def _user_frames(trace):
    """The traceback from the cell's own first frame on (this file's frames dropped)."""
    while trace is not None and trace.tb_frame.f_code.co_filename == __file__:
        trace = trace.tb_next
    return trace


def folder_state(limit: int = 2000) -> dict[str, tuple[int, int]]:
    """path -> (mtime_ns, size) of the files under the working folder (at most `limit`)."""
    state = {}
    for root, _, files in os.walk("."):
        for file in files:
            path = os.path.join(root, file)
            try:
                info = os.stat(path)
            except OSError:
                continue
            state[path] = (info.st_mtime_ns, info.st_size)
            if len(state) >= limit:
                return state
    return state


def main() -> None:
    config = json.loads(sys.argv[1])
    sys.path[:0] = config.get("path", [])
    inp, out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    set_limits(config)
    signal.signal(signal.SIGXCPU, on_cpu_limit)
    for module in config.get("preload", []):
        __import__(module)
    cell = Cell(config)
    me = os.getpid()
    send(out, {"op": "ready"})
    while True:
        try:
            request, blobs = receive(inp)
        except EOFError:
            return
        if request.get("images"):
            cell.give_images(request["images"], blobs)
        try:
            reply = cell.run(request["code"], float(request["cpu_seconds"]))
        finally:
            if os.getpid() != me:  # a child the code forked (unsandboxed) never speaks for the cell
                os._exit(0)
        images = reply.pop("images")
        send(out, {**reply, "images": [{"size": list(image.size)} for image in images]},
             [image.tobytes() for image in images])


if __name__ == "__main__":
    main()
