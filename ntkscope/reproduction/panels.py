"""The reproduction's two tables: which tables each figure needs and how they are measured
(:data:`STAGES`), and how each panel is drawn from them (:data:`PANELS`).

:class:`~ntkscope.reproduction.pipeline.Reproduction` computes and caches a stage's tables
and draws a panel through these rows; ``scripts/make_notebooks.py`` writes the notebooks'
cells from them. Adding a panel: its plotting function in :mod:`ntkscope.plotting`, its
measurement in :mod:`ntkscope.reproduction.analyses` (a new stage here, if it needs new
tables), and its row in :data:`PANELS`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from ntkscope import plotting
from ntkscope.reproduction import analyses, paper


@dataclass(frozen=True)
class Stage:
    """Tables measured together: ``names`` (cached as RUN/tables/NAME.csv, ``kernels`` as .npz), and
    ``compute(rep) -> {name: table}``. ``timing`` names the stage in RUN/timings.json."""

    names: tuple
    compute: Callable
    timing: str


@dataclass(frozen=True)
class Panel:
    """One panel of ``figure`` ("fig1" ... "fig5"): ``plotting.FUNCTION(t[TABLE], ..., **constants,
    **{name: value(rep, t)})`` over the figure's tables ``t``, written once, drawn by :meth:`draw` and
    shown in the notebooks by :attr:`call`. A panel without ``tables`` is drawn from nothing measured
    (the schematic)."""

    figure: str
    function: str
    tables: tuple = ()
    constants: dict = field(default_factory=dict)
    computed: dict = field(default_factory=dict)  # keyword -> (rep, tables) -> its value

    @property
    def uses_tables(self) -> bool:
        return bool(self.tables)

    @property
    def call(self) -> str:
        """The call as the notebooks show it, computed keywords as ``...``."""
        args = [f"t[{json.dumps(name)}]" for name in self.tables]
        args += [f"{k}={json.dumps(v)}" for k, v in self.constants.items()] + [f"{k}=..." for k in self.computed]
        return f"plotting.{self.function}({', '.join(args)})"

    def draw(self, rep, tables: dict):
        return getattr(plotting, self.function)(*(tables[name] for name in self.tables), **self.constants,
                                                **{k: value(rep, tables) for k, value in self.computed.items()})


def _routing(rep) -> dict:
    return analyses.routing(rep.cse(), rep.warmup_checkpoint(), rep.held_out(), rep.fitting(), rep.plan().layers[0],
                            rep.settings)


STAGES: dict[str, Stage] = {
    "fig1": Stage(("domain_sizes", "perplexity", "perplexity_by_bin"), lambda rep: analyses.long_tail(
        rep.pack, rep.dense(), rep.data(rep.settings.n_perplexity), rep.settings), "fig1"),
    "fig2a": Stage(("gc_by_bin", "histogram", "gc_outputs"), lambda rep: analyses.gc_by_frequency(
        rep.dense(), rep.data(), analyses.source_pools(rep.pack, rep.data(), rep.settings), rep.settings), "fig2a"),
    "routing": Stage(("fit_points", "routing", "routing_summary"), _routing, "routing"),
    "fig3": Stage(("gc_over_steps", "dynamics", "router_dynamics"), lambda rep: analyses.training_dynamics(
        rep.dense_run(), rep.data_draws(), [analyses.source_pools(rep.pack, d, rep.settings) for d in rep.data_draws()],
        rep.fitting(), rep.settings), "fig3"),
    "fig4": Stage(("snapshot_points", "snapshot_clusters"), lambda rep: analyses.snapshots(
        rep.dense_run(), rep.fitting(), rep.plan().layers[0], rep.settings), "fig4"),
    "fig5bc": Stage(("expert_ntk", "kernels"), lambda rep: analyses.expert_kernels(
        rep.cse(), rep.dense(), rep.data(), rep.plan().layers[0], rep.settings.gc_output), "fig5bc"),
    "tables": Stage(("results", "seeds", "seeds_summary"), lambda rep: analyses.results(
        rep.runs(), rep.seed_runs(), rep.pack, rep.settings), "tables"),
    "fig3-tracked": Stage(("gc_tracked",), lambda rep: analyses.tracked_gc(
        rep.dense_tracked, rep.model_dir("gpt-dense-tracked"), rep.data(),
        analyses.source_pools(rep.pack, rep.data(), rep.settings), rep.settings), "fig3 tracked"),
    "paper": Stage(("paper_runs", "table_gpt", "table_bert", "general_tasks", "table_tests"), paper.paper_tables,
                   "paper tables"),
}

#: figure -> the stages whose tables it shows
FIGURES: dict[str, tuple] = {"fig1": ("fig1",), "fig2": ("fig2a", "routing"), "fig3": ("fig3",),
                             "fig4": ("fig4",), "fig5": ("routing", "fig5bc"), "tables": ("tables",),
                             "paper": ("paper",)}


def _n(k: int, word: str) -> str:
    return f"{k} {word}{'s' * (k != 1)}"


PANELS: dict[str, Panel] = {
    "fig1a": Panel("fig1", "domain_sizes", ("domain_sizes",)),
    "fig1b": Panel("fig1", "perplexity_vs_frequency", ("perplexity", "perplexity_by_bin")),
    "fig2a": Panel("fig2", "gc_vs_frequency", ("gc_outputs", "histogram"), computed={
        "chosen": lambda rep, t: rep.settings.gc_output,
        "title": lambda rep, t: f"dense GPT ({rep.settings.mode}): GC against sentence frequency, three outputs"}),
    "fig2b": Panel("fig2", "cluster_view", ("fit_points",), {"colour_by": "cluster"}, computed={
        "title": lambda rep, t: f"layer {rep.plan().layers[0]}'s FFN input at the warm-up (step "
                                f"{rep.plan().convert_at}): {rep.settings.router_rule} on "
                                f"{rep.settings.router_representation} finds "
                                f"{_n(int((t['fit_points']['cluster'].unique() >= 0).sum()), 'cluster')}"}),
    "fig3a": Panel("fig3", "gc_over_steps", ("gc_over_steps",), computed={
        "warmup": lambda rep, t: rep.plan().convert_at,
        "rule": lambda rep, t: f"{rep.plan().warmup_rule}, plan.json: the CSE runs'",
        "title": lambda rep, t: f"dense GPT ({rep.settings.mode}): |GC| of the long tail ({rep.settings.gc_output})"}),
    "fig3bc": Panel("fig3", "layer_dynamics", ("dynamics", "router_dynamics")),
    "fig4a": Panel("fig4", "cse_schematic"),
    "fig4b": Panel("fig4", "cluster_view", ("snapshot_points",), {"colour_by": "cluster"}, computed={
        "title": lambda rep, t: f"dense GPT, layer {rep.plan().layers[0]}'s FFN input (fitting sample): the "
                                f"router's clusters over training"}),
    "fig5a": Panel("fig5", "cluster_view", ("routing",), {"colour_by": "expert"}, computed={
        "title": lambda rep, t: f"CSE layer {rep.plan().layers[0]}: the expert each held-out block is routed to "
                                f"({_n(t['routing']['expert'].nunique(), 'expert')} used)"}),
    "fig5bc": Panel("fig5", "expert_kernels", ("expert_ntk",)),
}

#: panels drawn only when asked for (``settings.track_every``): Figure 3(a) from the GC tracker's
#: probes during a second, tracked training of the dense model, every ``track_every`` steps
TRACKED_PANELS: dict[str, Panel] = {
    "fig3a-tracked": Panel("fig3-tracked", "gc_over_steps", ("gc_tracked",), computed={
        "title": lambda rep, t: f"dense GPT ({rep.settings.mode}): |GC| of the long tail, measured by the tracker "
                                f"every {rep.settings.track_every} steps during training"}),
}
