"""What a training run records, and where (the first process of a run writes them).

- ``metrics.jsonl``: every step: step, loss, ppl, lr, aux, grad_norm (and the routing load
  on logging steps). The raw record; a resumed run drops the steps after its checkpoint.
- ``metrics.csv``: one row per logging step (every ``log_every`` steps and the last):
  ``step``; ``loss``, the mean token loss over the steps since the previous row (since
  the resume, for a resumed run's first row), and ``ppl = exp(loss)``; ``lr``, ``aux`` and ``grad_norm`` of the row's step;
  ``tokens_per_s``, the tokens of the global batches since the previous row over their
  wall time; and ``load/<layer>/<expert>``, each expert's share of the sequences (CSE,
  DEMix) or tokens (Switch) its layer routed since the previous row (blank before a layer
  has experts).
- ``tensorboard/``: the same scalars as TensorBoard event files (``train/loss``,
  ``train/ppl``, ``train/lr``, ``train/tokens_per_s``, ``load/<layer>/expert_<j>``) when
  the ``tensorboard`` package is installed (``pip install 'ntkscope[tensorboard]'``) and
  ``TrainConfig.tensorboard`` is on.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import pandas as pd

from ntkscope.core.files import strict_json, write_table, write_text

log = logging.getLogger(__name__)

CSV_COLUMNS = ["step", "loss", "ppl", "lr", "aux", "grad_norm", "tokens_per_s"]


def _summary_writer(directory: Path, purge_step: int):
    try:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
    except ImportError:
        return None
    return SummaryWriter(str(directory), purge_step=purge_step + 1 if purge_step else None)


class MetricsLog:
    """The run's metrics files in ``out_dir``, continued from step ``start`` (earlier rows kept,
    later ones dropped: a resumed run redoes them). ``write=False`` (a process other than the
    first) records nothing."""

    def __init__(self, out_dir: str | Path, start: int, *, write: bool = True, tensorboard: bool = True):
        self.out_dir, self.write = Path(out_dir), write
        self.steps: list[dict] = []  # the steps since the last row
        self.tokens, self.clock = 0, time.perf_counter()
        self.rows: list[dict] = []
        self.tb = None
        if not write:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        _truncate_jsonl(self.out_dir / "metrics.jsonl", start)
        csv = self.out_dir / "metrics.csv"
        if csv.is_file() and csv.stat().st_size:
            self.rows = [r for r in pd.read_csv(csv).to_dict("records") if r["step"] <= start]
        if tensorboard:
            self.tb = _summary_writer(self.out_dir / "tensorboard", start)
            if self.tb is None:
                log.info("metrics: tensorboard is not installed; metrics.csv and metrics.jsonl only "
                         "(pip install 'ntkscope[tensorboard]')")

    def step(self, metrics: dict, tokens: int) -> None:
        """One optimizer step's metrics (a dict with step, loss, ...) and the tokens of its global batch."""
        self.steps.append(metrics)
        self.tokens += tokens
        if self.write:
            with open(self.out_dir / "metrics.jsonl", "a") as fh:
                fh.write(strict_json(metrics) + "\n")

    def row(self, load: dict) -> dict:
        """Close the logging window at the last step: its row (also written), given the routing
        ``load`` {layer: [count per expert]} since the previous row."""
        last = self.steps[-1]
        now = time.perf_counter()
        loss = sum(m["loss"] for m in self.steps) / len(self.steps)
        row = {"step": last["step"], "loss": loss, "ppl": math.exp(min(loss, 50.0)), "lr": last["lr"],
               "aux": last["aux"], "grad_norm": last["grad_norm"],
               "tokens_per_s": self.tokens / max(now - self.clock, 1e-9)}
        for layer, counts in load.items():
            total = sum(counts)
            for j, c in enumerate(counts):
                row[f"load/{layer}/{j}"] = c / total if total else float("nan")
        self.steps, self.tokens, self.clock = [], 0, now
        if self.write:
            self.rows.append(row)
            frame = pd.DataFrame(self.rows)
            write_table(frame[CSV_COLUMNS + [c for c in frame.columns if c not in CSV_COLUMNS]],
                        self.out_dir / "metrics.csv")
            if self.tb is not None:
                self._tensorboard(row)
        return row

    def _tensorboard(self, row: dict) -> None:
        step = row["step"]
        for key in ("loss", "ppl", "lr", "aux", "grad_norm", "tokens_per_s"):
            if row[key] is not None:
                self.tb.add_scalar(f"train/{key}", row[key], step)
        for key, value in row.items():
            if key.startswith("load/"):
                _, layer, j = key.split("/")
                self.tb.add_scalar(f"load/{layer}/expert_{j}", value, step)
        self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _truncate_jsonl(path: Path, step: int) -> None:
    """Drop logged steps after the checkpoint a run resumes from (they will be redone)."""
    if not path.is_file():
        return
    lines = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    write_text(path, "".join(line + "\n" for line in lines))
