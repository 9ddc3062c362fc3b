"""The CSE paper's Figures 1-5 and Tables 1-2, regenerated: train the models, run every
analysis, draw the figures (``ntkscope reproduce``, the notebooks in ``notebooks/``).

- :mod:`~ntkscope.reproduce.settings` — the sizes: smoke, quick (2 CPU cores), full (GPU).
- :mod:`~ntkscope.reproduce.training` — dense, Switch, CSE (branched at the warm-up), finetuned.
- :mod:`~ntkscope.reproduce.analyses` — the measurements behind each figure, as tables.
- :mod:`~ntkscope.reproduce.pipeline` — :class:`Reproduction` (cached, resumable) and :func:`reproduce`.
"""

from ntkscope.reproduce.pipeline import FIGURES, PANELS, Reproduction, reproduce
from ntkscope.reproduce.settings import PRESETS, ReproduceSettings, settings_for

__all__ = ["FIGURES", "PANELS", "PRESETS", "ReproduceSettings", "Reproduction", "reproduce", "settings_for"]
