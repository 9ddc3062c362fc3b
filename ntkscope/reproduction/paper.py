"""The paper's tables, every row: Table 1 (BERT) and Table 2 (GPT) with pretraining seeds, a
general-tasks table (the analogue of the paper's evidence of forgetting), and a test for every
difference CSE is said to make (docs/tables.md).

Rows, for each architecture X in ``settings.table_archs``, each trained per pretraining seed s:

    X dense          from scratch (init and data order s) for ``steps``
    X/DOMAIN         X dense, tuned ``finetune_steps`` on DOMAIN only (every tuned row: the same extra tokens)
    Switch           X dense's checkpoint at the warm-up, upcycled (top-1 token routing), to ``steps``
    Switch/DOMAIN    Switch, tuned like X/DOMAIN
    CSE/MoF, CSE/MoA CSE on the FFN / on attention, from the same warm-up, to ``steps``; no tuning
    DEMix            one FFN expert per domain, from the same warm-up, to ``steps``; evaluated by its
                     posterior mixture with a cached prior

Every model is evaluated once (``RUN/models/NAME/eval.json``: delete it, or the model's
directory, to redo one row) and the tables are made from those files.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from cse_models.evaluate import STANDS_IN_FOR, evaluate_model
from cse_models.model import active_parameter_count, load_model, parameter_count
from ntkscope.core.files import read_json_object, write_json
from ntkscope.reproduction import training

log = logging.getLogger(__name__)

ARCH_NAMES = {"gpt": "GPT", "bert": "BERT"}
#: metrics where lower is better (the rest: higher is better)
LOWER_IS_BETTER = ("perplexity", "ppl ")
SIGNIFICANCE = 0.05


def row_keys(settings) -> list[str]:
    """The rows of a table, in order: dense, dense-DOMAIN..., switch, switch-DOMAIN..., cse-mof, cse-moa, demix."""
    tuned = lambda base: [f"{base}-{d}" for d in settings.finetune_domains]  # noqa: E731
    return ["dense", *tuned("dense"), "switch", *tuned("switch"), "cse-mof", "cse-moa", "demix"]


def row_label(arch: str, key: str) -> str:
    """The row's name in the table: "GPT dense", "GPT/legal", "Switch/legal", "CSE/MoA", "DEMix"."""
    x = ARCH_NAMES[arch]
    fixed = {"dense": f"{x} dense", "switch": "Switch", "cse-mof": "CSE/MoF", "cse-moa": "CSE/MoA", "demix": "DEMix"}
    if key in fixed:
        return fixed[key]
    base, domain = key.split("-", 1)
    return f"{x if base == 'dense' else 'Switch'}/{domain}"


def base_row(key: str) -> str:
    """The row a row is compared with for forgetting: a tuned row's untuned model; CSE and DEMix: dense."""
    return key.split("-", 1)[0] if key.startswith(("dense-", "switch-")) else "dense"


def model_name(arch: str, key: str, seed: int) -> str:
    return f"table-{arch}-{key}-seed{seed}"


def layout(rep) -> tuple[list, int]:
    """(sparse layers, conversion step): the settings' ``table_layers``/``table_convert_at``, else the plan's."""
    s = rep.settings
    layers = list(s.table_layers) or list(rep.plan().layers)
    warmup = int(s.table_convert_at) or int(rep.plan().convert_at)
    return layers, warmup


def train_row(rep, arch: str, key: str, seed: int) -> Path:
    """The last checkpoint of row ``key`` of architecture ``arch`` at pretraining seed ``seed``,
    training it (and what it starts from) on first use."""
    s, pack = rep.settings, rep.pack_path
    name = model_name(arch, key, seed)
    out = rep.model_dir(name)
    base = training.arch_model(s, arch, rep.mask_token_id())
    layers, warmup = layout(rep)
    if key == "dense":
        make = lambda: training.train_dense(s, out, pack, seed=seed, base=base, checkpoints=(warmup,))  # noqa: E731
    elif key.startswith(("dense-", "switch-")):
        parent, domain = key.split("-", 1)
        start = train_row(rep, arch, parent, seed)
        make = lambda: training.train_finetuned(s, out, pack, start, domain, seed)  # noqa: E731
    else:
        train_row(rep, arch, "dense", seed)
        dense = rep.model_dir(model_name(arch, "dense", seed))
        makers = {
            "switch": lambda: training.train_switch(s, out, pack, dense, layers, warmup, seed, None, base),
            "cse-mof": lambda: training.train_cse(s, out, pack, dense, layers, warmup, seed, None, base, "ffn",
                                                  s.table_mean_rate),
            "cse-moa": lambda: training.train_cse(s, out, pack, dense, layers, warmup, seed, None, base, "attn",
                                                  s.table_mean_rate),
            "demix": lambda: training.train_demix(s, out, pack, dense, layers, warmup, rep.domain_names(), seed,
                                                  base),
        }
        make = makers[key]
    return rep._timed(f"train {name}", make)


def _evaluation(settings) -> dict:
    return {"probe_seeds": settings.probe_seeds, "max_blocks": settings.eval_max_blocks,
            "max_items": settings.eval_max_items}


def evaluate_row(rep, arch: str, key: str, seed: int) -> dict:
    """Row ``key``'s measurements at ``seed`` (:func:`cse_models.evaluate.evaluate_model`, plus its
    parameters, active parameters, experts and tokens), cached in the model's ``eval.json``."""
    last = train_row(rep, arch, key, seed)
    path = last.parent.parent / "eval.json"
    s = rep.settings
    if path.is_file():
        saved = read_json_object(path, "evaluate_row")
        if saved.get("checkpoint") == last.name and saved.get("evaluation") == _evaluation(s):
            return saved["results"]
    model = load_model(last)
    found = rep._timed("evaluate tables", lambda: evaluate_model(
        model, rep.pack, seq_len=s.seq_len, seeds=tuple(range(s.probe_seeds)), max_blocks=s.eval_max_blocks or None,
        max_items=s.eval_max_items or None))
    config = model.config
    tuned = key.startswith(("dense-", "switch-"))
    found.update({"params": parameter_count(config), "active_params": active_parameter_count(config),
                  "experts": "+".join(str(c) for c in config.sparse.n_experts) if config.sparse else "",
                  "pretrain_tokens": s.steps * s.batch_size * s.seq_len,
                  "tuning_tokens": s.finetune_steps * s.batch_size * s.seq_len if tuned else 0})
    write_json(path, {"checkpoint": last.name, "evaluation": _evaluation(s), "results": found})
    log.info("%s: perplexity %.2f, probe average %.3f", model_name(arch, key, seed), found["perplexity"],
             found["average"])
    return found


def metrics_of(runs: pd.DataFrame) -> list[str]:
    """The compared metrics: perplexity (all, per domain), each probe's mean accuracy, their average."""
    return ["perplexity", *sorted(c for c in runs if c.startswith("ppl ")),
            *sorted(c for c in runs if c.startswith("acc ") and " seed " not in c), "average"]


def _summary(runs: pd.DataFrame, arch: str, keys: list) -> pd.DataFrame:
    """One row per table row: seeds, then every metric's mean and std over pretraining seeds, the
    probe-seed spread of each task (mean over seeds of the std over probe seeds), and the model's size."""
    metrics = metrics_of(runs)
    rows = []
    for key in keys:
        part = runs[(runs["arch"] == arch) & (runs["key"] == key)]
        row = {"model": row_label(arch, key), "key": key, "seeds": len(part)}
        for m in metrics:
            row[f"{m} mean"] = part[m].mean()
            row[f"{m} std"] = part[m].std(ddof=1) if len(part) > 1 else np.nan
        for task in (m[4:] for m in metrics if m.startswith("acc ")):
            per_seed = part[[c for c in part if c.startswith(f"acc {task} seed ")]]
            row[f"acc {task} probe std"] = per_seed.std(axis=1, ddof=0).mean()
        for c in ("params", "active_params", "pretrain_tokens", "tuning_tokens"):
            row[c] = int(part[c].iloc[0])
        row["experts"] = " / ".join(sorted(set(part["experts"].astype(str))))
        rows.append(row)
    return pd.DataFrame(rows)


def _std(x: np.ndarray) -> float:
    """The sample std (ddof 1); nan for one value."""
    return float(np.std(x, ddof=1)) if len(x) > 1 else float("nan")


def _verdict(metric: str, a: np.ndarray, b: np.ndarray) -> tuple[float, bool, str]:
    """Welch's t-test between two rows' per-seed values, and whether a's mean +- std and b's
    mean +- std are apart: (p, apart, verdict). A difference is "better"/"worse" (for the first
    row) only when both hold, else "not shown"."""
    with warnings.catch_warnings():  # equal values (a probe at chance in every seed): p is nan, "not shown"
        warnings.simplefilter("ignore", RuntimeWarning)
        p = float(stats.ttest_ind(a, b, equal_var=False).pvalue) if len(a) > 1 and len(b) > 1 else float("nan")
    sa, sb = _std(a), _std(b)
    apart = bool(abs(a.mean() - b.mean()) > sa + sb)
    if not (apart and p < SIGNIFICANCE):
        return p, apart, "not shown"
    lower = metric.startswith(LOWER_IS_BETTER)
    return p, apart, "better" if (a.mean() < b.mean()) == lower else "worse"


def _tests(runs: pd.DataFrame, arch: str, keys: list) -> list[dict]:
    """CSE/MoF and CSE/MoA against every other row, on every metric."""
    rows = []
    for ours in (k for k in ("cse-mof", "cse-moa") if k in keys):
        for other in (k for k in keys if k != ours):
            for m in metrics_of(runs):
                pick = lambda k: runs[(runs["arch"] == arch) & (runs["key"] == k)].sort_values("seed")[m]  # noqa: E731
                a, b = pick(ours).to_numpy(float), pick(other).to_numpy(float)
                p, apart, verdict = _verdict(m, a, b)
                rows.append({"arch": arch, "row": row_label(arch, ours), "against": row_label(arch, other),
                             "metric": m, "mean": a.mean(), "std": _std(a), "against_mean": b.mean(),
                             "against_std": _std(b), "difference": a.mean() - b.mean(), "welch_p": p,
                             "apart": apart, "verdict": verdict})
    return rows


def _forgetting(runs: pd.DataFrame, arch: str, keys: list, general_task: str) -> list[dict]:
    """Per row: the general domain's test perplexity and the general probe's accuracy, and their
    change from the row's base model (:func:`base_row`) at the same seed, with a paired t-test."""
    rows = []
    for key in keys:
        part = runs[(runs["arch"] == arch) & (runs["key"] == key)].set_index("seed").sort_index()
        base = runs[(runs["arch"] == arch) & (runs["key"] == base_row(key))].set_index("seed").sort_index()
        row = {"arch": arch, "model": row_label(arch, key), "against": row_label(arch, base_row(key))}
        for m, short in (("ppl general", "ppl_general"), (f"acc {general_task}", "general_probe")):
            row[f"{short} mean"], row[f"{short} std"] = part[m].mean(), part[m].std(ddof=1)
            if key == base_row(key):
                continue
            delta = (part[m] - base.loc[part.index, m]).to_numpy(float)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                p = float(stats.ttest_rel(part[m], base.loc[part.index, m]).pvalue) if len(delta) > 1 else float("nan")
            row[f"{short} change mean"], row[f"{short} change std"] = delta.mean(), _std(delta)
            row[f"{short} change p"] = p
            row[f"{short} change"] = ("not shown" if not p < SIGNIFICANCE else
                                      "worse" if (delta.mean() > 0) == m.startswith("ppl") else "better")
        rows.append(row)
    return rows


def paper_tables(rep) -> dict:
    """Every row of every architecture at every seed, trained and evaluated (cached per model):
    paper_runs (one row per model and seed, every measurement), table_gpt / table_bert (mean and
    std over seeds), general_tasks (forgetting: the general domain before and after tuning, CSE and
    DEMix against dense) and table_tests (CSE/MoF and CSE/MoA against every row, every metric)."""
    s = rep.settings
    keys = row_keys(s)
    seeds = range(s.seed, s.seed + s.seeds)
    records = []
    for arch in s.table_archs:
        for seed in seeds:
            for key in keys:
                found = evaluate_row(rep, arch, key, seed)
                records.append({"arch": arch, "key": key, "model": row_label(arch, key), "seed": seed, **found})
    return tables_from_runs(pd.DataFrame(records), s)


def tables_from_runs(runs: pd.DataFrame, settings) -> dict:
    """The tables of :func:`paper_tables` from ``runs`` (one row per model and seed: arch, key,
    model, seed and every measurement), e.g. an experiment's finished units."""
    keys = [k for k in row_keys(settings) if k in set(runs["key"])]
    general = next((t for t, paper in STANDS_IN_FOR.items() if t.startswith("general")), None)
    out = {"paper_runs": runs}
    archs = [a for a in settings.table_archs if a in set(runs["arch"])]
    for arch in ARCH_NAMES:
        out[f"table_{arch}"] = _summary(runs, arch, keys) if arch in archs else pd.DataFrame()
    out["general_tasks"] = pd.DataFrame([r for arch in archs for r in _forgetting(runs, arch, keys, general)])
    out["table_tests"] = pd.DataFrame([r for arch in archs for r in _tests(runs, arch, keys)])
    return out


def _cell(mean: float, std: float, digits: int) -> str:
    return f"{mean:.{digits}f}" if not np.isfinite(std) else f"{mean:.{digits}f} ± {std:.{digits}f}"


def markdown(tables: dict, settings) -> str:
    """tables/paper.md: Tables 1-2 with every cell mean ± std over pretraining seeds, the
    general-tasks table, and the differences the tests show."""
    parts = [f"# The paper's tables ({settings.mode}: {settings.seeds} pretraining seeds, {settings.probe_seeds} "
             f"probe seeds; cells: mean ± std over pretraining seeds)\n"]
    for number, arch in ((1, "bert"), (2, "gpt")):
        table = tables[f"table_{arch}"]
        if table.empty:
            continue
        means = [c[:-5] for c in table if c.endswith(" mean")]
        cols = {"perplexity": "test ppl", **{m: m for m in means if m.startswith("ppl ")},
                **{m: m[4:] for m in means if m.startswith("acc ")}, "average": "average"}
        shown = pd.DataFrame({"model": table["model"]})
        for metric, title in cols.items():
            digits = 1 if metric.startswith(LOWER_IS_BETTER) else 3
            shown[title] = [_cell(m, s, digits) for m, s in zip(table[f"{metric} mean"], table[f"{metric} std"])]
        shown["experts"] = table["experts"].fillna("")  # dense rows: none (read back from CSV as NaN)
        shown["params (M)"] = (table["params"] / 1e6).round(2)
        shown["active (M)"] = (table["active_params"] / 1e6).round(2)
        shown["tuning tokens"] = table["tuning_tokens"]
        parts.append(f"## Table {number} analogue: {ARCH_NAMES[arch]}\n\n{shown.to_markdown(index=False)}\n")
    general = tables["general_tasks"]
    if not general.empty:
        g = pd.DataFrame({"arch": general["arch"].map(ARCH_NAMES), "model": general["model"],
                          "against": general["against"]})
        for short, title, digits in (("ppl_general", "general ppl", 1), ("general_probe", "general probe", 3)):
            g[title] = [_cell(m, s, digits) for m, s in zip(general[f"{short} mean"], general[f"{short} std"])]
            change = [general.get(f"{short} change{part}", np.nan) for part in (" mean", " std", "", " p")]
            g[f"{title} change"] = ["" if not np.isfinite(m) else f"{_cell(m, s, digits)} ({v}, p={p:.3f})"
                                    for m, s, v, p in zip(*change)]
        parts.append("## General tasks (forgetting): the general domain after tuning, against the untuned model; "
                     "CSE and DEMix against dense (paired t-test over seeds)\n\n" + g.to_markdown(index=False) + "\n")
    tests = tables["table_tests"]
    if not tests.empty:
        found = tests[tests["verdict"] != "not shown"]
        lines = []
        for (arch, row, against), part in found.groupby(["arch", "row", "against"], sort=False):
            says = "; ".join(f"{verdict} on {', '.join(part.loc[part['verdict'] == verdict, 'metric'])}"
                             for verdict in ("better", "worse") if (part["verdict"] == verdict).any())
            lines.append(f"- {ARCH_NAMES[arch]} {row} against {against}: {says}")
        silent = sorted({f"{ARCH_NAMES[a]} {r} against {o}" for a, r, o in
                         tests[["arch", "row", "against"]].itertuples(index=False)} -
                        {f"{ARCH_NAMES[a]} {r} against {o}" for a, r, o in
                         found[["arch", "row", "against"]].itertuples(index=False)})
        parts.append(f"## Differences shown ({len(found)} of {len(tests)} comparisons: mean ± std apart and Welch's "
                     f"t-test p < {SIGNIFICANCE}; every comparison with its numbers is in table_tests.csv)\n\n"
                     + ("\n".join(lines) if lines else "none") + "\n\nNo difference shown on any metric: "
                     + (", ".join(silent) if silent else "none") + ".\n")
    return "\n".join(parts)
