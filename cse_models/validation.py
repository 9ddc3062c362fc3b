"""Validation loss per domain during training: ``OUT/validation.csv``.

With ``TrainConfig.eval_every = K`` (0: off) a run scores every block of the corpus pack's
validation split every K steps and at its last step, one row per domain and step:

    step, lr, domain, blocks, tokens, loss, ppl

``loss`` is the mean token loss of the domain's validation blocks (``all``: every block), as
:func:`cse_models.evaluate.block_losses` scores them (a DEMix model by its uniform-prior
mixture); ``lr`` is the rate the step used. The model is scored in eval mode under
``torch.no_grad`` and put back in training mode: no random number is drawn, no routing
counter moves, so a run with the log trains the same weights as one without. A resumed run
keeps the rows up to its checkpoint and redoes the later ones. The file is rewritten whole
(atomically) at each scoring.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import torch

from cse_models.data import Blocks
from cse_models.evaluate import block_losses, domain_table
from ntkscope.core.files import write_table

COLUMNS = ["step", "lr", "domain", "blocks", "tokens", "loss", "ppl"]


class ValidationLog:
    """The rows of ``out_dir/validation.csv`` (those after step ``start`` dropped), and scoring."""

    def __init__(self, out_dir: str | Path, blocks: Blocks, start: int, *, special_ids=(), write: bool = True):
        self.path, self.blocks = Path(out_dir) / "validation.csv", blocks
        self.special_ids, self.write = special_ids, write
        self.rows: list[dict] = []
        if self.path.is_file() and self.path.stat().st_size:
            self.rows = [r for r in pd.read_csv(self.path).to_dict("records") if r["step"] <= start]

    @torch.no_grad()
    def score(self, model, step: int, lr: float) -> pd.DataFrame:
        """Score ``model`` on the validation blocks after ``step``; the step's rows (also written)."""
        was_training = model.training
        sums, counts = block_losses(model, self.blocks, special_ids=self.special_ids)
        model.train(was_training)
        table = domain_table(self.blocks, sums, counts)
        rows = [{"step": int(step), "lr": float(lr), "domain": r.domain, "blocks": int(r.blocks),
                 "tokens": int(r.tokens), "loss": float(r.loss), "ppl": math.exp(min(float(r.loss), 50.0))}
                for r in table.itertuples()]
        if self.write:
            self.rows = [r for r in self.rows if r["step"] != step] + rows
            write_table(pd.DataFrame(self.rows, columns=COLUMNS), self.path)
        return pd.DataFrame(rows, columns=COLUMNS)
