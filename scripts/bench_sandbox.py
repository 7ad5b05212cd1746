"""What the python tool's sandbox costs: seconds per call and per trajectory, bwrap against unsandboxed, with and
without the warm pool, measured side by side in one process (alternating, median of the repeats).

    python scripts/bench_sandbox.py                  # --repeats 20 --image 448 --packages PIL,numpy

- call: one cell on a warm interpreter (the measure task's code: the image's colours sorted by count, one printed;
  then a crop shown), the request sent and the answer read and checked;
- trajectory: a trajectory's whole life: an interpreter taken (from a filled pool, or started: pool 0), the image
  sent with the first cell, two cells, the interpreter killed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from PIL import Image

from gpg_vl.rollout.multiturn.sandbox import SandboxPool, SandboxSpec, Session

CELLS = ("c = sorted(image_1.getcolors(1 << 20))\nprint(c[-2][1])", "show(image_1.crop((0, 0, 112, 112)))")


def image(size: int) -> Image.Image:
    from gpg_vl_tasks.measure import make_row

    return make_row(0, 0, image_size=size)["image"]


def one_trajectory(pool: SandboxPool, picture, filled: bool) -> tuple[float, float]:
    """(seconds of the whole trajectory, seconds of its second cell: a call on a warm interpreter)."""
    if filled:
        pool.wait_filled()
    started = time.perf_counter()
    session = Session(pool, [picture])
    outcome = session.run(CELLS[0], seconds=30, cpu_seconds=30)
    assert not outcome.error, outcome.text
    second = time.perf_counter()
    outcome = session.run(CELLS[1], seconds=30, cpu_seconds=30)
    assert not outcome.error and outcome.images, outcome.text
    call = time.perf_counter() - second
    session.close()
    return time.perf_counter() - started, call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--image", type=int, default=448, help="the image's side in pixels (sent to each trajectory)")
    parser.add_argument("--packages", default="PIL,numpy")
    parser.add_argument("--pool", type=int, default=2, help="the warm pool's size in the pooled arms")
    args = parser.parse_args()
    picture = image(args.image)
    packages = tuple(args.packages.split(","))
    arms = {(kind, pooled): SandboxPool(SandboxSpec(sandbox=kind, packages=packages), args.pool if pooled else 0)
            for kind in ("bwrap", "unsandboxed") for pooled in (True, False)}
    for pool in arms.values():
        if pool.size:
            pool.wait_filled()
    seconds = {arm: {"trajectory": [], "call": []} for arm in arms}
    for _ in range(args.repeats):  # the arms alternate, so a change in the machine's load falls on all of them
        for arm, pool in arms.items():
            whole, call = one_trajectory(pool, picture, filled=arm[1])
            seconds[arm]["trajectory"].append(whole)
            seconds[arm]["call"].append(call)
    for pool in arms.values():
        pool.close()
    load = os.getloadavg()
    print(f"{args.repeats} repeats, a {args.image} px image, packages {args.packages}, pool {args.pool}; load average "
          f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f} (median seconds; ratio: against unsandboxed with the pool)\n")
    base = seconds[("unsandboxed", True)]
    print("| sandbox | pool | per call (warm) | per trajectory (2 cells) | trajectory ratio |")
    print("|---|---|---|---|---|")
    rows = {}
    for (kind, pooled), measured in seconds.items():
        call, whole = statistics.median(measured["call"]), statistics.median(measured["trajectory"])
        ratio = whole / statistics.median(base["trajectory"])
        rows[f"{kind}/{'pool' if pooled else 'cold'}"] = {"call_s": call, "trajectory_s": whole}
        print(f"| {kind} | {args.pool if pooled else 0} | {call:.4f} s | {whole:.4f} s | {ratio:.2f}x |")
    print("\n" + json.dumps(rows))


if __name__ == "__main__":
    main()
