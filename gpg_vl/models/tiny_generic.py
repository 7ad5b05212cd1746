"""Tiny random models of the generic family's classes (filled below)."""

from __future__ import annotations

GENERIC_BUILDERS: dict = {}
