"""The CSE paper's Figures 1-5 and Tables 1-2, regenerated: train the models, run every
analysis, draw the figures (``ntkscope reproduce``, the notebooks in ``notebooks/``).

- :mod:`~ntkscope.reproduction.settings` — the sizes: smoke, quick (2 CPU cores), full (GPU).
- :mod:`~ntkscope.reproduction.training` — dense, Switch, CSE (branched at the warm-up), finetuned.
- :mod:`~ntkscope.reproduction.analyses` — the measurements behind each figure, as tables.
- :mod:`~ntkscope.reproduction.pipeline` — :class:`Reproduction` (cached, resumable) and :func:`reproduce`.
"""

from ntkscope.reproduction.pipeline import FIGURES, PANELS, Reproduction, reproduce
from ntkscope.reproduction.settings import PRESETS, ReproduceSettings, settings_for

__all__ = ["FIGURES", "PANELS", "PRESETS", "ReproduceSettings", "Reproduction", "reproduce", "settings_for"]
