"""The numbers README.md and docs/ quote about a committed run, computed from the files the run wrote.

A quoted number sits between markers that name its claim::

    the three rarest bins lie below it (|GC| <!--claim:tail.fig2a.abs_gc.0-->0.838<!--/claim-->, ...)

(the markers do not show in rendered Markdown). :func:`claims` computes every claim from the
committed runs of a checkout it is given (``figures/tail``, ``figures/tables``, ``figures/tables-late``,
``docs/router-table.csv``, ...); :func:`render` rewrites the text between markers from them
(``python scripts/render_claims.py [--root DIR] README.md docs/*.md``, from a checkout),
and :func:`mismatches` lists the markers
whose text differs or whose claim is unknown (the test that keeps the README honest).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

from ntkscope.core.files import write_text
from ntkscope.representation.plan import gc_peak, plan_step, stable_step
from ntkscope.runs.dynamics import STABILITY_COLUMNS as STABILITY

from doc_claims.experiments import (claim_budget, claim_experts, claim_gc_statistics, claim_gpu_gc, claim_inrun,
                                    claim_inrun_sketch, claim_own_model, claim_p1, claim_p7, claim_sweep, claim_tail_rule,
                                    claim_tracked, claim_tracker, claim_training_step)
from doc_claims.values import Tables, fmt, fmt_range, fmt_signed_range, fmt_steps
from doc_claims.warmup_map import claim_warmup_map

MARKER = re.compile(r"<!--claim:([\w.\-]+)-->(.*?)<!--/claim-->", re.S)


# ---- the tail run -------------------------------------------------------------------------------


def _fig2a(t: Tables) -> dict:
    gc = t["gc_by_bin"].sort_values("left").reset_index(drop=True)
    out = {"tail.fig2a.n": str(int(gc["n"].iloc[0])), "tail.fig2a.bins": str(len(gc)),
           "tail.fig2a.bin_size": fmt_range(gc["n_subset"], 0)}
    for k, row in gc.iterrows():
        out[f"tail.fig2a.abs_gc.{k}"] = fmt(row["abs_gc"])
        out[f"tail.fig2a.interval.{k}"] = f"[{fmt(row['abs_gc_low'])}, {fmt(row['abs_gc_high'])}]"
        out[f"tail.fig2a.mean_gradient.{k}"] = fmt(row["mean_gradient"])
    out["tail.fig2a.null_random"] = f"{fmt_range(gc['null_low'], 3)} to {fmt_range(gc['null_high'], 3)}"
    out["tail.fig2a.null_homogeneous"] = (f"{fmt_range(gc['null_homogeneous_low'], 3)} to "
                                          f"{fmt_range(gc['null_homogeneous_high'], 3)}")
    for name in ("null", "homogeneous", "matched-length", "matched-loss"):
        column = "versus_null" if name == "null" else f"versus_{name}"
        for verdict in ("below", "within", "above"):
            out[f"tail.fig2a.{verdict}.{name}"] = fmt_steps(np.flatnonzero(gc[column] == verdict))
    flagged = gc["flags"].fillna("").astype(str) != ""
    out["tail.fig2a.flagged"] = fmt_steps(np.flatnonzero(flagged))
    out["tail.fig2a.flags"] = ", ".join(sorted({f for fl in gc["flags"].fillna("") for f in str(fl).split()})) or "none"
    m = gc["mean_gradient"]
    out["tail.fig2a.mean_gradient.max_bin"] = str(int(m.idxmax()))
    out["tail.fig2a.mean_gradient.max"] = fmt(m.max())
    out["tail.fig2a.se_range"] = fmt_range(gc["abs_gc_se"], 3)
    out["tail.fig2a.bias_range"] = fmt_range(gc["abs_gc_bias"], 3)
    outputs = t["gc_outputs"]
    for output, rows in outputs.groupby("output"):
        rows = rows.sort_values("left")
        out[f"tail.fig2a.{output}.below"] = fmt_steps(np.flatnonzero(rows["versus_null"] == "below"))
        out[f"tail.fig2a.{output}.flagged"] = str(int((rows["flags"].fillna("").astype(str) != "").sum()))
        out[f"tail.fig2a.{output}.abs_gc"] = fmt_range(rows["abs_gc"], 3)
    return out


def _fig3a(t: Tables) -> dict:
    gc = t["gc_over_steps"]
    peak = gc_peak(gc)
    out = {"tail.fig3a.draws": str(int(gc["draw"].nunique())) if "draw" in gc else "1",
           "tail.fig3a.checkpoints": str(int(gc["step"].nunique())),
           "tail.fig3a.peak.step": str(peak["step"]), "tail.fig3a.peak.shown": "shown" if peak["shown"] else "not shown",
           "tail.fig3a.peak.rise_z": "n/a" if peak["rise_z"] is None else fmt(peak["rise_z"], 2),
           "tail.fig3a.peak.fall_z": "n/a" if peak["fall_z"] is None else fmt(peak["fall_z"], 2),
           "tail.fig3a.peak.left_out": fmt_steps(peak["left_out"])}
    mean = gc.groupby("step")[["abs_gc", "null_median", "null_low", "null_high"]].mean()
    excess = mean["abs_gc"] - mean["null_median"]
    for step in (int(mean.index.min()), 75, int(mean.index.max())):
        if step in mean.index:
            out[f"tail.fig3a.abs_gc.{step}"] = fmt(mean.at[step, "abs_gc"])
            out[f"tail.fig3a.null_median.{step}"] = fmt(mean.at[step, "null_median"])
            out[f"tail.fig3a.excess.{step}"] = f"{excess.at[step]:+.3f}".replace("-", "−")
    out["tail.fig3a.null_median.max_step"] = str(int(mean["null_median"].idxmax()))
    unflagged = [s for s in excess.index if s not in set(peak["left_out"])]
    out["tail.fig3a.excess_range"] = fmt_range(excess[unflagged], 3)
    out["tail.fig3a.excess.max_step"] = str(int(excess.idxmax()))
    below = gc.groupby("step")["versus_null"].apply(lambda v: (v == "below").all())  # the interval clears the band
    out["tail.fig3a.below_random"] = str(int(below.sum()))
    rechecked = t.folder / "plan_rechecked.json"
    if rechecked.is_file():
        plan = t["plan_rechecked.json"]
        out["tail.plan_rechecked.rule"] = str(plan["warmup_rule"])
        out["tail.plan_rechecked.warmup"] = str(plan_step(plan))
        out["tail.plan_rechecked.layers"] = ", ".join(str(x) for x in plan["layers"])
    if "versus_homogeneous" in gc:
        below = gc.groupby("step")["versus_homogeneous"].apply(lambda v: (v == "below").all())
        out["tail.fig3a.below_homogeneous"] = str(int(below.sum()))
    return out


def _router(t: Tables) -> dict:
    r = t["router_dynamics"]
    out = {}
    for domain in ("biomedical", "legal"):
        pure = r[r[f"tail_share {domain}"] > 0]
        first = pure.groupby("layer")["step"].min()
        for layer in sorted(r["layer"].unique()):
            out[f"tail.router.first_{domain}.layer{layer}"] = str(int(first[layer])) if layer in first else "never"
        out[f"tail.router.first_{domain}"] = str(int(first.min())) if len(first) else "never"
        out[f"tail.router.{domain}_every_layer_by"] = (str(int(first.max())) if len(first) == r["layer"].nunique()
                                                       else "never")
    first_any = min([int(v) for k, v in out.items() if k.startswith("tail.router.first_") and v != "never"],
                    default=None)
    before = r[r["step"] < first_any] if first_any is not None else r
    out["tail.router.clusters_before_tail"] = fmt_range(before["n_clusters"], 0)
    out["tail.router.ari_range"] = fmt_range(r["overlap_next"].dropna(), 2)
    plan = t["plan.json"]
    stable = stable_step(r[STABILITY], plan["layers"], overlap=0.8)
    out["tail.router.stable_step"] = "none" if stable is None else str(stable)
    legal = r[r["tail_share legal"] > 0].sort_values("step")
    if len(legal):
        out["tail.router.first_legal_layers"] = ", ".join(str(int(x)) for x in
                                                           sorted(legal[legal["step"] == legal["step"].min()]["layer"]))
        out["tail.router.first_legal_share"] = f"{100 * legal['tail_share legal'].iloc[0]:.0f} %"
    kept = r.groupby("step")["tail_share biomedical"].apply(lambda v: (v > 0).all()).sort_index()
    from_step = next((s for i, s in enumerate(kept.index) if kept.iloc[i:].all()), None)
    out["tail.router.biomedical_kept_from"] = "never" if from_step is None else str(int(from_step))
    if from_step is not None:
        out["tail.router.share_when_kept"] = fmt_range(r[r["step"] == int(from_step)]["tail_share"], 2)
    end = r[r["step"] == r["step"].max()]
    out["tail.router.end_step"] = str(int(r["step"].max()))
    out["tail.router.end_biomedical"] = fmt_range(100 * end["tail_share biomedical"], 0, " %")
    out["tail.router.end_tail_share"] = fmt_range(end["tail_share"], 2)
    lift = [c for c in r.columns if c in ("knn_lift legal", "knn_lift biomedical")]
    start = r[r["step"] == r["step"].min()]
    out["tail.router.start_step"] = str(int(r["step"].min()))
    out["tail.router.lift_start"] = fmt_range(start[lift].to_numpy(), 0)
    out["tail.router.lift_end"] = fmt_range(end[lift].to_numpy(), 0)
    return out


def _fig3b(t: Tables) -> dict:
    d = t["dynamics"]
    steps = sorted(d["step"].unique())
    one = d.groupby("step")["k_silhouette"].apply(lambda k: (k == 1).all())
    from_step = next((s for i, s in enumerate(steps) if one[steps[i:]].all()), None)
    early = d[d["step"] < (from_step or steps[-1] + 1)]
    out = {"tail.fig3b.elbow_k3": f"{int((d['k'] == 3).sum())} of {len(d)}",
           "tail.fig3b.silhouette_one_from": str(from_step) if from_step is not None else "never",
           "tail.fig3b.silhouette_early_max": fmt(float(early["silhouette"].max()), 2)}
    if from_step is not None:
        out["tail.fig3b.silhouette_late"] = fmt_range(d[d["step"] >= from_step]["silhouette"], 2)
    return out


def _fig3c(t: Tables) -> dict:
    d = t["dynamics"]
    first, last = d[d["step"] == d["step"].min()], d[d["step"] == d["step"].max()]
    mean = d.groupby("step")["separation"].mean()
    return {"tail.fig3c.first_step": str(int(d["step"].min())), "tail.fig3c.last_step": str(int(d["step"].max())),
            "tail.fig3c.distance.first": fmt_range(first["inter_distance"], 1),
            "tail.fig3c.distance.last": fmt_range(last["inter_distance"], 1),
            "tail.fig3c.separation.peak_step": str(int(mean.idxmax())),
            "tail.fig3c.separation.peak": fmt(float(mean.max()), 2),
            "tail.fig3c.separation.last": fmt_range(last["separation"], 2)}


def _fig1(t: Tables) -> dict:
    b = t["perplexity_by_bin"].sort_values("bin").reset_index(drop=True)
    out = {"tail.fig1.n": str(int(b["n"].sum()))}
    for name, k in (("first", 0), ("second", 1), ("second_last", len(b) - 2), ("last", len(b) - 1)):
        out[f"tail.fig1.{name}.median"] = fmt(float(b["median_perplexity"].iloc[k]), 0)
        out[f"tail.fig1.{name}.n"] = str(int(b["n"].iloc[k]))
    return out


def _fig4(t: Tables) -> dict:
    c = t["snapshot_clusters"]
    c = c[c["cluster"] >= 0]
    steps = sorted(c["step"].unique())
    out = {"tail.fig4.steps": ", ".join(str(int(s)) for s in steps[:-1]) + f" and {int(steps[-1])}"}
    for step in steps:
        rows = c[c["step"] == step]
        key = f"tail.fig4.{int(step)}"
        out[f"{key}.clusters"] = str(len(rows))
        pure = rows[rows["share biomedical"] >= 0.8].sort_values("size", ascending=False)
        out[f"{key}.pure_biomedical"] = (f"{int(pure['size'].iloc[0])} blocks, {100 * pure['share biomedical'].iloc[0]:.0f} %"
                                         if len(pure) else "none")
        legal = rows.sort_values("share legal", ascending=False).iloc[0]
        out[f"{key}.most_legal"] = f"{int(legal['size'])} blocks, {100 * legal['share legal']:.0f} % legal"
    return out


PROBES = ("biomedical-go-ontology", "clinical-hpo-organ-system", "general-wordnet-lexname", "legal-licence-category")


def _tail_tables(t: Tables) -> dict:
    """The README's copies of Tables 1-2's analogue and the seeds comparison, a row per claim
    (the cells between the row's outer bars)."""
    out = {}
    for i, row in t["results"].iterrows():
        cells = [row["model"], *(fmt(row[c], 1) for c in ("perplexity", "ppl biomedical", "ppl general", "ppl legal")),
                 *(str(row[c]) for c in PROBES), fmt(row["average"])]
        out[f"tail.table.results.{i}"] = " | ".join(cells)
    for i, row in t["seeds_summary"].iterrows():
        def cell(column, digits):
            return f"{fmt(row[f'{column} mean'], digits)} ± {fmt(row[f'{column} std'], digits)}"
        cells = [row["model"], *(cell(c, 1) for c in ("perplexity", "ppl biomedical", "ppl general", "ppl legal")),
                 *(cell(c, 3) for c in (*PROBES, "average"))]
        out[f"tail.table.seeds.{i}"] = " | ".join(cells)
    return out


def _paper_tables(t: Tables, prefix: str = "tables", archs=("bert", "gpt")) -> dict:
    """Our columns of the README's Tables 1-2 (test, legal, biomedical, general perplexity and
    the probe average, mean ± std over seeds), a row per claim; the paper's columns are quotes."""
    out = {}
    for arch in archs:
        for i, row in t[f"table_{arch}"].iterrows():
            cells = [f"{fmt(row[f'{c} mean'], d)} ± {fmt(row[f'{c} std'], d)}" for c, d in
                     (("perplexity", 1), ("ppl legal", 1), ("ppl biomedical", 1), ("ppl general", 1), ("average", 3))]
            out[f"{prefix}.table.{arch}.{i}"] = " | ".join(cells)
    return out


def _late_tables(t: Tables) -> dict:
    """The GPT rows at the sweep's warm-up (figures/tables-late): the table's rows and cells, each
    test's verdict (``tables-late.test.ROW.AGAINST.METRIC``: "better/worse/not shown (p = ...)"), the
    general-tasks changes, and the run's time."""
    out = _paper_tables(t, "tables-late", ("gpt",)) | cells("tables-late.gpt", t["table_gpt"], "model")
    tests = t["table_tests"]
    out["tables-late.tests.n"] = str(len(tests))
    out["tables-late.tests.shown"] = str(int((tests["verdict"] != "not shown").sum()))
    for row in tests.to_dict("records"):
        key = f"tables-late.test.{_slug(row['row'])}.{_slug(row['against'])}.{_slug(row['metric'])}"
        out[key] = f"{row['verdict']} (p = {fmt(row['welch_p'])})"
    general = t["general_tasks"]
    out |= cells("tables-late.general", general.assign(row=general["model"]), "row")
    timings = t["timings.json"]
    out["tables-late.timings.total_min"] = fmt(sum(timings.values()) / 60, 1)
    out["tables-late.adopted"] = str(len(t["adopted.json"]))
    return out


def _slug(value) -> str:
    return re.sub(r"[^\w\-]", "_", str(value))


def cells(prefix: str, table: pd.DataFrame, key: str) -> dict:
    """Every cell of ``table`` as a claim ``PREFIX.ROW.COLUMN`` (ROW: the ``key`` column's value,
    COLUMN: the column's name, each with every character but letters, digits, ``_`` and ``-`` as
    ``_``): perplexities with 1 decimal, other numbers with 3, text as it is; and for each pair
    ``X mean`` / ``X std`` a claim ``PREFIX.ROW.X`` of "mean ± std" (a column named X itself
    becomes ``X_value``)."""
    out = {}
    pairs = {_slug(c[:-5]) for c in table.columns if c.endswith(" mean") and f"{c[:-5]} std" in table.columns}
    for row in table.to_dict("records"):  # keeps each column's type: integers stay integers
        name = f"{prefix}.{_slug(row[key])}"
        for column, value in row.items():
            digits = 1 if ("ppl" in column or "perplexity" in column) else 3
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
                text = str(value)
            elif isinstance(value, (int, np.integer)):
                text = str(int(value))
            else:
                text = fmt(float(value), digits)
            slug = _slug(column)
            out[f"{name}.{slug}_value" if slug in pairs else f"{name}.{slug}"] = text  # a pair's name is its "mean ± std"
            if "share" in column and isinstance(value, float):
                out[f"{name}.{_slug(column)}_pct"] = f"{100 * value:.0f} %"
            if column.endswith(" mean") and f"{column[:-5]} std" in row:
                out[f"{name}.{_slug(column[:-5])}"] = f"{text} ± {fmt(float(row[column[:-5] + ' std']), digits)}"
    return out


def _original_run(t: Tables) -> dict:
    """Figures 2b and 5 and the tables' prose: the original run's CSE, Switch and finetuned models."""
    out = cells("tail.results", t["results"], "model") | cells("tail.seeds", t["seeds_summary"], "model")
    out |= cells("tail.routing", t["routing_summary"], "expert") | cells("tail.expert_ntk", t["expert_ntk"], "expert")
    fit = t["fit_points"]
    sizes = fit[fit["cluster"] >= 0].groupby("cluster").size().sort_values(ascending=False)
    out["tail.fit.clusters"] = str(len(sizes))
    out["tail.fit.sizes"] = ", ".join(str(int(v)) for v in sizes)
    big = fit[fit["cluster"].isin(sizes.index[:2])]
    shares = pd.crosstab(big["cluster"], big["domain"], normalize="index")
    out["tail.fit.tail_in_big"] = fmt_range(100 * shares[["legal", "biomedical"]].to_numpy(), 0, " %")
    routing = t["routing_summary"]
    out["tail.routing.n"] = str(int(routing["n"].sum()))
    out["tail.routing.experts"] = str(len(routing))
    for domain in ("legal", "biomedical"):
        out[f"tail.routing.total_{domain}"] = str(int(routing[f"n {domain}"].sum()))
    return out


def _paper_cells(t: Tables) -> dict:
    out = cells("tables.gpt", t["table_gpt"], "model") | cells("tables.bert", t["table_bert"], "model")
    general = t["general_tasks"]
    out |= cells("tables.general", general.assign(row=general["arch"] + "-" + general["model"]), "row")
    tests = t["table_tests"]
    out["tables.tests.n"] = str(len(tests))
    out["tables.tests.shown"] = str(int((tests["verdict"] != "not shown").sum()))
    return out


def _fitting(t: Tables) -> dict:
    domains = t["fit_points"]["domain"].value_counts()
    return {f"tail.fitting.{d}": str(int(domains.get(d, 0))) for d in ("general", "legal", "biomedical")} | \
        {"tail.fitting.n": str(int(domains.sum()))}


# ---- the tables run and the router table --------------------------------------------------------


def _general_tasks(t: Tables) -> dict:
    g = t["general_tasks"]
    tuned = g[g["model"].str.contains(r"/(?:legal|biomedical)$") & g["ppl_general change mean"].notna()]
    out = {}
    for arch in ("gpt", "bert"):
        rows = tuned[tuned["arch"] == arch]
        out[f"tables.general.{arch}.tuned_change"] = fmt_signed_range(rows["ppl_general change mean"])
        base = g[(g["arch"] == arch) & (g["model"] == g["against"])]["ppl_general mean"]
        out[f"tables.general.{arch}.base"] = fmt(float(base.iloc[0]), 0)
    return out


def _timings(t: Tables) -> dict:
    timings = t["timings.json"]

    def seconds(pattern: str) -> list:
        return [v for k, v in timings.items() if re.fullmatch(pattern, k)]

    dense = seconds(r"train table-\w+-dense-seed\d")
    branches = seconds(r"train table-\w+-(switch|cse-mof|cse-moa|demix)-seed\d")
    tuned = seconds(r"train table-\w+-\w+-(legal|biomedical)-seed\d")
    train = [v for k, v in timings.items() if k.startswith("train ")]
    evaluate = [v for k, v in timings.items() if k.startswith("evaluate ")]
    return {"tables.timings.total_min": fmt(sum(timings.values()) / 60, 1),
            "tables.timings.train_min": fmt(sum(train) / 60, 1), "tables.timings.evaluate_min": fmt(sum(evaluate) / 60, 1),
            "tables.timings.dense": fmt_range(dense, 0, " s"), "tables.timings.branches": fmt_range(branches, 0, " s"),
            "tables.timings.branches_but_max": fmt_range(sorted(branches)[:-1], 0, " s"),
            "tables.timings.branch_max": fmt(max(branches), 0) + " s", "tables.timings.tuned": fmt_range(tuned, 0, " s")}


RULES = {"dbscan-knee": "knee", "dbscan-percentile percentile=10.0": "pct10", "hdbscan min_cluster_size=5": "h5",
         "hdbscan min_cluster_size=15": "h15", "hdbscan min_cluster_size=30": "h30",
         "hdbscan min_cluster_size=15 selection=leaf": "h15leaf"}


def _router_rows(table: pd.DataFrame) -> dict:
    """docs/router.md's table: per (step, rule, representation, d') the cells clusters | pure |
    pure tail | tail share | legal | biomedical | ARI, as ``docs.router.row.STEP.RULE.REPR.D``."""
    out = {}
    for row in table.to_dict("records"):
        cells = [str(row["n_clusters"]), str(row["n_pure"]), str(row["n_pure_tail"]),
                 *(fmt(row[c], 2) for c in ("tail_share", "tail_share legal", "tail_share biomedical", "ari"))]
        name = f"docs.router.row.{row['step']}.{RULES[row['rule']]}.{row['representation']}.{row['proj_dim']}"
        out[name] = " | ".join(c.replace("-", "−") for c in cells)
    return out


def _router_table(table: pd.DataFrame) -> dict:
    keyed = table.assign(row=[f"{r.step}_{RULES[r.rule]}_{r.representation}_{r.proj_dim}" for r in table.itertuples()])
    out = _router_rows(table) | cells("docs.routercell", keyed, "row")
    knee = table[table["rule"] == "dbscan-knee"]
    out["docs.router.knee.clusters"] = fmt_range(knee["n_clusters"], 0)
    for step in sorted(knee["step"].unique()):
        out[f"docs.router.knee.clusters.{step}"] = fmt_range(knee[knee["step"] == step]["n_clusters"], 0)
    dense = table[(table["step"] == table["step"].max()) & (table["representation"] == "centred-cosine")
                  & (table["rule"] != "dbscan-knee")]
    out["docs.router.density_tail_share"] = fmt_range(dense["tail_share"], 2)
    out["docs.router.density_tail_share.nonzero"] = fmt_range(dense[dense["tail_share"] > 0]["tail_share"], 2)
    lost = dense[dense["rule"].str.contains("min_cluster_size=30") & (dense["proj_dim"] == 32)]
    out["docs.router.hdbscan30_32"] = fmt(float(lost["tail_share"].iloc[0]), 2)
    legal = knee[knee["step"] == 800]["tail_share legal"].max()
    out["docs.router.knee.legal_800"] = f"{100 * legal:.0f} %"
    return out


def _by_noise(rows: pd.DataFrame, method: str) -> dict:
    """docs/gc-calibration.md's table by planted noise kind: coverage and width ranges of ``method``."""
    out = {}
    for kind, part in rows.groupby("noise"):
        key = f"docs.calibration.{method}.{kind.replace(', ', '-').replace(' ', '-')}"
        out[f"{key}.coverage"] = fmt_range(part["coverage"], 2)
        out[f"{key}.width"] = fmt_range(part["median_width_over_sd"], 1)
    return out


def _calibration(planted: pd.DataFrame, real: pd.DataFrame | None) -> dict:
    """docs/gc-calibration.md: the planted pools per interval method, and the real kernels."""
    out = {}
    for method, rows in planted.groupby("method"):
        out[f"docs.calibration.{method}.coverage"] = fmt_range(rows["coverage"], 2)
        out[f"docs.calibration.{method}.width"] = fmt_range(rows["median_width_over_sd"], 1)
        biased = rows["pool"].str.startswith("biased")
        out[f"docs.calibration.{method}.biased_coverage"] = fmt_range(rows[biased]["coverage"], 2)
        out[f"docs.calibration.{method}.other_coverage"] = fmt_range(rows[~biased]["coverage"], 2)
        out[f"docs.calibration.{method}.below_80"] = f"{int((rows['coverage'] < 0.8).sum())} of {len(rows)}"
        if "noise" in rows:
            out.update(_by_noise(rows, method))
    jk = planted[planted["method"] == "jackknife"]
    out["docs.calibration.pools"] = str(jk["pool"].nunique())
    out["docs.calibration.groups"] = str(len(jk))
    out["docs.calibration.true_bias"] = fmt_range(jk["true_bias"], 3)
    out["docs.calibration.biased_true_bias"] = fmt_range(jk[jk["pool"].str.startswith("biased")]["true_bias"], 3)
    high = jk["target"] >= 0.65  # the pools plant GC near 0.3-0.6 and near 0.7-0.95
    out["docs.calibration.low_targets"] = fmt_range(jk[~high]["target"], 2)
    out["docs.calibration.high_targets"] = fmt_range(jk[high]["target"], 2)
    out["docs.calibration.bias_estimate"] = fmt_range(jk["mean_bias_estimate"], 3)
    claimed = jk[jk["claimed"] > 0]
    weight = claimed["claimed"]
    out["docs.calibration.claimed_share"] = fmt_range(jk["claimed"], 2)
    out["docs.calibration.large_coverage"] = fmt(float((claimed["large_coverage"] * weight).sum() / weight.sum()), 2)
    out["docs.calibration.large_coverage_range"] = fmt_range(claimed["large_coverage"], 2)
    if real is not None:
        out.update(_real_calibration(real, "docs.calibration.real"))
    return out


def _real_calibration(real: pd.DataFrame, key: str) -> dict:
    """A real-kernel calibration table's cells per output and method (scripts/gc_calibration.py)."""
    real = real.assign(covered=(real["low"] <= real["target"]) & (real["target"] <= real["high"]),
                       width=(real["high"] - real["low"]) / real.groupby(["output", "method", "bin"])["abs_gc"]
                       .transform("std"))
    out, jackknife = {}, {"coverage": [], "width": []}
    for (output, method), rows in real.groupby(["output", "method"]):
        cell, coverage, width = f"{key}.{output}.{method}", rows["covered"].mean(), rows["width"].median()
        out[f"{cell}.coverage"], out[f"{cell}.width"] = fmt(float(coverage), 2), fmt(float(width), 1)
        out[f"{cell}.point_to_1"] = f"{100 * float(((rows['low'] == rows['abs_gc']) & (rows['high'] >= 1)).mean()):.0f} %"
        out[f"{cell}.flagged"] = f"{100 * float((rows['flags'].fillna('') != '').mean()):.0f} %"
        if method == "jackknife":
            jackknife["coverage"].append(coverage)
            jackknife["width"].append(width)
    out[f"{key}.draws"] = str(int(real["draw"].nunique()))
    by_bin = real[real["method"] == "jackknife"].groupby(["output", "bin"])["covered"].mean()
    out[f"{key}.jackknife.bins"] = fmt_range(by_bin, 2)
    out[f"{key}.jackknife.coverage"] = fmt_range(jackknife["coverage"], 2)
    out[f"{key}.jackknife.width"] = fmt_range(jackknife["width"], 1)
    return out


def _gc_outputs_quick(table: pd.DataFrame) -> dict:
    """docs/gc-outputs.md's tables, from the issue-13 quick run's docs/gc-outputs-quick.csv: per
    output, the conditioning row and per bin the cells after the bin."""
    out = {}
    for output, rows in table.groupby("output"):
        rows = rows.sort_values("left").reset_index(drop=True)
        out[f"docs.gcoutputs.{output}.conditioning"] = (f"{fmt(rows['eigengap'].iloc[0])} | {fmt(rows['cos_ones'].iloc[0])} | "
                                                        f"{fmt(rows['null_low'].iloc[0])}–{fmt(rows['null_high'].iloc[0])}")
        for k, r in rows.iterrows():
            flags = r["flags"] if isinstance(r["flags"], str) else ""
            out[f"docs.gcoutputs.{output}.{k}"] = " | ".join([
                f"{k} ({fmt(r['left'])}–{fmt(r['right'])})", f"{fmt(r['abs_gc'])} [{fmt(r['abs_gc_low'])}, {fmt(r['abs_gc_high'])}]",
                r["versus_null"], fmt(r["sign_confidence"], 2),
                f"{fmt(r['mean_gradient'])} [{fmt(r['mean_gradient_low'])}, {fmt(r['mean_gradient_high'])}]",
                fmt(r["abs_gc_se"]), flags])
    return out


def claims(root: str | Path) -> dict:
    """Every claim name -> its text, computed from the committed runs under ``root`` (a checkout
    of the repository: its figures/, benchmarks/ and docs/ tables)."""
    root = Path(root)
    tail, tables = Tables(root / "figures/tail"), Tables(root / "figures/tables")
    makers: list[tuple[Callable, Tables]] = [(claim_tail_rule, tail), (_fig1, tail), (_fig2a, tail), (_fig3a, tail), (_fig3b, tail), (_fig3c, tail), (_fig4, tail), (_router, tail), (_fitting, tail),
                                             (_general_tasks, tables), (_timings, tables),
                                             (_tail_tables, tail), (_paper_tables, tables),
                                             (_original_run, tail), (_paper_cells, tables)]
    out = {}
    for make, folder in makers:
        out.update(make(folder))
    out.update(_router_table(pd.read_csv(root / "docs/router-table.csv")))
    out.update(_gc_outputs_quick(pd.read_csv(root / "docs/gc-outputs-quick.csv")))
    if (root / "figures/sweep/tables/paired.csv").is_file():
        out.update(claim_sweep(Tables(root / "figures/sweep")))
    if (root / "figures/warmup-map/tables/verdicts.json").is_file():
        out.update(claim_warmup_map(Tables(root / "figures/warmup-map")))
    if (root / "figures/tables-late/tables/table_gpt.csv").is_file():
        out.update(_late_tables(Tables(root / "figures/tables-late")))
    if (root / "figures/warmup-map/fresh/experts/verdicts.json").is_file():
        out.update(claim_experts(root / "figures/warmup-map/fresh/experts"))
    if (root / "figures/own-model/comparison.csv").is_file():
        out.update(claim_own_model(root / "figures/own-model"))
    if (root / "benchmarks/gc_statistics.csv").is_file():
        out.update(claim_gc_statistics(pd.read_csv(root / "benchmarks/gc_statistics.csv")))
    if (root / "benchmarks/gpu_gc.csv").is_file():
        out.update(claim_gpu_gc(pd.read_csv(root / "benchmarks/gpu_gc.csv")))
    if (root / "benchmarks/training_step.csv").is_file():
        out.update(claim_training_step(pd.read_csv(root / "benchmarks/training_step.csv")))
    if (root / "benchmarks/structured_p1.csv").is_file():
        out.update(claim_p1(pd.read_csv(root / "benchmarks/structured_p1.csv")))
    if (root / "benchmarks/budget.csv").is_file():
        out.update(claim_budget(pd.read_csv(root / "benchmarks/budget.csv")))
    if (root / "benchmarks/p7.csv").is_file():
        out.update(claim_p7(pd.read_csv(root / "benchmarks/p7.csv")))
    if (root / "benchmarks/inrun.csv").is_file():
        out.update(claim_inrun(pd.read_csv(root / "benchmarks/inrun.csv")))
    if (root / "benchmarks/inrun_gpu.csv").is_file():
        out.update(claim_inrun(pd.read_csv(root / "benchmarks/inrun_gpu.csv"), "bench.inrun.gpu"))
    if (root / "benchmarks/inrun_sketch_summary.csv").is_file():
        tracker = root / "benchmarks/tracker.csv"
        out.update(claim_inrun_sketch(pd.read_csv(root / "benchmarks/inrun_sketch_summary.csv"),
                                      pd.read_csv(tracker) if tracker.is_file() else None))
    if (root / "benchmarks/tracker.csv").is_file():
        out.update(claim_tracker(pd.read_csv(root / "benchmarks/tracker.csv")))
    if (root / "figures/tail/tables/gc_tracked.csv").is_file():
        out.update(claim_tracked(tail))
    planted, real = root / "docs/gc-calibration-planted.csv", root / "docs/gc-calibration.csv"
    if planted.is_file():
        out.update(_calibration(pd.read_csv(planted), pd.read_csv(real) if real.is_file() else None))
    delete1 = root / "docs/gc-calibration-planted-delete1.csv"
    if delete1.is_file():  # the same pools with the delete-1 jackknife's se alone (and the t quantile)
        out.update(_by_noise(pd.read_csv(delete1), "delete1"))
    return out


def render(text: str, values: dict) -> str:
    """``text`` with every marker's content replaced by its claim (unknown claims left as they are)."""
    return MARKER.sub(lambda m: f"<!--claim:{m[1]}-->{values.get(m[1], m[2])}<!--/claim-->", text)


def mismatches(text: str, values: dict) -> list[tuple[str, str, str | None]]:
    """(claim, quoted text, computed text or None when unknown) for each marker that disagrees."""
    return [(m[1], m[2], values.get(m[1])) for m in MARKER.finditer(text) if values.get(m[1]) != m[2]]


def main(argv) -> int:
    """``python scripts/render_claims.py [--root DIR] FILE ...``: render FILEs' claims from
    the committed runs under DIR (default: the working directory, a checkout of the repository)."""
    parser = argparse.ArgumentParser(prog="python scripts/render_claims.py",
                                     description="render the quoted numbers of Markdown files from the committed runs")
    parser.add_argument("--root", default=".", help="the repository checkout whose figures/ and benchmarks/ hold the "
                        "runs (default: the working directory)")
    parser.add_argument("paths", nargs="+", help="Markdown files to render in place")
    args = parser.parse_args(argv)
    root = Path(args.root)
    if not (root / "figures").is_dir():
        raise SystemExit(f"python scripts/render_claims.py: --root {root} holds no figures/ (run it from a "
                         "checkout of the repository, or name one with --root)")
    values = claims(root)
    for path in map(Path, args.paths):
        text = path.read_text()
        new = render(text, values)
        if new != text:
            write_text(path, new)
            print(f"rendered {path}")
    return 0

