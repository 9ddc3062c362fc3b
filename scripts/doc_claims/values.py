"""What the claim makers share: a run folder's tables read once, and how a number is written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd


class Tables:
    """A run folder's tables (``tables/NAME.csv``) and JSON files, read once each."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._cache = {}

    def __getitem__(self, name: str):
        if name not in self._cache:
            path = self.folder / (name if name.endswith(".json") or name.endswith(".csv") else f"tables/{name}.csv")
            self._cache[name] = json.loads(path.read_text()) if path.suffix == ".json" else pd.read_csv(path)
        return self._cache[name]


def fmt(value: float, digits: int = 3) -> str:
    return f"{value:.{digits}f}"


def fmt_range(values, digits: int = 2, unit: str = "") -> str:
    """"a–b" of the rounded minimum and maximum (one value when they round equal; "a to b",
    with typographic minus signs, when a bound is negative)."""
    low, high = fmt(float(np.min(values)), digits), fmt(float(np.max(values)), digits)
    if low == high:
        return f"{low}{unit}".replace("-", "−")
    if low.startswith("-") or high.startswith("-"):
        return f"{low} to {high}{unit}".replace("-", "−")
    return f"{low}–{high}{unit}"


def fmt_signed_range(values, digits: int = 1) -> str:
    return f"+{float(np.min(values)):.{digits}f} to +{float(np.max(values)):.{digits}f}"


def fmt_steps(values) -> str:
    return ", ".join(str(int(v)) for v in values) or "none"
