"""The math check of `math_reward`: math_verify's verdict on two answer texts, computed in a child Python process
that is killed when it overruns (`_math_check`). The child loads this file by path: it imports the standard library
only."""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time

# Exact integers math_verify may build (sympy evaluates 9^{9^9} exactly) are capped at this many digits, so
# that the check does not spend its whole time budget (and memory) on one giant big-int operation.
_MAX_DIGITS = 100_000


# The math check runs in a child Python process (see `_MathProcess`), which loads this file by path (not the
# package, which imports torch) and answers one JSON request [gold, pred] per line with '1' or '0'.
_CHILD_SOURCE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("gpg_vl_rewards_child", sys.argv[1])
rewards = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rewards)
rewards._math_equal("1/2", "0.5")  # warm up: the first parse and verify load more
sys.stdout.write("ready\\n")
sys.stdout.flush()
for line in iter(sys.stdin.buffer.readline, b""):
    try:
        ok = rewards._math_equal(*json.loads(line))
    except Exception:
        ok = False
    sys.stdout.write("1\\n" if ok else "0\\n")
    sys.stdout.flush()
"""


class _MathProcess:
    """A child Python process that answers `_math_equal` for one caller at a time; killed when it overruns.

    Why a process: math_verify's own timeouts use signal.alarm (main thread only, whole seconds, restarted for
    each parse and comparison), and sympy cannot be stopped safely from another thread (an exception raised
    into it can land inside the import machinery and deadlock the process). Killing a process is always safe.
    """

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD_SOURCE, __file__],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,  # math_verify logs there
        )
        self._lines: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._ready = False
        self.usable = True
        try:
            threading.Thread(target=self._read, name="gpg_vl math reader", daemon=True).start()
        except RuntimeError:
            self.kill()
            raise

    def _read(self) -> None:
        # A thread, not select(): portable, and a line read here can never be split across two answers.
        for line in iter(self._proc.stdout.readline, b""):
            self._lines.put(line)
        self._lines.put(b"")  # end of file: the child is gone
        self._proc.stdout.close()
        self._proc.wait()  # reap it

    def _next_line(self, deadline: float) -> bytes | None:
        try:
            return self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None

    def ask(self, gold: str, pred: str, deadline: float) -> bool | None:
        """`_math_equal(gold, pred)`, or None if there was no answer before `deadline` (time.monotonic())."""
        try:
            if not self._ready:  # the first request waits for startup (imports take about a second)
                line = self._next_line(deadline)
                if line is None:
                    return None  # still starting: no request was sent, so it stays usable
                if line != b"ready\n":
                    self.kill()
                    return None
                self._ready = True
            self._proc.stdin.write(json.dumps([gold, pred]).encode() + b"\n")
            self._proc.stdin.flush()
            line = self._next_line(deadline)
            if line not in (b"1\n", b"0\n"):  # overran (or died): its answer would reach the next caller
                self.kill()
                return None
            return line == b"1\n"
        except (OSError, ValueError):  # broken pipe: the child died
            self.kill()
            return None

    def alive(self) -> bool:
        return self.usable and self._proc.poll() is None

    def kill(self) -> None:
        self.usable = False
        self._proc.kill()  # the reader thread reaps it
        with contextlib.suppress(OSError):
            self._proc.stdin.close()


_IDLE_PROCESSES: list[_MathProcess] = []  # started children waiting for work, one taken per concurrent call


_IDLE_LOCK = threading.Lock()


def _forget_processes_after_fork() -> None:
    # A forked copy (e.g. a DataLoader worker) must not talk to its parent's children (their reader threads did
    # not survive the fork) nor wait on a lock another thread held at fork time: it starts its own.
    global _IDLE_LOCK
    _IDLE_LOCK = threading.Lock()
    _IDLE_PROCESSES.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_processes_after_fork)


def _math_check(gold: str, pred: str, seconds: float) -> bool | None:
    """`_math_equal(gold, pred)` in a child process, or None if it took over `seconds` (it is then killed)."""
    deadline = time.monotonic() + seconds
    with _IDLE_LOCK:
        process = _IDLE_PROCESSES.pop() if _IDLE_PROCESSES else None
    if process is not None and not process.alive():  # died while idle (e.g. killed by the OOM killer)
        process = None
    try:
        process = process or _MathProcess()
    except (OSError, ValueError, RuntimeError):  # no interpreter or no thread could be started
        return None
    result = process.ask(gold, pred, deadline)
    if not process.usable:  # killed: start its replacement now, so the next call need not wait for startup
        try:
            process = _MathProcess()
        except (OSError, ValueError, RuntimeError):
            return result
    with _IDLE_LOCK:
        _IDLE_PROCESSES.append(process)
    return result


def _log10_bound(node: object) -> float:
    """Upper bound on log10 |value| of a parsed math_verify result (digits of any exact integer sympy may build
    from it); inf once over `_MAX_DIGITS`. Unknown functions are bounded like factorials, containers by their
    largest element, symbols as 0."""
    from sympy import Basic, Function, MatrixBase
    from sympy.concrete.expr_with_limits import ExprWithLimits

    if isinstance(node, MatrixBase):
        bound = max((_log10_bound(entry) for entry in node), default=0.0)
    elif not isinstance(node, Basic):  # math_verify's string fallback
        bound = 0.0
    elif node.is_Rational:
        bound = math.log10(max(abs(node.p), node.q))
    elif node.is_Float:
        bound = math.log10(abs(float(node)) + 1.0)
    elif not node.args:  # symbols, pi, I, oo
        bound = 0.0
    else:
        args = [_log10_bound(arg) for arg in node.args]
        if node.is_Add:
            bound = max(args) + math.log10(len(args))
        elif node.is_Mul:
            bound = sum(args)
        elif node.is_Pow:  # b^e has about log10|b| * |e| digits
            bound = args[0] * 10.0 ** args[1] if args[1] <= 300 else math.inf
        elif isinstance(node, (Function, ExprWithLimits)):  # n! has about n log10 n digits
            bound = 10.0 ** max(args) * max(1.0, max(args)) if max(args) <= 300 else math.inf
        else:  # sets, tuples, relations, intervals
            bound = max(args)
    return bound if bound <= _MAX_DIGITS else math.inf


def _math_equal(gold: str, pred: str) -> bool:
    """math_verify's verdict on two answer texts (run in the child process: it can take any time)."""
    from math_verify import parse, verify

    # math_verify's own timeouts are off (None): they need SIGALRM; the parent kills an overrunning child instead.
    # Wrapping in `$` makes its LaTeX extractor read the whole answer ('2^{10}' would otherwise parse as 2).
    parsed = [parse(s if "$" in s else f"${s}$", parsing_timeout=None) for s in (gold, pred)]
    if any(math.isinf(_log10_bound(item)) for side in parsed for item in side):
        return False
    return verify(parsed[0], parsed[1], timeout_seconds=None)
