"""What every figure module shares: matplotlib imported on first drawing, the domains' colours, the
null bands' columns, layer names as a reader says them, and :func:`save_figure`."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ntkscope.core.files import atomic_path
from ntkscope.core.names import block_of


def pyplot():
    """matplotlib.pyplot, imported on first drawing (it costs half a second); the backend is the
    caller's: the command line chooses Agg, a notebook keeps its own."""
    import matplotlib.pyplot as plt  # on the first figure: after the command chose the backend

    return plt


DOMAIN_COLOURS = {"general": "#7f8c8d", "legal": "#c0392b", "biomedical": "#2e86c1"}


def save_figure(fig, path, *, formats=("png",), close: bool = True) -> list[Path]:
    """Write ``fig`` as ``path`` with each suffix in ``formats``, atomically; returns the paths."""
    plt = pyplot()
    path = Path(path)
    out = []
    for fmt in formats:
        target = path.with_suffix(f".{fmt}")
        metadata = {"CreationDate": None} if fmt == "pdf" else None  # the same figure gives the same bytes
        with atomic_path(target) as tmp:
            fig.savefig(tmp, dpi=130, bbox_inches="tight", metadata=metadata)
        out.append(target)
    if close:
        plt.close(fig)
    return out


def lowest(table, columns) -> float:
    """A lower y limit that shows every value of ``columns`` (the scale zooms in where all are near 1)."""
    low = float(np.nanmin(table[columns].to_numpy(dtype=float)))
    return max(-1.02, low - 0.1 * (1.0 - low) - 0.02)


def flagged_rows(table):
    """Rows whose direction is flagged (a non-empty ``flags``; without that column, no GC)."""
    return table["flags"].fillna("").astype(str).str.len() > 0 if "flags" in table else table["gc"] != table["gc"]


#: the null bands drawn, in order: (name in a gc table's columns, label, colour)
NULLS = (("", "random subsets", "#95a5a6"), ("homogeneous", "homogeneous subsets (ordinary text)", "#5dade2"))


def band_columns(name: str) -> tuple:
    """The low, median and high columns of the null band ``name`` ("" the random one)."""
    stem = f"null_{name}_" if name else "null_"
    return f"{stem}low", f"{stem}median", f"{stem}high"


def layer_name(path) -> str:
    """A module path as a reader says it: ``hf.gpt_neox.layers.2.mlp.layer`` -> "layer 2 (mlp)",
    ``transformer.h.0`` -> "layer 0"; anything else as it is."""
    found = block_of(path)
    if found is None or str(path).isdigit():
        return str(path)
    return f"layer {found[0]}" + (f" ({found[1]})" if found[1] else "")
