"""Pages looked at in a headless chromium: the DOM after its scripts ran, the console, a screenshot, and how much
of a region holds image content (the viewer tests; skipped where chromium is not installed)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
from PIL import Image

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def open_in_chromium(page: Path, screenshot: Path, fragment: str = "") -> tuple[str, list[str]]:
    """The page's DOM after its scripts ran, and the console lines chromium logged; a screenshot."""
    common = [CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--enable-logging=stderr", "--v=0",
              "--hide-scrollbars", "--window-size=1400,1500"]
    url = page.as_uri() + fragment
    shot = subprocess.run([*common, f"--screenshot={screenshot}", url], capture_output=True, text=True, timeout=120)
    dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    console = [line for line in (shot.stderr + dom.stderr).splitlines() if ":CONSOLE" in line]
    return dom.stdout, console


def root_tag(dom: str) -> str:
    """The <html ...> tag of a DOM dump, where the page's script leaves its markers."""
    return re.search(r"<html[^>]*>", dom).group(0)


def image_tiles(screenshot: Path, box: tuple[int, int, int, int], side: int = 24) -> int:
    """How many `side`-px tiles of a screenshot's region are filled with image content: nearly all their pixels
    dark or strongly coloured (some channel under 200). The page's own chrome is white, pale grey and pale tints,
    and text leaves most of a tile white, so a blank page, or one whose images failed, has none."""
    with Image.open(screenshot) as opened:
        pixels = np.asarray(opened.convert("RGB").crop(box))
    content = pixels.min(axis=2) < 200  # [H, W]
    return sum(bool(content[y:y + side, x:x + side].mean() > 0.9)
               for y in range(0, content.shape[0] - side + 1, side)
               for x in range(0, content.shape[1] - side + 1, side))
