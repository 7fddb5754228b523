"""Sizes and counts for people: one spelling everywhere (spool errors, heartbeats, progress bars)."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """1234567 -> '1.2 MB' (powers of 1000)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
