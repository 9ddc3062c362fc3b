"""The sizes of a reproduction: ``smoke`` (every stage runs, in about two minutes on 2 CPU
cores; the figures mean nothing), ``quick`` (about 20 minutes on 2 CPU cores: the fast first
look), ``tail`` (the quick model trained long enough for the long tail to cluster, with three
seeds of CSE against its baselines: the committed run, about an hour on 2 CPU cores) and
``full`` (the GPT-2-small shape for 20k steps, for one GPU; not yet run, an estimated 3-4
hours on one H100); and ``tables`` (the paper's Tables 1-2 and a general-tasks table, every row
for BERT and GPT with three pretraining seeds, at the quick model's size: no figures)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from ntkscope.core.checks import UserError, fail, renamed_keys
from ntkscope.core.files import write_json
from ntkscope.core.requests import differences, listed
from ntkscope.gc.options import GCOptions
from ntkscope.kernel.uncertainty import Resampling


@dataclass(frozen=True)
class ReproduceSettings:
    """Every number a reproduction uses. Models are GPTs (``model``: GPTConfig fields).

    Training: the dense model runs ``steps`` steps with a checkpoint every
    ``checkpoint_every``, and every ``early_every`` steps through ``early_until`` (dense enough
    to see GC rise); the CSE model branches from the dense run at the planned warm-up (the long
    tail's GC peak when its statistics show it, else the earliest checkpoint with stable
    clusters, at most ``max_warmup_fraction`` of ``steps``) and runs to ``steps``; Switch trains from scratch with ``switch_experts`` experts at the same
    layers; each domain-finetuned baseline continues the dense model for ``finetune_steps``
    on one long-tail domain only.
    Analyses: ``n`` validation sentences for GC, clusters and NTKs; ``n_perplexity``
    sentences for Figure 1(b); ``bins`` frequency bins; the lowest-score ``tail_fraction``
    is the long tail; ``k_max`` for the elbow; ``projection_dim`` for random projections;
    ``snapshots`` checkpoints in Figure 4(b).
    Router (docs/router.md): ``router_rule`` and ``router_representation`` of
    :func:`ntkscope.fit_router`, with ``proj_dim`` (>= the width: no projection),
    ``min_cluster_size`` (HDBSCAN), ``min_samples``, at most ``max_experts``, fitted on
    ``cse_samples`` training blocks; the same router rule gives the cluster dynamics and the
    stability of the warm-up rule. ``seeds``: CSE, upcycled Switch and the dense continuation
    are trained from the warm-up with data orders ``seed .. seed + seeds - 1`` (Table "seeds"),
    on the full schedule to step ``compare_until`` (0: to the end; else a dense checkpoint step).
    GC: ``gc_output`` is the scalar output the figures use (``gc_outputs`` are compared side by
    side in ``gc_outputs.csv``); ``binning`` "count" (equal-count bins) or "width";
    ``gc_resamples`` jackknife deletions at most and ``gc_null_draws`` subsets per null band;
    the homogeneous null draws from the sentences of ``homogeneous_domain`` (ordinary text);
    Figure 3(a)'s series is measured on ``gc_draws`` independent draws of analysis sentences
    (seeds ``seed .. seed + gc_draws - 1``), a second source of noise for the peak test;
    ``stable_overlap``: the adjusted Rand index between neighbouring checkpoints' router
    clusters above which they count as stable (the warm-up's fallback rule).
    Paper tables (docs/tables.md): ``table_archs`` ("gpt", "bert"; empty: none) each train, per
    pretraining seed ``seed .. seed + seeds - 1``, a dense model from scratch and from its
    checkpoint at ``table_convert_at`` (0: the plan's conversion step) Switch, CSE/MoF, CSE/MoA and DEMix at
    ``table_layers`` (empty: the plan's layers) to ``steps`` (CSE with drift handling
    ``table_mean_rate``, :class:`cse_models.config.SparseConfig`; 0: Algorithm 1 as written); dense and Switch are then tuned for
    ``finetune_steps`` on each of ``finetune_domains``; each model is evaluated on at most
    ``eval_max_blocks`` test blocks per domain and ``eval_max_items`` probe items per task (0: all;
    smoke runs only). ``figures``: whether the mode draws
    Figures 1-5 (and the GPT slice of the tables that comes with them).
    ``adopt_from``: a directory of model directories (e.g. a sweep's ``RUN/models``); a model
    this run would train is linked from there instead when one there trained exactly the same
    (:func:`ntkscope.reproduction.training._adopt`). It says where results may come from, not
    what the run is, so a run resumes with or without it.
    ``track_every``: when above 0, the dense model is trained a second time with a
    :class:`ntkscope.GCTracker` on Figure 3(a)'s sentences every ``track_every`` steps, and
    ``fig3a-tracked`` is drawn from its table (``gc_tracked.csv``); an addition to the run, not a
    change of it, so it too is left out of what the run is bound to.
    ``eval_every``: when above 0, every model the run trains scores the pack's validation blocks
    per domain every ``eval_every`` steps (``RUN/models/NAME/validation.csv``,
    :mod:`cse_models.validation`); a log beside the training, not a change of it, so also left out.
    """

    mode: str
    model: dict
    seq_len: int
    steps: int
    checkpoint_every: int
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 50
    finetune_steps: int = 60
    finetune_lr: float = 1e-3
    finetune_domains: tuple = ("legal", "biomedical")
    switch_experts: int = 4
    sparse_layers: int = 2
    router_rule: str = "hdbscan"
    router_representation: str = "centred-cosine"
    proj_dim: int = 128
    min_cluster_size: int = 15
    min_samples: int = 5
    max_experts: int = 8
    cse_samples: int = 3000
    seeds: int = 1
    compare_until: int = 0
    max_warmup_fraction: float = 0.5
    early_every: int = 0
    early_until: int = 0
    n: int = 192
    n_perplexity: int = 1500
    bins: int = GCOptions.bins  # the grouping's defaults and checks are GCOptions' (declared once)
    min_count: int = GCOptions.min_count
    tail_fraction: float = GCOptions.tail_fraction
    k_max: int = 8
    projection_dim: int = 64
    snapshots: int = 4
    gc_output: str = "centred-true-logit"
    gc_outputs: tuple = ("loss", "true-logit", "centred-true-logit")
    binning: str = GCOptions.binning
    gc_resamples: int = Resampling.resamples  # and the statistics' are Resampling's
    gc_null_draws: int = Resampling.null_draws
    homogeneous_domain: str = "general"
    gc_draws: int = 1
    stable_overlap: float = 0.8
    probe_seeds: int = 5
    table_archs: tuple = ()
    table_layers: tuple = ()
    table_convert_at: int = 0
    table_mean_rate: float = 0.0
    eval_max_blocks: int = 0
    eval_max_items: int = 0
    figures: bool = True
    seed: int = 0
    device: str = "auto"
    adopt_from: str = ""
    track_every: int = 0
    eval_every: int = 0

    def __post_init__(self):
        try:
            self.gc_options()
            self.resampling()
        except UserError as e:
            raise UserError(f"ReproduceSettings: {e}") from None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def gc_options(self) -> GCOptions:
        """The GC grouping these settings use (``bins``, ``binning``, ``min_count``,
        ``tail_fraction``), checked by :class:`~ntkscope.gc.options.GCOptions`."""
        return GCOptions(bins=self.bins, binning=self.binning, min_count=self.min_count,
                         tail_fraction=self.tail_fraction)

    def resampling(self) -> Resampling:
        """The GC statistics' settings: ``gc_resamples`` (jackknife), ``gc_null_draws``, ``seed``."""
        return Resampling(resamples=self.gc_resamples, null_draws=self.gc_null_draws, seed=self.seed)

    def replace(self, **changes) -> "ReproduceSettings":
        return dataclasses.replace(self, **changes)


PRESETS = {
    "smoke": ReproduceSettings(
        mode="smoke", model={"n_layer": 2, "n_head": 2, "n_embd": 32}, seq_len=32, steps=40, checkpoint_every=10,
        batch_size=16, warmup_steps=5, finetune_steps=5, switch_experts=2, cse_samples=128, n=40, n_perplexity=120,
        bins=3, min_count=3, k_max=4, projection_dim=16, proj_dim=8, min_cluster_size=5, snapshots=2, probe_seeds=2,
        gc_outputs=("centred-true-logit", "loss"), gc_resamples=50, gc_null_draws=50,
        table_archs=("gpt", "bert"), eval_max_blocks=40, eval_max_items=60),
    "quick": ReproduceSettings(
        mode="quick", model={"n_layer": 4, "n_head": 4, "n_embd": 128}, seq_len=48, steps=600, checkpoint_every=50,
        early_every=10, early_until=200),
    "tail": ReproduceSettings(
        mode="tail", model={"n_layer": 4, "n_head": 4, "n_embd": 128}, seq_len=48, steps=1600, checkpoint_every=100,
        early_every=25, early_until=300, seeds=3, compare_until=600, gc_draws=3),
    "sweep": ReproduceSettings(
        mode="sweep", model={"n_layer": 4, "n_head": 4, "n_embd": 128}, seq_len=48, steps=2400, checkpoint_every=100,
        early_every=25, early_until=300, seeds=3, figures=False, eval_every=50),
    "tables": ReproduceSettings(
        mode="tables", model={"n_layer": 4, "n_head": 4, "n_embd": 128}, seq_len=48, steps=400, checkpoint_every=400,
        finetune_steps=40, seeds=3, table_archs=("gpt", "bert"), table_layers=(2, 3), table_convert_at=75,
        figures=False),
    # the GPT rows of the tables as the sweep chose (figures/sweep/README.md): every seed's small-cluster
    # rule fell back to step 1200, CSE with drift handling, to step 2400, past the tail's clusters
    "tables-late": ReproduceSettings(
        mode="tables-late", model={"n_layer": 4, "n_head": 4, "n_embd": 128}, seq_len=48, steps=2400,
        checkpoint_every=400, finetune_steps=40, seeds=3, table_archs=("gpt",), table_layers=(2, 3),
        table_convert_at=1200, table_mean_rate=0.1, figures=False),
    "full": ReproduceSettings(
        mode="full", model={"n_layer": 12, "n_head": 12, "n_embd": 768}, seq_len=128, steps=20000,
        checkpoint_every=1000, batch_size=64, lr=6e-4, warmup_steps=1000, finetune_steps=1000, finetune_lr=1e-4,
        switch_experts=8, sparse_layers=4, cse_samples=4096, n=512, n_perplexity=2500, bins=8, k_max=12,
        projection_dim=128, early_every=100, early_until=2000),
}


def settings_for(mode: str, **changes) -> ReproduceSettings:
    """The preset ``mode`` (a key of :data:`PRESETS`) with ``changes`` applied."""
    if mode not in PRESETS:
        raise fail("settings_for", "mode", f"must be one of {sorted(PRESETS)}", mode)
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(ReproduceSettings)})
    if unknown:
        raise fail("settings_for", "changes", "must name fields of ReproduceSettings", unknown)
    return PRESETS[mode].replace(**changes)


#: settings renamed, old name -> new: a spec's old name is read with a warning, a run's settings.json
#: silently, and a unit's key holds the old name (a key must not change with a field's name)
RENAMED_SETTINGS = {"table_warmup": "table_convert_at"}


def keyed_settings(settings: "ReproduceSettings") -> dict:
    """``settings`` as a dict under the names units were first keyed under (:data:`RENAMED_SETTINGS`)."""
    old = {new: old for old, new in RENAMED_SETTINGS.items()}
    return {old.get(k, k): v for k, v in settings.to_dict().items()}


#: settings that say where a run may take results from, or what it logs besides, not what it is: not
#: bound to the run, not in a unit's key
RUN_LOCAL = ("adopt_from", "track_every", "eval_every")


def bind_settings(run_dir, settings: ReproduceSettings, pack, func: str, what: str = "reproduction") -> None:
    """Tie ``run_dir`` to ``settings`` and the corpus ``pack``: the first call writes
    ``run_dir/settings.json``; later ones refuse other settings or another pack (a setting added
    since, at its default, changes nothing the run holds), so a resumed run continues the same one."""
    run_dir = Path(run_dir)
    wanted = {"settings": {k: v for k, v in settings.to_dict().items() if k not in RUN_LOCAL},
              "pack": pack.manifest.get("version")}
    saved = run_dir / "settings.json"
    if saved.is_file():
        have = json.loads(saved.read_text())
        have["settings"] = renamed_keys(have["settings"], RENAMED_SETTINGS, "bind_settings", warn=False)
        defaults = {f.name: f.default for f in dataclasses.fields(ReproduceSettings)
                    if f.default is not dataclasses.MISSING}
        have["settings"] = json.loads(json.dumps({k: v for k, v in {**defaults, **have["settings"]}.items()
                                                  if k not in RUN_LOCAL}))
        changed = differences(have, wanted)
        if changed:
            raise fail(func, "run_dir", f"holds a {what} with other settings or another pack ("
                       f"{listed(changed)}); "
                       "use another --out", str(run_dir))
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json(saved, wanted)
