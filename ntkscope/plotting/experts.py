"""Figures of the sparse layers: the CSE layer drawn (Figure 4(a)), each expert's kernel (Figure
5(b, c)), what the experts learned, their loads and where each domain is routed."""

from __future__ import annotations

import numpy as np

from cse_models.expert_report import layer_label
from ntkscope.core.checks import fail
from ntkscope.plotting.base import pyplot


def cse_schematic():
    """Figure 4(a): the CSE layer (docs/design.md §4), drawn as the router runs it: sequence
    embedding, centred and projected to the routing space ``z = normalise(M (v - mu))``, the
    nearest radius-scaled HDBSCAN cluster centre, the chosen expert (a copy of the warmed-up FFN)."""
    plt = pyplot()
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # matplotlib on the first figure
    fig, ax = plt.subplots(figsize=(8, 3.4))
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 4.4)
    ax.axis("off")

    def box(x, y, w, h, text, colour="#ecf0f1"):
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", fc=colour, ec="#2c3e50", lw=1))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8)

    def arrow(a, b, **kw):
        ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=10, color="#2c3e50", lw=1, **kw))

    box(0.1, 1.7, 1.5, 1.0, "token states\nx (B, T, d)\n(after LN)")
    box(2.1, 2.7, 1.7, 0.9, "sequence\nembedding v: mean\nover real tokens")
    box(4.05, 2.7, 2.05, 0.9, "z = normalise(M(v-mu))\nmu: fitting mean\nM: d' x d projection")
    box(6.4, 2.7, 1.8, 0.9, "expert j = argmin\n||z - c_j|| / r_j\n(HDBSCAN clusters)")
    arrow((1.6, 2.45), (2.1, 3.1))
    arrow((3.8, 3.15), (4.05, 3.15))
    arrow((6.1, 3.15), (6.4, 3.15))
    colours = ["#c9d6ea", "#f5cba7", "#d5f5e3"]
    for j, y in enumerate((0.2, 0.95, 1.7)):
        box(6.6, y, 1.4, 0.55, f"FFN expert {j}", colours[j])
    ax.text(7.3, 2.45, "...", ha="center", fontsize=10)
    arrow((1.6, 1.9), (6.6, 0.48), connectionstyle="arc3,rad=0.1")
    arrow((7.3, 2.7), (7.3, 2.25))
    box(8.6, 0.9, 1.3, 0.9, "output\n(B, T, d)")
    for y in (0.48, 1.22, 1.97):
        arrow((8.0, y), (8.6, 1.35))
    ax.text(5.0, 0.2, "after each step: winning c_j <- a c_j + (1 - a) z  (no router parameters)", ha="center",
            fontsize=7.5, style="italic")
    ax.set_title("The CSE layer: each sequence goes to the expert of its nearest cluster", fontsize=10)
    return fig


def expert_kernels(summary):
    """Figure 5(b, c) as a statistic. ``summary``: expert, n, output, cse_expert_cosine,
    dense_cosine and their ``_se`` (:func:`ntkscope.reproduction.analyses.expert_kernels`). Per
    expert: the mean off-diagonal cosine of the NTK of the expert's parameters on the sentences
    routed to it, beside the dense FFN's on the same sentences, each +- 1.645 jackknife standard
    errors; a dotted line: the dense FFN's on the whole batch."""
    plt = pyplot()
    rows = summary[summary["expert"].astype(str) != "all"].reset_index(drop=True)
    whole = summary[summary["expert"].astype(str) == "all"]
    fig, ax = plt.subplots(figsize=(max(4.5, 1.1 * len(rows) + 2), 3.6))
    x = np.arange(len(rows))
    for shift, column, colour, label in ((-0.12, "cse_expert_cosine", "#c0392b", "CSE expert's NTK"),
                                         (0.12, "dense_cosine", "#2c3e50", "dense FFN's NTK, same sentences")):
        se = rows[f"{column}_se"].fillna(0) if f"{column}_se" in rows else 0 * rows[column]  # older tables: none
        ax.errorbar(x + shift, rows[column], yerr=1.645 * se, fmt="o", color=colour, capsize=3, ms=5, label=label)
    if len(whole):
        ax.axhline(float(whole["dense_cosine"].iloc[0]), color="#2c3e50", ls=":", lw=1,
                   label="dense FFN's NTK, whole batch")
    ax.set_xticks(x, [f"expert {e}\nn={n}" for e, n in zip(rows["expert"], rows["n"])], fontsize=8)
    ax.set_ylabel("mean off-diagonal cosine Θ_ij / sqrt(Θ_ii Θ_jj)", fontsize=8)
    output = rows["output"].iloc[0] if "output" in rows and len(rows) else "loss"
    ax.set_title(f"(b, c) how alike each expert's sentences pull its parameters (output: {output})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def expert_consistency(table, *, title: str = ""):
    """Figure 5(b, c) across seeds (``table``: the judged rows of ``ntkscope experiment experts``'
    experts.csv): per expert, its kernel's split-half |GC| on its blocks (red) beside the dense
    FFN's on the same blocks (dark), each the median with the 5 and 95 % quantiles over halves,
    and the dense FFN's on random blocks as many (grey: the null's median and 95 % quantile);
    experts grouped by seed, labelled by layer and expert, tail experts marked."""
    plt = pyplot()
    rows = table.sort_values(["seed", "layer", "expert"]).reset_index(drop=True)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.42 * len(rows) + 2), 3.8))
    x = np.arange(len(rows))
    for shift, name, colour, label in ((-0.15, "expert", "#c0392b", "expert's kernel, its blocks"),
                                       (0.15, "dense", "#2c3e50", "dense FFN, same blocks")):
        err = np.clip([rows[f"{name}_median"] - rows[f"{name}_low"], rows[f"{name}_high"] - rows[f"{name}_median"]],
                      0, None)
        ax.errorbar(x + shift, rows[f"{name}_median"], yerr=err, fmt="o", color=colour, capsize=2, ms=4, label=label)
    ax.scatter(x, rows["null_median"], marker="_", s=120, color="#999999", label="dense FFN, random blocks (median)")
    ax.scatter(x, rows["null_high"], marker="_", s=60, color="#cccccc", label="its 95 % quantile")
    labels = [f"s{r.seed} L{r.layer} e{r.expert}" + ("*" if r.tail_share >= 0.5 else "") for r in rows.itertuples()]
    ax.set_xticks(x, labels, rotation=90, fontsize=7)
    for edge in np.flatnonzero(np.diff(rows["seed"].to_numpy())) + 0.5:
        ax.axvline(edge, color="#dddddd", lw=0.8)
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("split-half |GC|", fontsize=8)
    ax.set_title(title or "(b, c) each expert's kernel against the dense FFN's on its blocks (* tail expert)",
                 fontsize=9)
    ax.legend(fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2, frameon=False)
    fig.tight_layout()
    return fig


def expert_layers(layers, *, title: str = ""):
    """Each sparse layer's routing purity and NMI against the labels, with their intervals
    (``layers``: :func:`cse_models.expert_report.expert_report`'s layer table: name, purity,
    purity_low/high, nmi, nmi_low/high)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 0.5 + 0.45 * len(layers) + 1.2))
    y = np.arange(len(layers))
    for offset, stat, colour in ((-0.15, "purity", "#2e86c1"), (0.15, "nmi", "#c0392b")):
        value = layers[stat].to_numpy(dtype=float)
        low, high = (layers[f"{stat}_{end}"].to_numpy(dtype=float) for end in ("low", "high"))
        err = np.clip([value - low, high - value], 0, None)  # a percentile interval may miss its point
        ax.errorbar(value, y + offset, xerr=err, fmt="o", color=colour, capsize=3, label=stat)
    ax.set_yticks(y, layers["name"].astype(str))
    ax.set_xlim(0, 1.02)
    ax.set_xlabel("against the labels (intervals: bootstrap over texts)")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title or "What the experts learned: routing purity and NMI per layer", fontsize=10)
    fig.tight_layout()
    return fig


def expert_loads(load, *, tail=("legal", "biomedical")):
    """The sweep's expert loads over training (``load``: sweep_tables.loads' table, columns arm,
    seed, step, layer, expert, n, share, ``n DOMAIN``): per CSE arm (rows) and layer (columns),
    the smallest expert's share of the layer's sequences in each 50-step window (starvation,
    solid, one line per seed) and, per ``tail`` domain, the share of its sequences that reach
    its most-used expert (dashed) and the domain's share of that expert's sequences (dotted):
    does the tail keep an expert of its own?"""
    plt = pyplot()
    arms, layers = list(dict.fromkeys(load["arm"])), sorted(load["layer"].astype(str).unique())
    fig, axes = plt.subplots(len(arms), len(layers), figsize=(4.2 * len(layers), 2.6 * len(arms)), squeeze=False,
                             sharex=True, sharey=True)
    colours = {"min": "0.2", **{d: c for d, c in zip(tail, ("tab:red", "tab:green"))}}
    for i, arm in enumerate(arms):
        for j, layer in enumerate(layers):
            ax = axes[i][j]
            part = load[(load["arm"] == arm) & (load["layer"].astype(str) == layer)]
            for seed, g in part.groupby("seed"):
                per_step = g.groupby("step")
                ax.plot(per_step["share"].min().index, per_step["share"].min().values, color=colours["min"], lw=1,
                        label="smallest expert's share" if seed == part["seed"].min() else None)
                for d in tail:
                    if f"n {d}" not in g:
                        continue
                    top = per_step[f"n {d}"].max() / per_step[f"n {d}"].sum().clip(lower=1)
                    first = seed == part["seed"].min()
                    ax.plot(top.index, top.values, color=colours[d], lw=1, ls="--",
                            label=f"{d}: share at its top expert" if first else None)
                    at_top = g.loc[g.groupby("step")[f"n {d}"].idxmax()]  # that expert's window, per step
                    purity = at_top[f"n {d}"] / at_top["n"].clip(lower=1)
                    ax.plot(at_top["step"], purity.values, color=colours[d], lw=1, ls=":",
                            label=f"{d}: its share of that expert" if first else None)
            ax.set_title(f"{arm}, layer {layer.split('.')[-2] if '.' in layer else layer}", fontsize=9)
            ax.set_ylim(0, 1.02)
            if i == len(arms) - 1:
                ax.set_xlabel("training step")
    axes[0][0].legend(fontsize=7, loc="center left")
    fig.tight_layout()
    return fig


def routing_shares(routing, *, title: str = ""):
    """Where each domain is routed (``routing``: :func:`cse_models.domains.routing_table`'s rows,
    or ``ntkscope compare``'s routing.csv, the rows of several models with ``arm`` and ``seed``
    columns): one heatmap per sparse layer (columns) and per model (rows, named by arm and seed),
    domains (rows) x experts (columns), each cell the share of the domain's sequences (CSE) or
    tokens (Switch) sent to that expert, with the count."""

    plt = pyplot()
    by = [c for c in ("arm", "seed") if c in routing.columns]
    keys = ["layer", "expert", "domain", *by]
    repeated = int(routing.duplicated(keys).sum())
    if repeated:
        raise fail("routing_shares", "routing", f"must hold one row per ({', '.join(keys)}); the rows of several "
                   "models need arm and seed columns", f"{repeated} repeated rows")
    models = [(_model_name(by, key), rows) for key, rows in routing.groupby(by, sort=False)] if by else [("", routing)]
    layers = list(dict.fromkeys(routing["layer"]))
    domains = sorted(routing["domain"].unique())
    fig, axes = plt.subplots(len(models), len(layers), squeeze=False,
                             figsize=(1.2 + 0.55 * routing["expert"].nunique() * len(layers) + 1.5,
                                      (0.9 + 0.45 * len(domains)) * len(models)))
    for row, (name, model) in zip(axes, models):
        for ax, layer in zip(row, layers):
            part = model[model["layer"] == layer]
            if part.empty:  # this model has no such sparse layer
                ax.axis("off")
                continue
            _routing_panel(ax, part, domains)
            ax.set_title(layer_label(str(layer)), fontsize=8)
        if len(models) > 1:
            row[0].set_ylabel(name, fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _model_name(by: list, key) -> str:
    """The name of one model's rows ("cse, seed 0"): its group ``key`` of a table grouped ``by`` arm and seed."""
    values = dict(zip(by, key if isinstance(key, tuple) else (key,)))
    return ", ".join([str(values["arm"])] * ("arm" in values) + [f"seed {values['seed']}"] * ("seed" in values))


def _routing_panel(ax, part, domains) -> None:
    """One model's one layer: the shares as a heatmap, the counts written in the cells."""
    share = part.pivot(index="domain", columns="expert", values="share_of_domain").reindex(domains)
    count = part.pivot(index="domain", columns="expert", values="count").reindex(domains).fillna(0)
    ax.imshow(share.fillna(0).values, vmin=0, vmax=1, cmap="Blues", aspect="auto")
    for (r, c), value in np.ndenumerate(count.values):
        ax.text(c, r, f"{int(value)}", ha="center", va="center", fontsize=7,
                color="white" if share.values[r, c] > 0.6 else "black")
    ax.set_xticks(range(share.shape[1]), [str(e) for e in share.columns])
    ax.set_yticks(range(len(domains)), domains)
    ax.set_xlabel(f"expert ({part['unit'].iloc[0]})")
