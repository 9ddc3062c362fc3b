"""What the ``ntkscope gc``, ``ntk`` and ``freq`` commands do, as library functions:
load, analyse, and write the results (JSON + CSV + PNG, or .npy) atomically.

Every result file is written into a temporary directory first and moved into ``out``
only when the whole command succeeded, so a failed command leaves no partial output.
A re-run with the same options and inputs finds its ``result.json`` and reuses it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from ntkscope._checks import available_memory_bytes, fail, format_bytes

log = logging.getLogger(__name__)


def fingerprint(options: dict, *paths) -> str:
    """A key for cached results: the options and each input's size and modification time."""
    h = hashlib.sha256(json.dumps(options, sort_keys=True, default=str).encode())
    for p in paths:
        p = Path(p)
        files = sorted(p.rglob("*")) if p.is_dir() else [p]
        for f in files:
            if f.is_file() and "analysis" not in f.parts:
                st = f.stat()
                h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def cached_result(out: Path | None, key: str) -> dict | None:
    if out is None or not (Path(out) / "result.json").is_file():
        return None
    result = json.loads((Path(out) / "result.json").read_text())
    return result if result.get("key") == key else None


class Outputs:
    """Collects result files in a temporary directory. Used as a context manager: on success
    the files move into ``out`` (listed in ``written``); on an error they are discarded."""

    def __init__(self, out: Path | None):
        self.out = Path(out) if out is not None else None
        self.tmp = Path(tempfile.mkdtemp(prefix="ntkscope-"))
        self.written: list[str] = []

    def __enter__(self) -> "Outputs":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.written = [str(p) for p in self.commit()]
        else:
            self.discard()

    def path(self, name: str) -> Path:
        return self.tmp / name

    def commit(self) -> list[Path]:
        if self.out is None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return []
        self.out.mkdir(parents=True, exist_ok=True)
        written = []
        for f in sorted(self.tmp.iterdir()):
            partial = self.out / f".{f.name}.partial"
            shutil.move(f, partial)  # may cross file systems; the rename below is atomic
            os.replace(partial, self.out / f.name)
            written.append(self.out / f.name)
        shutil.rmtree(self.tmp, ignore_errors=True)
        return written

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def _load(checkpoint, tokenizer):
    from ntkscope.checkpoints import check_vocab, checkpoint_tokenizer, load_checkpoint

    model = load_checkpoint(checkpoint)
    tok = checkpoint_tokenizer(checkpoint, tokenizer)
    check_vocab(model, tok, "ntkscope")
    return model, tok


def memory_note(model, n: int, params=None, dtype=None) -> str:
    """The size of J for this analysis, against the memory available."""
    from ntkscope.params import select_parameters

    P = select_parameters(model, params, None, func="ntkscope").n_params
    itemsize = 8 if str(dtype) in ("float64", "torch.float64") else 4
    need = n * P * itemsize
    return (f"memory: J is {n} x {P:,} = {format_bytes(need)} ({'float64' if itemsize == 8 else 'float32'}); "
            f"{format_bytes(available_memory_bytes())} available; 'auto' keeps J whole when it fits in half of "
            "that, else streams or projects it (and says so)")


def frequency_bins(scores, bins: int, min_count: int) -> tuple[np.ndarray, pd.DataFrame]:
    """Equal-width bins over the scores: per-sample labels ("bin k"), and the histogram."""
    from ntkscope.frequency import score_histogram

    hist = score_histogram(scores, bins=bins)
    edges = np.append(hist["left"].to_numpy(), hist["right"].iloc[-1])
    which = np.clip(np.searchsorted(edges, scores, side="right") - 1, 0, bins - 1)
    return np.array([f"bin {b}" for b in which]), hist


def gc_command(checkpoint, data=None, *, by: str = "frequency-bins", bins: int = 6, n: int = 256,
               min_count: int = 4, params=None, output: str = "loss", method: str = "auto", dtype=None,
               seq_len: int = 64, seed: int = 0, tokenizer=None, out=None) -> dict:
    """GC of each subset (frequency bin or label) against the whole set of ``n`` sentences.

    Writes ``gc.csv``, ``histogram.csv``, ``result.json`` and ``gc_vs_frequency.png`` to ``out``.
    """
    from ntkscope.analysis_data import load_analysis_data
    from ntkscope.consistency import gradient_consistency_groups
    from ntkscope.plotting import gc_vs_frequency, save_figure

    if by not in ("frequency-bins", "label"):
        raise fail("gc", "by", "must be 'frequency-bins' or 'label'", by)
    options = dict(checkpoint=str(checkpoint), data=str(data), by=by, bins=bins, n=n, min_count=min_count,
                   params=params, output=output, method=method, dtype=dtype, seq_len=seq_len, seed=seed,
                   tokenizer=tokenizer)
    key = fingerprint(options, checkpoint, *([data] if data not in (None, "default") else []))
    cached = cached_result(out, key)
    if cached:
        log.info("gc: reusing the result in %s (same options and inputs)", out)
        return cached
    model, tok = _load(checkpoint, tokenizer)
    ad = load_analysis_data(data, tok, n=n, seq_len=seq_len, seed=seed)
    log.info("%s", memory_note(model, n, params, dtype))
    labels, hist = frequency_bins(ad.labels["score"].to_numpy(), bins, min_count)
    if by == "label":
        labels = ad.labels["label"].to_numpy()
    groups = gradient_consistency_groups(model, ad.batch, labels, min_count=min_count, output=output, params=params,
                                         method=method, dtype=dtype, seed=seed)
    table = groups.to_frame().rename(columns={"score": "gc"})
    scores = ad.labels["score"].to_numpy()
    table["mean_frequency_score"] = [float(scores[labels == lab].mean()) for lab in table["label"]]
    if by == "frequency-bins":
        index = table["label"].str.split().str[1].astype(int)
        table.insert(1, "left", hist["left"].to_numpy()[index])
        table.insert(2, "right", hist["right"].to_numpy()[index])
        table = table.sort_values("left").reset_index(drop=True)
    result = {"key": key, "options": options, "data": ad.source, "n": n, "groups": table.to_dict("records"),
              "skipped": {str(k): v for k, v in groups.skipped.items()}}
    with Outputs(out) as files:
        table.to_csv(files.path("gc.csv"), index=False)
        hist.to_csv(files.path("histogram.csv"), index=False)
        if by == "frequency-bins":
            save_figure(gc_vs_frequency(table, hist, title=f"{Path(checkpoint).name}: GC against sentence "
                                        f"frequency (n={n})"), files.path("gc_vs_frequency.png"))
        files.path("result.json").write_text(json.dumps(result, indent=2, default=float) + "\n")
    result["files"] = files.written
    return result


def gc_run_command(run_dir, data=None, *, n: int = 256, tail_fraction: float = 1 / 3, method: str = "auto",
                   seq_len: int = 64, seed: int = 0, tokenizer=None, out=None) -> dict:
    """GC of the long-tail subset (lowest frequency scores) against the whole set at every
    checkpoint of a run: ``gc_over_steps.csv``, ``result.json`` and ``gc_over_steps.png``."""
    from ntkscope.analysis_data import load_analysis_data
    from ntkscope.checkpoints import checkpoint_tokenizer, list_checkpoints
    from ntkscope.dynamics import gc_series, long_tail_subset
    from ntkscope.plotting import gc_over_steps, save_figure

    checkpoints = list_checkpoints(run_dir)
    tok = checkpoint_tokenizer(checkpoints[-1][1], tokenizer)
    ad = load_analysis_data(data, tok, n=n, seq_len=seq_len, seed=seed)
    tail = long_tail_subset(ad.labels["score"], tail_fraction)
    frame = gc_series(run_dir, ad.batch, tail, method=method)
    result = {"run": str(run_dir), "data": ad.source, "n": n, "n_tail": len(tail),
              "peak_step": int(frame.loc[frame["gc"].idxmax(), "step"]), "series": frame.to_dict("records")}
    with Outputs(out) as files:
        frame.to_csv(files.path("gc_over_steps.csv"), index=False)
        save_figure(gc_over_steps(frame), files.path("gc_over_steps.png"))
        files.path("result.json").write_text(json.dumps(result, indent=2, default=float) + "\n")
    result["files"] = files.written
    return result


def ntk_command(checkpoint, data=None, *, n: int = 64, blocks=None, params=None, output: str = "loss",
                method: str = "auto", dtype=None, seq_len: int = 64, seed: int = 0, tokenizer=None, out=None) -> dict:
    """The empirical NTK of ``n`` sentences: ``ntk.npy`` (n, n), ``blocks.npz`` (one kernel per
    block), ``labels.csv`` and ``ntk.png`` (samples ordered by label)."""
    from ntkscope.analysis_data import load_analysis_data
    from ntkscope.ntk import empirical_ntk
    from ntkscope.plotting import ntk_heatmap, save_figure

    model, tok = _load(checkpoint, tokenizer)
    ad = load_analysis_data(data, tok, n=n, seq_len=seq_len, seed=seed)
    log.info("%s", memory_note(model, n, params, dtype))
    result_ntk = empirical_ntk(model, ad.batch, output=output, params=params, blocks=blocks, method=method,
                               dtype=dtype, seed=seed)
    matrix = result_ntk.matrix.detach().cpu().numpy()
    result = {"checkpoint": str(checkpoint), "data": ad.source, "n": n, "method": result_ntk.method,
              "reason": result_ntk.reason, "blocks": list(result_ntk.blocks or {}),
              "trace": float(np.trace(matrix))}
    with Outputs(out) as files:
        np.save(files.path("ntk.npy"), matrix)
        if result_ntk.blocks:
            np.savez(files.path("blocks.npz"), **{k: v.detach().cpu().numpy() for k, v in result_ntk.blocks.items()})
        ad.labels.to_csv(files.path("labels.csv"), index=False)
        save_figure(ntk_heatmap(matrix, ad.labels["label"], title=f"NTK of {Path(checkpoint).name} (n={n})"),
                    files.path("ntk.png"))
        files.path("result.json").write_text(json.dumps(result, indent=2) + "\n")
    result["files"] = files.written
    return result
