"""Write a training run's rollout viewer: one static page, OUTPUT_DIR/rollouts.html (no server, no network).

    python scripts/view.py outputs/shapes/20260101-120000    # then open .../rollouts.html in a browser

The run must have logged rollouts (trainer.log_rollouts_every=N, on by default every 10 steps and at step 1).
"""

import argparse
import sys

from gpg_vl.errors import UserError
from gpg_vl.observe.viewer import write_rollouts_html


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", help="a training run's output_dir (holding rollouts/ and metrics.jsonl)")
    args = parser.parse_args(argv)
    try:
        page = write_rollouts_html(args.output_dir)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
