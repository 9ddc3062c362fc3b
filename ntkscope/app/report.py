"""``ntkscope report``: one self-contained HTML page of an analysis (a result directory of
``ntkscope gc``/``ntk``/``eval``/``plan``, a training run, or a reproduction such as
``figures/tail``): what was found, in words, with its figures drawn from the tables beside
them, embedded as PNG data, a glossary of every column shown, and what made it (commands,
versions, hashes). No script, no stylesheet or image from elsewhere: it opens offline.
"""

from __future__ import annotations

import base64
import html
import io
import logging
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ntkscope.app.glossary import describe
from ntkscope.core.checks import MissingInput, UserError, fail
from ntkscope.core.files import read_json_object, strict_json, write_text
from ntkscope.core.provenance import environment
from ntkscope.plotting import (expert_layers, gc_by_label, gc_over_steps, gc_per_layer, gc_vs_frequency, inrun_series,
                               layer_dynamics, routing_shares, score_histogram_bars, training_curve)
from ntkscope.representation.plan import gc_peak, plan_step
from ntkscope.runs.checkpoints import trainer_checkpoints

log = logging.getLogger(__name__)

#: a table longer or wider than this is shown in part, the whole of it folded below (and in the file it names);
#: one longer than FOLDED_ROWS is folded in part too: its file holds the rest
MAX_ROWS, MAX_COLUMNS, FOLDED_ROWS = 12, 9, 2000
FLAG_WORDS = {
    "eigengap": "the whole set's top two NTK eigenvalues are close, so its primary direction is ill-defined",
    "eigengap-subset": "the subset's top two NTK eigenvalues are close, so its direction is ill-defined",
    "cos-ones": "the whole set's top eigenvector is far from all-ones: a few samples dominate its direction",
    "cos-ones-subset": "the subset's top eigenvector is far from all-ones: a few samples dominate it",
    "sign": "GC's sign is a coin toss between independent draws",
}
#: the columns the report reads: of a GC table (gc.csv of ``ntkscope gc``, a reproduction's gc_by_bin.csv),
#: of its frequency-bin figure, of a GC series (gc_over_steps.csv, a tracker's gc.csv); the columns that
#: must hold numbers wherever they are; and a routing table's (``cse_models.domains.routing_table``)
GC_GROUP = ["label", "abs_gc", "abs_gc_low", "abs_gc_high", "null_low", "null_high", "n_subset", "flags"]
GC_BINS = ["left", "right", "mean_gradient", "mean_gradient_low", "mean_gradient_high"]
GC_STEPS = ["step", "abs_gc", "abs_gc_se", "null_low", "null_median", "null_high", "flags"]
NUMBERS = ["step", "abs_gc", "abs_gc_low", "abs_gc_high", "abs_gc_se", "null_low", "null_median", "null_high",
           "n_subset", "left", "right", "mean_gradient", "mean_gradient_low", "mean_gradient_high", "kernel_cka",
           "count", "percent", "k", "k_silhouette", "silhouette", "inter_distance", "separation", "n_clusters",
           "n_pure_tail", "tail_share", "share_of_domain", "loss", "lr"]
ROUTING = ["layer", "expert", "domain", "unit", "count", "share_of_domain"]


@dataclass
class Section:
    """One part of the page: a title, what it shows in words, figures (PNG bytes), tables
    ({caption: DataFrame}) and notes (findings, flags and warnings, in words)."""

    title: str
    text: str = ""
    figures: list = field(default_factory=list)
    tables: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt  # after the command has chosen matplotlib's backend

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


class _Files:
    """The tables and JSON files of the directory, wherever its kind keeps them, read defensively:
    a file that is damaged, or not what ntkscope writes under its name, is one line naming it."""

    def __init__(self, root: Path, only: dict | None = None):
        self.root, self.only = root, only
        self.folders = [root, root / "tables", root / "track", root / "analysis", root / "inrun"]

    def path(self, name: str) -> Path | None:
        if self.only is not None:  # one file given: it stands for its kind, nothing beside it is read
            return self.only.get(name)
        return next((f / name for f in self.folders if (f / name).is_file()), None)

    def csv(self, name: str) -> pd.DataFrame | None:
        path = self.path(name)
        if path is None:
            return None
        try:
            return pd.read_csv(path, keep_default_na=False, na_values=[""])
        except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as err:
            raise UserError(f"report: {path} is not a readable CSV table ({str(err).splitlines()[0][:160]})") from None

    def table(self, name: str, columns, *, key: str | None = None) -> pd.DataFrame | None:
        """``name``'s table when the directory has one (and, with ``key``, when it has that column:
        else it is another kind of table of that name), checked to have ``columns`` and rows."""
        table = self.csv(name)
        if table is None or (key is not None and key not in table):
            return None
        self.check(name, table, columns)
        return table

    def check(self, name: str, table: pd.DataFrame, columns) -> None:
        """One line naming the file when ``table`` lacks any of ``columns``, has no rows, or holds
        other than numbers in a column that must hold numbers (:data:`NUMBERS`)."""
        path = self.path(name)
        missing = [c for c in columns if c not in table.columns]
        if missing:
            raise UserError(f"report: {path} lacks the columns {missing} (not a whole {name} of ntkscope's)")
        if table.empty:
            raise UserError(f"report: {path} holds no rows")
        for column in (c for c in NUMBERS if c in table.columns):
            if not pd.api.types.is_numeric_dtype(table[column]):
                value = next((v for v in table[column] if not isinstance(v, (int, float))), table[column].iloc[0])
                raise UserError(f"report: {path}: column {column} must hold numbers (got {value!r})")

    def json(self, name: str) -> dict | None:
        path = self.path(name)
        return None if path is None else read_json_object(path, "report")


def kind_of(path: Path) -> str:
    """What ``path`` holds: "reproduction" (tables/ and a manifest or settings), "run"
    (checkpoints/, metrics.csv, or a Trainer's checkpoint-N folders) or "result" (a result.json,
    plan.json or CSV tables)."""
    if (path / "tables").is_dir() and ((path / "manifest.json").is_file() or (path / "settings.json").is_file()):
        return "reproduction"
    if (path / "checkpoints").is_dir() or (path / "metrics.csv").is_file() or (path / "track" / "gc.csv").is_file() \
            or (path / "inrun" / "inrun.csv").is_file() or trainer_checkpoints(path):
        return "run"
    if any(path.glob("*.json")) or any(path.glob("*.csv")):
        return "result"
    raise fail("report", "path", "must be a result directory (result.json, CSVs), a training run (checkpoints/, "
               "metrics.csv, a Trainer's checkpoint-N), a plan file or a reproduction (tables/, manifest.json)",
               str(path))


def _flag_notes(table: pd.DataFrame, what: str) -> list:
    flags = table["flags"].fillna("").astype(str) if "flags" in table else pd.Series([], dtype=str)
    found = sorted({f for row in flags for f in row.split()})
    return [f"{what}: {sum(f in row.split() for row in flags)} of {len(table)} measurements flagged '{f}' "
            f"({FLAG_WORDS.get(f, f)})." for f in found]


def _versus(row) -> str:
    words = {"below": "below", "within": "within", "above": "above"}
    text = (f"{row['label']}: |GC| {row['abs_gc']:.3f} [{row['abs_gc_low']:.3f}, {row['abs_gc_high']:.3f}] "
            f"(n = {int(row['n_subset'])}), {words.get(row.get('versus_null'), 'not compared with')} the random null "
            f"band [{row['null_low']:.3f}, {row['null_high']:.3f}]")
    if isinstance(row.get("versus_homogeneous"), str):
        text += f", {row['versus_homogeneous']} the homogeneous one"
    return text + "."


def _gc_groups(files: _Files) -> Section | None:
    name = "gc.csv" if files.path("gc.csv") and files.path("result.json") else "gc_by_bin.csv"
    # beside result.json, gc.csv is ntkscope gc's table (and gc_by_bin.csv a reproduction's): foreign
    # columns are one line naming the file, never a report without its GC section
    table = files.table(name, GC_GROUP)
    if table is None:
        return None
    if "output" in table:  # several outputs side by side: the report shows the first (the figures' output)
        table = table[table["output"] == table["output"].iloc[0]]
    hist = files.table("histogram.csv", ["left", "right", "count"], key="count")
    bins = table["label"].astype(str).str.startswith("bin ").all()
    if bins and hist is not None:  # the frequency-bin figure
        files.check(name, table, GC_BINS)
        files.check("histogram.csv", hist, ["percent"])
    section = Section("GC of each subset against the whole set",
                      "Gradient consistency of each frequency bin (or label) against all the analysis sentences, "
                      "with its interval, and the null bands: random subsets of the same size, homogeneous text, "
                      "and subsets matched on length and loss. A subset below the random null is less coherent with "
                      "the whole than chance; this is the long tail the CSE paper describes.")
    fig = gc_vs_frequency(table, hist) if bins and hist is not None else gc_by_label(table)
    section.figures.append(_png(fig))
    section.notes += [_versus(row) for _, row in table.iterrows()]
    section.notes += _flag_notes(table, "GC by subset")
    section.tables["gc by subset"] = table
    return section


def _frequency(files: _Files) -> Section | None:
    hist = files.table("histogram.csv", ["left", "right", "count"], key="count")
    if hist is None:
        return None
    section = Section("Sentence frequency", "The distribution of the analysis sentences' frequency scores (the "
                      "score is the mean log frequency of a sentence's tokens in the training text), drawn from its "
                      "bins: a bar's area is its share of the sentences, the dotted lines are the bins' edges.")
    section.figures.append(_png(score_histogram_bars(hist)))
    section.tables["histogram"] = hist
    return section


def _gc_steps(files: _Files) -> Section | None:
    frame = files.table("gc_over_steps.csv", GC_STEPS, key="step")
    source = "checkpoints"
    if frame is None and files.path("gc.csv") is not None and files.path("tracker.json") is not None:
        frame, source = files.table("gc.csv", GC_STEPS, key="step"), "the tracker's probes during training"
    if frame is None:
        return None
    labelled = "label" in frame
    section = Section("GC over training", f"|GC| of {'each subset' if labelled else 'the long-tail subset'} "
                      f"against the whole set at each step (from {source}), one figure per subset, named in its "
                      "title; below each, the excess over the random null's median with a 90 % band. A rise and fall "
                      "beyond the noise and against the null is the GC peak the plan reads.")
    parts = [("", frame)]
    if labelled:
        if "layer" in frame and (frame["layer"].astype(str) != "all").any():
            layers = frame[frame["layer"].astype(str) != "all"]
            layers = layers[layers["label"].isin(list(dict.fromkeys(layers["label"]))[:6])]  # as the figures below
            section.figures.append(_png(gc_per_layer(layers)))
            section.notes.append(f"Per layer: {layers['layer'].nunique()} layers' blocks of the kernel, "
                                 f"{len(layers)} rows, one line per layer in the per-layer figure.")
        frame = frame[frame["layer"].astype(str) == "all"] if "layer" in frame else frame
        parts = [(str(label), rows.drop(columns=["label", "layer"], errors="ignore"))
                 for label, rows in frame.groupby("label", sort=False)][:6]
    for label, rows in parts:
        peak = gc_peak(rows)
        title = f"GC over training{': ' + label if label else ''}"
        section.figures.append(_png(gc_over_steps(rows, warmup=peak["step"] if peak["shown"] else None,
                                                  rule="gc-peak", title=title, subset=label or "the long tail")))
        found = f"a GC peak at step {peak['step']}" if peak["shown"] else "no GC peak shown"
        section.notes.append(f"{label or 'long tail'}: {found} ({peak['why']}).")
        section.notes += _flag_notes(rows, label or "GC over training")
    if "kernel_cka" in frame and frame["kernel_cka"].notna().any():
        cka = frame.drop_duplicates("step")[["step", "kernel_cka"]].dropna()
        low = cka.loc[cka["kernel_cka"].idxmin()]
        section.notes.append(f"The kernel moved most between probes before step {int(low['step'])} (CKA "
                             f"{low['kernel_cka']:.3f} with the previous probe); the last probe's CKA is "
                             f"{cka['kernel_cka'].iloc[-1]:.3f}.")
    section.tables["gc over steps"] = frame
    return section


def _inrun(files: _Files) -> Section | None:
    """An InRunTracker's inrun.csv: each group's GC against its own step's batch."""
    table = files.table("inrun.csv", ["step", "label", "gc"], key="gc")
    if table is None:
        return None
    section = Section("In-run GC", "Each group of a measured training batch against that batch, from the step's own "
                      "forward and backward (InRunTracker): a batch of one group has no row.")
    section.figures.append(_png(inrun_series(table)))
    steps = table["step"].nunique()
    for label, rows in table.groupby("label", sort=False):
        rows = rows.sort_values("step")
        section.notes.append(f"{label}: GC {rows['gc'].mean():.3f} on average over {len(rows)} of the {steps} "
                             f"measured steps (first {rows['gc'].iloc[0]:.3f} at step {int(rows['step'].iloc[0])}, "
                             f"last {rows['gc'].iloc[-1]:.3f} at step {int(rows['step'].iloc[-1])}).")
    section.tables["in-run gc"] = table
    return section


def _dynamics(files: _Files) -> Section | None:
    table = files.table("dynamics.csv", ["step", "layer", "k", "k_silhouette", "silhouette", "inter_distance"])
    if table is None:
        return None
    router = files.table("router_dynamics.csv", ["step", "layer", "n_clusters", "n_pure_tail", "tail_share"])
    if router is not None:  # the kNN lift of every tail domain whose share it has
        files.check("router_dynamics.csv", router, [f"knn_lift {c.split(' ', 1)[1]}" for c in router.columns
                                                    if c.startswith("tail_share ")])
    section = Section("Cluster and router dynamics", "Per layer over training: the elbow K and the separation of "
                      "the layer's clusters, and (where measured) the CSE router's clusters, their purity and the "
                      "share of long-tail text in pure tail clusters.")
    section.figures.append(_png(layer_dynamics(table, router)))
    section.tables["cluster dynamics"] = table
    if router is not None:
        section.tables["router dynamics"] = router
        if "n_pure_tail" in router:
            first = router[router["n_pure_tail"] > 0]["step"]
            section.notes.append("Pure long-tail clusters first appear at step "
                                 f"{int(first.min())}." if len(first) else "No pure long-tail cluster appears.")
    return section


def _plan(files: _Files) -> Section | None:
    plan = files.json("plan.json")
    if plan is None:
        result = files.json("result.json") or {}
        plan = result.get("plan") if isinstance(result.get("plan"), dict) else None
    if plan is None or "layers" not in plan:
        return None
    evidence = plan.get("evidence") if isinstance(plan.get("evidence"), dict) else {}
    section = Section("The plan", "Which layers get CSE experts, and the dense warm-up before the router is fitted, "
                      "with the evidence behind each choice, as plan.json recorded them when the plan was made (the "
                      "sections below measure again from the tables).")
    section.notes.append(f"CSE layers {plan['layers']} ({plan.get('module', 'ffn')}), chosen by "
                         f"{plan.get('chosen_by', 'unknown')}.")
    warmup = plan_step(plan)
    section.notes.append(f"Dense warm-up: {warmup} steps" + (f", by the rule '{plan['warmup_rule']}'"
                                                              if plan.get("warmup_rule") else "") + "." if warmup
                         is not None else "No warm-up was chosen (no GC series or router dynamics).")
    peak = evidence.get("gc_peak")
    if isinstance(peak, dict):  # as the plan recorded it; beside it, what its table says today
        found = f"shown at step {peak.get('step')}" if peak.get("shown") else "not shown"
        series = files.table("gc_over_steps.csv", GC_STEPS, key="step")
        now = gc_peak(series) if series is not None and "label" not in series else None
        if now is None:
            section.notes.append(f"GC peak, as the plan recorded it when it was made: {found} ({peak.get('why', '')}).")
        elif bool(now["shown"]) == bool(peak.get("shown")) and (not now["shown"] or now["step"] == peak.get("step")):
            section.notes.append(f"GC peak: {found}, as the plan recorded it and as re-measured from "
                                 f"gc_over_steps.csv ({now['why']}).")
        else:
            again = f"shown at step {now['step']}" if now["shown"] else "not shown"
            section.notes.append(f"GC peak: {again}, re-measured now from gc_over_steps.csv ({now['why']}); the "
                                 f"plan recorded it as {found} when it was made (another version's statistics, or "
                                 "other draws), and its warm-up was chosen by that.")

    separation = evidence.get("separation")
    if isinstance(separation, list) and separation:
        section.tables["separation per layer (evidence)"] = pd.DataFrame(separation)
    return section


def _routing(files: _Files) -> Section | None:
    summary, routing = files.csv("routing_summary.csv"), files.table("routing.csv", ROUTING, key="share_of_domain")
    if summary is None and routing is None:
        return None
    section = Section("Routing", "Where each domain's text is routed by the sparse layers (with several models, "
                      "as ntkscope compare evaluates them: one row of panels per arm and seed).")
    if routing is not None:
        keys = ["layer", "expert", "domain", *[c for c in ("arm", "seed") if c in routing]]
        repeated = int(routing.duplicated(keys).sum())
        if repeated:
            raise UserError(f"report: {files.path('routing.csv')} has more than one row for one ({', '.join(keys)}) "
                            f"({repeated} repeated); the rows of several models need arm and seed columns")
        section.figures.append(_png(routing_shares(routing)))
        section.tables["routing"] = routing
    if summary is not None:
        section.tables["routing table"] = summary
    return section


def _experts(files: _Files) -> Section | None:
    """``ntkscope eval``'s expert report: findings in words, then per layer, per expert and per ablation."""
    layers = files.table("expert_layers.csv", ["layer", "name", "purity", "purity_low", "purity_high", "nmi",
                                               "nmi_low", "nmi_high"], key="purity")
    if layers is None:
        return None
    section = Section("What the experts learned", "Per sparse layer: how purely its experts serve the labels "
                      "(purity, NMI), each expert's load and the domain it serves most, and the perplexity change "
                      "of each domain when one expert is taken out (its units sent to the next-best expert); each "
                      "number with its interval.")
    findings = (files.json("result.json") or {}).get("findings")
    section.notes += [str(f) + "." for f in findings] if isinstance(findings, list) else []
    if {"purity_majority", "purity_null", "nmi_null"} <= set(layers.columns):  # each measure beside its baselines
        for _, row in layers.iterrows():
            section.notes.append(
                f"{row['layer']}: purity {row['purity']:.3f} [{row['purity_low']:.3f}, {row['purity_high']:.3f}] against "
                f"{row['purity_majority']:.3f} for one expert taking all and {row['purity_null']:.3f} with the labels "
                f"shuffled; NMI {row['nmi']:.3f} against {row['nmi_null']:.3f} shuffled.")
    section.figures.append(_png(expert_layers(layers)))
    section.tables["expert layers"] = layers
    for name, caption in (("experts.csv", "experts"), ("ablation.csv", "one expert ablated"),
                          ("expert_kernels.csv", "inside the experts: split-half |GC| of each expert's kernel"),
                          ("expert_gc.csv", "inside the experts: each label's GC among an expert's units")):
        table = files.csv(name)
        if table is not None:
            section.tables[caption] = table
    kernels = files.csv("expert_kernels.csv")
    if kernels is not None and len(kernels):
        section.notes.append(_inside(kernels))
    return section


def _inside(kernels: pd.DataFrame) -> str:
    """One sentence on the per-expert kernels: the most and the least consistent expert."""
    ranked = kernels.sort_values("consistency", ascending=False)
    first, last = ranked.iloc[0], ranked.iloc[-1]
    words = (f"Inside the experts ({len(kernels)} with 4 units or more; consistency is the median |GC| of random "
             f"halves of an expert's routed units against all of them, 1 when every gradient is parallel): the most "
             f"consistent is expert {first['expert']} of {first['layer']} ({first['consistency']:.3f} "
             f"[{first['consistency_low']:.3f}, {first['consistency_high']:.3f}], {first['units']} "
             f"{first['unit']}s, {first['top_share']:.0%} {first['top_label']})")
    if len(ranked) > 1:
        words += (f", the least expert {last['expert']} of {last['layer']} ({last['consistency']:.3f} "
                  f"[{last['consistency_low']:.3f}, {last['consistency_high']:.3f}], {last['top_share']:.0%} "
                  f"{last['top_label']})")
    return words + "."


def _results(files: _Files) -> Section | None:
    found = {name: files.csv(f"{name}.csv") for name in ("results", "seeds_summary", "perplexity", "comparison")}
    found = {k: v for k, v in found.items() if v is not None}
    if not found:
        return None
    probes = any("probe" in str(c) for t in found.values() for c in t.columns)
    section = Section("Perplexity and probes" if probes else "Perplexity",
                      "Test perplexity per domain" + (" and probing accuracy" if probes else "") + " of the trained "
                      "models (lower perplexity is better).", tables=found)
    comparison = found.get("comparison")
    if comparison is not None and {"arm", "domain", "vs_dense", "seed"} <= set(comparison.columns):
        seeds = comparison["seed"].nunique()
        for domain, rows in comparison[comparison["arm"] != "dense"].groupby("domain", sort=False):
            change = rows.groupby("arm", sort=False)["vs_dense"].mean()
            section.notes.append(f"{domain}: " + ", ".join(f"{arm} {100 * v:+.1f} %" for arm, v in change.items())
                                 + f" perplexity against dense ({seeds} seed{'s' if seeds > 1 else ''}, mean).")
        shown = comparison.copy()
        shown["vs_dense"] = shown["vs_dense"].map(lambda v: f"{100 * v:+.1f} %")
        found["comparison"] = shown
        start = (files.json("result.json") or {}).get("start")
        if isinstance(start, str):
            section.notes.append(f"Setup: {start.removeprefix('compare: ')}.")
    return section


def _trainer_metrics(files: _Files) -> pd.DataFrame | None:
    """A Trainer run's logged training loss and learning rate (its last checkpoint's
    trainer_state.json ``log_history``), as metrics.csv's columns."""
    if files.only is not None:
        return None
    found = trainer_checkpoints(files.root)
    if not found:
        return None
    try:
        state = read_json_object(found[-1] / "trainer_state.json", "report")
    except UserError as err:  # a damaged state: the page goes on without the training curve, and says why
        log.warning("%s", err)
        return None
    rows = [{"step": r["step"], "loss": r["loss"], "lr": r.get("learning_rate")}
            for r in state.get("log_history") or [] if isinstance(r, dict) and "loss" in r and "step" in r]
    return pd.DataFrame(rows) if rows else None


def _training(files: _Files) -> Section | None:
    metrics = files.table("metrics.csv", ["step", "loss"], key="loss")
    if metrics is None:
        metrics = _trainer_metrics(files)
    if metrics is None:
        return None
    section = Section("Training", "The run's training loss and learning rate.")
    section.figures.append(_png(training_curve(metrics)))
    section.notes.append(f"{int(metrics['step'].max())} steps; final training loss {metrics['loss'].iloc[-1]:.3f}.")
    return section


def _made_by(root: Path, kind: str, files: _Files) -> Section:
    section = Section("What made this", "The commands, versions and inputs behind these results.")
    made = {}
    manifest = files.json("manifest.json")
    if kind == "reproduction" and manifest:
        if manifest.get("mode"):
            section.notes.append(f"Command: ntkscope reproduce --{manifest['mode']} {root}")
        made.update({"environment": manifest.get("environment"), "settings": manifest.get("settings"),
                     "corpus pack version": manifest.get("pack_version")})
    for name in ("result.json", "tracker.json", "train_config.json", "plan.json"):
        data = files.json(name)
        if not data:
            continue
        source = data.get("source") if isinstance(data.get("source"), dict) else {}
        provenance = data.get("provenance") or source.get("provenance")
        if isinstance(provenance, dict) and provenance:
            if provenance.get("command"):
                section.notes.append(f"Command: {provenance['command']}")
            made[f"{name}: provenance"] = provenance
        if data.get("options"):
            made[f"{name}: options"] = data["options"]
        if name == "train_config.json":
            section.notes.append(f"Command: cse-train {root / name}")
            made[name] = data
    made["this report"] = environment()
    section.tables["made by"] = made
    return section


def _glossary(sections: list) -> Section:
    columns = {c: None for s in sections for t in s.tables.values() if isinstance(t, pd.DataFrame) for c in t.columns}
    rows = [(c, describe(str(c)) or "not described") for c in columns]
    return Section("Glossary", "Every column of the tables above.", tables={
        "glossary": pd.DataFrame(rows, columns=["column", "meaning"])})


STYLE = """body{font-family:sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;color:#222;line-height:1.4}
h1{font-size:1.6em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
table{border-collapse:collapse;font-size:.78em;margin:.6em 0;display:block;overflow-x:auto}
td,th{border:1px solid #ddd;padding:.2em .45em;text-align:right}th{background:#f3f3f3}
td:first-child,th:first-child{text-align:left}img{max-width:100%}.notes li{margin:.25em 0}
pre{background:#f6f6f6;padding:.6em;font-size:.75em;overflow-x:auto}.muted{color:#777;font-size:.85em}
details{margin:.3em 0 1em}summary{cursor:pointer;color:#2e5c8a;font-size:.85em}"""


def _table_html(caption: str, table) -> str:
    if isinstance(table, dict):
        text = strict_json(table, indent=1)  # NaN as null, paths and dtypes as text
        return f"<h3>{html.escape(caption)}</h3><pre>{html.escape(text)}</pre>"
    def body(frame):
        return frame.to_html(index=False, float_format=lambda v: f"{v:.4g}", na_rep="", border=0, escape=True)

    head = f"<h3>{html.escape(caption)}</h3>"
    if len(table) <= MAX_ROWS and table.shape[1] <= MAX_COLUMNS:
        return head + body(table)
    shown = table.iloc[:MAX_ROWS, :MAX_COLUMNS]
    folded = ("The whole table" if len(table) <= FOLDED_ROWS else f"The first {FOLDED_ROWS} rows (its CSV holds "
              "the rest)") + f" ({len(table)} rows × {table.shape[1]} columns)"
    return (f"{head}{body(shown)}<p class='muted'>{len(shown)} of {len(table)} rows and {shown.shape[1]} of "
            f"{table.shape[1]} columns here.</p><details><summary>{folded}</summary>"
            f"{body(table.head(FOLDED_ROWS))}</details>")


def render(title: str, sections: list) -> str:
    """The page: a table of contents, then each section's text, notes, figures and tables."""
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1><ol>"]
    parts += [f"<li><a href='#s{i}'>{html.escape(s.title)}</a></li>" for i, s in enumerate(sections)]
    parts.append("</ol>")
    for i, s in enumerate(sections):
        parts.append(f"<section id='s{i}'><h2>{html.escape(s.title)}</h2><p>{html.escape(s.text)}</p>")
        if s.notes:
            parts.append("<ul class='notes'>" + "".join(f"<li>{html.escape(n)}</li>" for n in s.notes) + "</ul>")
        for png in s.figures:
            data = base64.b64encode(png).decode()
            parts.append(f"<p><img alt='{html.escape(s.title)}' src='data:image/png;base64,{data}'></p>")
        parts += [_table_html(caption, table) for caption, table in s.tables.items()]
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)


def report(path, out=None) -> dict:
    """Write one self-contained HTML page of the analysis in ``path`` to ``out`` (default
    ``PATH/report.html``). Returns {"path", "kind", "sections", "undescribed": columns without a
    glossary entry}."""
    root, only = Path(path), None
    if root.is_file() and root.suffix == ".json":  # a plan file (ntkscope plan --out FILE)
        if "layers" not in read_json_object(root, "report") or "evidence" not in read_json_object(root, "report"):
            raise fail("report", "path", "must be a plan file (ntkscope plan's JSON: layers and evidence), or a "
                       "directory", str(root))
        only, out = {"plan.json": root}, out if out is not None else root.with_suffix(".html")
        kind, root = "plan", root.parent
    elif not root.is_dir():
        raise MissingInput(f"report: path {root} is not a directory (nor a plan file)")
    else:
        kind = kind_of(root)
    out = Path(out) if out is not None else root / "report.html"
    if out.suffix.lower() not in (".html", ".htm"):
        raise fail("report", "out", "must end in .html", str(out))
    files = _Files(root, only)
    builders = (_plan, _frequency, _gc_groups, _gc_steps, _inrun, _dynamics, _experts, _routing, _results, _training)
    sections = [s for s in (build(files) for build in builders) if s is not None]
    if not sections:
        raise fail("report", "path", "holds no table this report knows (gc.csv, gc_over_steps.csv, dynamics.csv, "
                   "plan.json, metrics.csv, ...)", str(root))
    sections.append(_made_by(root, kind, files))
    glossary = _glossary(sections)
    sections.append(glossary)
    headline = []  # each section's first finding, said here and not again below
    for section in sections[:-2]:
        if section.notes:
            headline.append(f"{section.title}: {section.notes[0]}")
            section.notes = section.notes[1:]
    summary = Section("What was found", f"A summary of the {kind} in {path}: each section's first finding (the "
                      "others are in its section).", notes=headline)
    page = render(f"ntkscope report: {root.name}", [summary, *sections])
    write_text(out, page)
    undescribed = glossary.tables["glossary"].query("meaning == 'not described'")["column"].tolist()
    log.info("report: %s (%d sections, %d kB)", out, len(sections), len(page) // 1024)
    return {"path": out, "kind": kind, "sections": [s.title for s in sections], "undescribed": undescribed}


