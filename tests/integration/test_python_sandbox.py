"""Hostile code in the `python` tool's bwrap sandbox (gpg_vl/rollout/multiturn/sandbox.py): each case ends with an
error observation in its trajectory, the next call of that trajectory still runs (the run goes on), and nothing
outside the sandbox changes (files outside, the parent and a bystander process alive, no connection made, no
process left behind). Small limits keep each case to a second or two."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.sandbox import needs_bwrap
from helpers.tool_context import context

from gpg_vl.rollout.multiturn.tools import run_tool
from gpg_vl.rollout.settings import PythonToolSettings

ROOT = Path(__file__).resolve().parents[2]
LIMITS = {"seconds": 3.0, "cpu_seconds": 1.0, "memory_mb": 384, "file_mb": 1, "disk_mb": 4, "output_chars": 2000,
          "pool": 0}  # pool 0: every interpreter is the trajectory's own, so none is left once it closes
# (rollout.tool_seconds 30: a new interpreter's start, seconds on this shared machine, is not the case under test)

pytestmark = needs_bwrap


def descendants() -> set[int]:
    """The processes under this one (from /proc), the pool's and every sandbox's."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


@pytest.fixture()
def trajectory():
    """A trajectory's tool context with the python tool's small limits; closed (its interpreter killed) after."""
    ctx = context(tool_seconds=30.0, max_turns=4, tools={"python": PythonToolSettings(**LIMITS)})
    before = descendants()
    yield ctx
    ctx.close()
    deadline = time.monotonic() + 10
    while descendants() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not descendants() - before, "a sandbox process outlived its trajectory"


def call(ctx, code: str):
    return run_tool("python", {"code": code}, ctx)


def goes_on(ctx) -> None:
    """The trajectory's next call runs and answers."""
    result = call(ctx, "print(6 * 7)")
    assert not result.error and result.text == "42\n", result.text


def test_a_trajectory_keeps_its_state_sees_its_images_and_gets_what_it_prints_and_shows(trajectory):
    first = call(trajectory, "w, h = image_1.size\nprint(w, h)\ncrop = image_1.crop((0, 0, 40, 20))\ncrop")
    assert not first.error and first.text == "1000 500\n", first.text
    assert [image.size for image in first.images] == [(20, 10)]  # shown, then resized by the family (halved)
    second = call(trajectory, "print(w * h, crop.getpixel((3, 5)))\nimage_1.crop((0, 0, 8, 8)).save('a.png')\n"
                              "show(np.zeros((6, 4, 3), dtype=np.uint8))")
    assert not second.error and second.text == "500000 (3, 5, 0)\n", second.text
    assert sorted(image.size for image in second.images) == [(2, 3), (4, 4)]  # the array shown, the file saved
    typo = call(trajectory, "c = sorted(image_1.getcolor-)))")
    assert typo.error and typo.text.startswith('  File "<cell 3>", line 1') and "SyntaxError" in typo.text
    assert "ast.py" not in typo.text  # the cell's line, not the parser's frames


def test_an_infinite_loop_is_stopped_by_its_cpu_or_time_limit(trajectory):
    result = call(trajectory, "while True:\n    pass")
    assert result.error and ("CPU seconds" in result.text or "ran past 3 s" in result.text), result.text
    goes_on(trajectory)
    sleeper = call(trajectory, "import time\ntime.sleep(600)")
    assert sleeper.error and "ran past 3 s" in sleeper.text and "new interpreter" in sleeper.text
    goes_on(trajectory)


def test_a_fork_bomb_makes_no_process(trajectory):
    before = descendants()
    result = call(trajectory, "import os\nwhile True:\n    os.fork()")
    assert result.error and "PermissionError" in result.text, result.text
    assert len(descendants() - before) <= 3  # bwrap, its pid-namespace init, the interpreter: nothing forked
    spawned = call(trajectory, "import subprocess\nsubprocess.run(['/usr/bin/true'])")
    assert spawned.error and ("PermissionError" in spawned.text or "FileNotFoundError" in spawned.text)
    goes_on(trajectory)


def test_a_memory_bomb_meets_the_address_space_limit(trajectory):
    result = call(trajectory, "x = bytearray(10 ** 10)")
    assert result.error and "MemoryError" in result.text, result.text
    growing = call(trajectory, "blocks = []\nwhile True:\n    blocks.append(bytearray(10 ** 7))")
    assert growing.error and "MemoryError" in growing.text, growing.text
    goes_on(trajectory)


def test_a_gigabyte_print_stops_at_the_output_limit(trajectory):
    result = call(trajectory, "for _ in range(10 ** 6):\n    print('x' * 1000)")
    assert result.error and "printed more than 2000 characters" in result.text
    assert len(result.text) < 2000 + 200
    whole = call(trajectory, "print('x' * 10 ** 9)")  # a 1 GB string does not fit in the address space
    assert whole.error and ("MemoryError" in whole.text or "printed more than" in whole.text)
    goes_on(trajectory)


def test_a_20000_pixel_square_image_is_refused(trajectory):
    result = call(trajectory, "show(Image.new('RGB', (20000, 20000)))")
    assert result.error and "MemoryError" in result.text and not result.images, result.text
    strip = call(trajectory, "show(Image.new('L', (20000, 1000)))")  # 20 MB: fits in memory, not in an observation
    assert strip.error and "20000 x 1000 pixels" in strip.text and not strip.images, strip.text
    goes_on(trajectory)


def test_nothing_outside_its_folder_is_writable(trajectory, tmp_path):
    target = tmp_path / "written.txt"
    stdlib = Path(os.__file__)
    digest = hashlib.sha256(stdlib.read_bytes()).hexdigest()
    for code in (f"open({str(target)!r}, 'w').write('x')", f"open({str(stdlib)!r}, 'a').write('x')",
                 "open('/usr/lib/evil', 'w')", "import os\nos.mkdir('/opt/x')"):
        result = call(trajectory, code)
        assert result.error and ("Read-only file system" in result.text or "No such file" in result.text), result.text
    big = call(trajectory, "open('big', 'wb').write(b'x' * (2 << 20))")  # 2 MB past the 1 MB file-size limit
    assert big.error and "File too large" in big.text, big.text
    assert not target.exists() and hashlib.sha256(stdlib.read_bytes()).hexdigest() == digest
    goes_on(trajectory)


def test_the_projects_files_and_the_machines_secrets_are_unreadable(trajectory, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOKEN-4711")
    for path in (secret, ROOT / "pyproject.toml", Path("/etc/shadow"), Path("/etc/passwd"),
                 Path.home() / ".bashrc", Path(sys.prefix) / "lib"):
        result = call(trajectory, f"print(open({str(path)!r}).read()[:100])")
        assert result.error and ("No such file" in result.text or "IsADirectoryError" in result.text), result.text
        assert "TOKEN-4711" not in result.text and "root:" not in result.text
    listing = call(trajectory, "import os\nprint(sorted(os.listdir('/')))")
    top = set(eval(listing.text))  # what the sandbox's root holds: the bound libraries, interpreter, worker, tmpfs
    assert top <= {"dev", "lib", "lib32", "lib64", "opt", "proc", "root", "tmp", "usr"}, top
    goes_on(trajectory)


def test_no_socket_reaches_the_machine_or_the_network(trajectory):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    try:
        for host in ("127.0.0.1", "10.0.0.1"):
            result = call(trajectory, f"import socket\nsocket.create_connection(({host!r}, {port}), timeout=1)")
            assert result.error and ("unreachable" in result.text or "refused" in result.text), result.text
        with pytest.raises(TimeoutError):
            listener.accept()  # nothing connected
    finally:
        listener.close()
    goes_on(trajectory)


def test_it_cannot_kill_its_parent_or_any_process_outside(trajectory):
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        result = call(trajectory, f"import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
                                  f"os.kill({os.getpid()}, signal.SIGKILL)\nos.kill({bystander.pid}, signal.SIGKILL)")
        assert result.error and "ProcessLookupError" in result.text, result.text
        everyone = call(trajectory, "import os, signal\nos.kill(-1, signal.SIGKILL)")
        assert everyone.error  # it killed only what its namespace holds: itself
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
    goes_on(trajectory)


def test_a_missing_module_is_an_import_error_and_the_hosts_packages_are_not_in_reach(trajectory):
    for module in ("no_such_module_4711", "torch", "gpg_vl"):
        result = call(trajectory, f"import {module}")
        assert result.error and "ModuleNotFoundError" in result.text, result.text
    goes_on(trajectory)


def test_code_that_never_returns_its_image_says_so(trajectory):
    quiet = call(trajectory, "crop = image_1.crop((0, 0, 10, 10))")
    assert quiet.error and "printed nothing and showed no image" in quiet.text
    wrong = call(trajectory, "show('crop.png')")
    assert wrong.error and "show takes PIL images" in wrong.text
    goes_on(trajectory)


@pytest.mark.parametrize(("code", "said"), [("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "killed"),
                                            ("import os\nos._exit(3)", "status 3")])
def test_killing_its_own_process_ends_that_interpreter_and_the_next_call_starts_another(trajectory, code, said):
    assert not call(trajectory, "kept = 1\nkept").error
    result = call(trajectory, code)
    assert result.error and said in result.text and "new interpreter" in result.text, result.text
    after = call(trajectory, "print(kept)")
    assert after.error and "NameError" in after.text  # a new interpreter: the old variables are gone
    goes_on(trajectory)
