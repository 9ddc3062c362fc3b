"""The claims about the experiments beside the paper's figures: the training-step and GPU
benchmarks (benchmarks/), the small-cluster rule on the tail run, the sweep (figures/sweep) and
the "your model, your data" walkthrough (figures/own-model). :mod:`doc_claims.claims`
gathers them with the figures' and tables' claims."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from ntkscope.representation.plan import gc_peak, plan_step

from doc_claims.values import Tables, fmt, fmt_range


def claim_training_step(table: pd.DataFrame) -> dict:
    """benchmarks/README.md: the training step before and after, per thread count."""
    out = {}
    for threads, g in table.groupby("threads"):
        before = g[g["path"].str.startswith("before")].iloc[0]
        after = g[g["path"].str.startswith("after")].iloc[0]
        key = f"bench.train.{threads}t"
        out.update({f"{key}.before": fmt(before["s_per_step"]), f"{key}.after": fmt(after["s_per_step"]),
                    f"{key}.speedup": fmt(after["speedup"], 2), f"{key}.diff": fmt(after["max_abs_loss_diff"]),
                    f"{key}.noise": f"{fmt(before['same_path_1_vs_2_threads'])}–{fmt(after['same_path_1_vs_2_threads'])}",
                    f"{key}.first": fmt(after["first_step_loss_diff"], 1)})
    one = table[table["threads"] == 1]
    two_before = table[(table["threads"] == 2) & table["path"].str.startswith("before")].iloc[0]
    out["bench.train.sweep_throughput"] = fmt(2 * one[one["path"].str.startswith("after")].iloc[0]["steps_per_s"]
                                             / two_before["steps_per_s"], 2)
    return out


def claim_gc_statistics(table: pd.DataFrame) -> dict:
    """benchmarks/README.md: GC's statistics against the kernel, per n and method, with the
    batched-torch path beside the host one."""
    rows = ["| n | method | seconds | note |", "|--:|:--|--:|:--|"]
    for _, r in table.iterrows():
        note = str(r["note"]).replace("x200", "×200").replace("x the", "× the")
        rows.append(f"| {int(r['n'])} | {r['method']} | {r['seconds']:.2f} | {note} |")

    def share(method):
        return [g.loc[g["method"] == method, "seconds"].iloc[0] / g.loc[g["method"] == "kernel", "seconds"].iloc[0]
                for _, g in table.groupby("n")]

    batched = table[table["method"].str.contains("batched")]
    host = table[table["method"] == "statistics (jackknife, default)"].set_index("n")["seconds"]
    ratio = [r["seconds"] / host[r["n"]] for _, r in batched.iterrows()]
    return {"bench.stats.table": "\n".join(rows),
            "bench.stats.jackknife.share": fmt_range(100 * np.array(share("statistics (jackknife, default)")), 1, " %"),
            "bench.stats.controls.share": fmt_range(100 * np.array(share("statistics + controls")), 1, " %"),
            "bench.stats.batched.ratio": fmt_range(ratio, 2, "×"),
            "bench.stats.batched.difference": f"{batched['difference'].max():.0e}"}


def claim_gpu_gc(table: pd.DataFrame) -> dict:
    """benchmarks/README.md: GC at GPT-2-small shape on one GPU, per method, budget and layout rule."""
    rows = ["| run | GPU | method | max_memory | seconds | kernel s | peak GB above the model | GC | \\|GC\\| interval "
            "| random null |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in table.itertuples():
        kernel = "—" if not np.isfinite(r.kernel_s) else f"{r.kernel_s:.0f}"
        if isinstance(r.error, str):
            rows.append(f"| {r.run} | {r.device} | {r.method} | {r.max_memory_gb:g} GB | — | {kernel} | — | — | — "
                        f"| {r.error} |")
            continue
        interval = "—" if not np.isfinite(r.abs_low) else f"[{r.abs_low:.3f}, {r.abs_high:.3f}]"
        null = "—" if not np.isfinite(r.null_low) else f"[{r.null_low:.3f}, {r.null_high:.3f}]"
        rows.append(f"| {r.run} | {r.device} | {r.method} | {r.max_memory_gb:g} GB | {r.seconds:.0f} | {kernel} | "
                    f"{r.peak_gb_above_model:.2f} | {r.gc:.6f} | {interval} | {null} |")
    out = {"bench.gpu.table": "\n".join(rows)}
    latest = table[table["device"] == table["device"].iloc[-1]]  # the last card's rows, compared with each other
    rule = latest[latest["layout"] == "CPU rule"]
    accel = latest[latest["layout"] == "accelerator"]
    if len(rule) and len(accel):
        at16, at8 = accel[accel["max_memory_gb"] == 16].iloc[-1], accel[accel["max_memory_gb"] == 8].iloc[-1]
        before = rule[rule["max_memory_gb"] == 16].iloc[-1]
        out.update({"bench.gpu.device": str(at16.device), "bench.gpu.accel.seconds": f"{at16.seconds:.0f} s",
                    "bench.gpu.accel.kernel": f"{at16.kernel_s:.0f} s",
                    "bench.gpu.accel.peak": f"{at16.peak_gb_above_model:.2f} GB",
                    "bench.gpu.accel8.seconds": f"{at8.seconds:.0f} s",
                    "bench.gpu.accel8.peak": f"{at8.peak_gb_above_model:.2f} GB",
                    "bench.gpu.rule.kernel": f"{before.kernel_s:.0f} s",
                    "bench.gpu.kernel_speedup": f"{before.kernel_s / at16.kernel_s:.1f}×",
                    "bench.gpu.statistics": f"{at16.seconds - at16.kernel_s:.0f} s"})
    return out


def claim_budget(table: pd.DataFrame) -> dict:
    """benchmarks/README.md and README: peaks above the model against max_memory at GPT-2-small
    shape (benchmarks/budget.csv), per method, one process and two ranks."""
    runs = table[table["peak_GiB"].notna()]
    rows = ["| where | method | n | max_memory | peak above the model | within | seconds | passes |",
            "|---|---|--:|--:|--:|---|--:|--:|"]
    for r in runs.itertuples():
        rows.append(f"| {r.setting} | {r.method} | {int(r.n)} | {r.max_memory_GiB:g} GiB | {r.peak_GiB:.2f} GiB | "
                    f"{'yes' if str(r.within) == 'True' else '**no**'} | {r.seconds:.0f} | {int(r.passes)} |")
    out = {"bench.budget.table": "\n".join(rows),
           "bench.budget.within": f"{int((runs['within'].astype(str) == 'True').sum())} of {len(runs)}",
           "bench.budget.worst": f"{100 * float((runs['peak_GiB'] / runs['max_memory_GiB']).max()):.0f} %"}
    structured = runs[runs["method"] == "structured"]
    used = 100 * structured["peak_GiB"] / structured["max_memory_GiB"]
    out["bench.budget.structured"] = f"{used.min():.0f}–{used.max():.0f} %"
    return out


def claim_p7(table: pd.DataFrame) -> dict:
    """benchmarks/README.md: P7 run (benchmarks/p7.csv): the exact NTK of n = 256 at GPT-2-small
    shape under 2 GiB beside a training step of the same batch, and the method table's estimate."""
    step = table[table["setting"] == "P7 training step"].iloc[0]
    run = table[table["setting"] == "P7 run"].iloc[0]
    estimate = table[table["setting"] == "P7 estimate"].iloc[0]
    out = {"bench.p7.step": f"{step.seconds:.0f} s",
           "bench.p7.run": (f"{run.seconds / 60:.1f} minutes = {run.seconds / step.seconds:.1f} training steps, "
                            f"peak {run.peak_GiB:.2f} GiB above the model"),
           "bench.p7.within": "within" if str(run.within) == "True" else "**over**",
           "bench.p7.passes": f"{int(run.passes)}",
           "bench.p7.estimate": f"{float(estimate.estimate_steps):.1f} training steps ({estimate.note})"}
    first = table[table["setting"] == "P7 first run"]
    if len(first):
        r = first.iloc[0]
        out["bench.p7.first"] = (f"{r.peak_GiB:.2f} GiB above the model under {r.max_memory_GiB:g} GiB, in "
                                 f"{r.seconds / 60:.1f} minutes ({r.note})")
    return out


def claim_p1(table: pd.DataFrame) -> dict:
    """benchmarks/README.md: P1 again (benchmarks/structured_p1.csv), the small GPT (and its HF twin,
    case "hf") at n = 128 and 256, every row of the run side by side (training step, ntkscope's
    methods, the anchors)."""
    rows = ["| n | model | method | seconds | × step | peak MiB | note |", "|--:|:--|:--|--:|--:|--:|:--|"]
    models = {"small": "GPT (ours)", "hf": "GPT2LMHeadModel", "mlp": "MLP"}
    for r in table[table["case"].isin(list(models))].itertuples():
        seconds = "—" if not np.isfinite(r.seconds) else f"{r.seconds:.2f}"
        steps = "—" if not np.isfinite(r.x_train_step) else f"{r.x_train_step:.2f}"
        peak = "" if not r.peak_MiB else f"{r.peak_MiB:.0f}"
        note = "" if not isinstance(r.note, str) else r.note.replace("|", "\\|")
        rows.append(f"| {int(r.n)} | {models[r.case]} | {r.method} | {seconds} | {steps} | {peak} | {note} |")
    out = {"bench.p1.table": "\n".join(rows)}
    met = fastest = runs = 0
    for case, key in (("small", "bench.p1"), ("hf", "bench.p1.hf")):
        for n, rows_n in table[table["case"] == case].groupby("n"):
            by = rows_n.set_index("method")
            step, gram = by.loc["train step", "seconds"], float(by.loc["exact", "note"].split()[2])  # "gram alone X s"
            target = 1.5 * step + gram
            margin = by.loc["structured", "seconds"] / target - 1
            exact = by.loc[[m for m in by.index if m == "exact" or m.startswith("anchor")], "seconds"]
            runs, met = runs + 1, met + (margin <= 0)
            fastest += by.loc["structured", "seconds"] < exact.min()
            out.update({f"{key}.n{int(n)}.structured": f"{by.loc['structured', 'x_train_step']:.2f}",
                        f"{key}.n{int(n)}.margin": f"{100 * abs(margin):.0f} % {'over' if margin > 0 else 'under'}",
                        f"{key}.n{int(n)}.exact": f"{by.loc['exact', 'x_train_step']:.2f}",
                        f"{key}.n{int(n)}.loop": f"{by.loc['anchor: loop+gram', 'x_train_step']:.2f}"})

    def share(k):
        return "all four rows" if k == runs == 4 else f"{k} of {runs} rows"

    out.update({"bench.p1.verdict": f"met in {share(met)}" if met else "missed in every row",
                "bench.p1.fastest": f"in {share(fastest)}"})
    return out


def claim_tail_rule(t: Tables) -> dict:
    """figures/tail/plan_rule.json: the small-cluster rule on the tail run's checkpoints."""
    plan = t["plan_rule.json"]
    at = {r["layer"]: r for r in plan["evidence"]["labels_at_warmup"]}
    return {"tail.rule.step": str(plan_step(plan)), "tail.rule.rule": plan["warmup_rule"],
            "tail.rule.layers": "–".join(map(str, plan["layers"])),
            "tail.rule.labels": "; ".join(f"layer {k}: {at[k]['n_pure_tail']} pure tail cluster, tail share "
                                          f"{at[k]['tail_share']:.2f}" for k in plan["layers"])}


def claim_sweep(t: Tables) -> dict:
    """The sweep's README lines (figures/sweep): per arm against dense, paired by seed, and the
    verdict of each pre-registered criterion; the plans' warm-ups."""
    pairs, verdict, arms = t["paired"], t["tables/verdict.json"], t["arms"]
    out = {}
    rows = ["| arm | seeds | legal | biomedical | general | all | tail better than dense (seeds) | "
            "paired t-test p (legal, biomedical) | DEMix gap closed (legal, biomedical) | shown |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, g in pairs.groupby("arm", sort=False):
        by = g.set_index("domain")
        pct = {d: f"{by.loc[d, 'pct']:+.1f} %".replace("-", "−") for d in ("legal", "biomedical", "general", "all")}
        better = f"{int(by.loc['legal', 'better_seeds'])}/{int(by.loc['legal', 'seeds'])}, " \
                 f"{int(by.loc['biomedical', 'better_seeds'])}/{int(by.loc['biomedical', 'seeds'])}"
        gap = ", ".join("—" if not np.isfinite(by.loc[d, "gap_closed"]) else f"{by.loc[d, 'gap_closed']:.2f}"
                        for d in ("legal", "biomedical"))
        p = ", ".join("—" if not np.isfinite(by.loc[d, "p"]) else f"{by.loc[d, 'p']:.3f}" for d in ("legal", "biomedical"))
        found = verdict.get(arm, {})
        shown = ({True: "yes", False: "no"}.get(found.get("shown"), "not yet (DEMix unfinished)")
                 if found.get("status") == "complete" else (found.get("status", "—") if arm in verdict else "—"))
        rows.append(f"| `{arm}` | {int(by['seeds'].max())} | {pct['legal']} | {pct['biomedical']} | {pct['general']} | "
                    f"{pct['all']} | {better} | {p} | {gap} | {shown} |")
        out[f"sweep.{arm}.shown"] = shown
        for d in ("legal", "biomedical", "general", "all"):
            out[f"sweep.{arm}.{d}.pct"] = pct[d]
    out["sweep.table"] = "\n".join(rows)
    for arm, found in verdict.items():
        if found.get("windows"):
            out[f"sweep.{arm}.starved"] = f"{found['starved_windows']} of {found['windows']}"
        for d in ("legal", "biomedical", "general"):
            numbers = (found.get("numbers") or {}).get(d)
            if numbers is not None and np.isfinite(numbers["gap_closed"]):
                out[f"sweep.{arm}.{d}.gap"] = f"{numbers['gap_closed']:.2f}"
    dense = arms[arms["arm"] == "dense"]
    out["sweep.dense"] = ", ".join(f"seed {int(r.seed)}: legal {r['ppl legal']:.1f}, biomedical {r['ppl biomedical']:.1f}, "
                                   f"general {r['ppl general']:.1f}" for _, r in dense.iterrows())
    for name in sorted(set(arms.loc[arms["kind"] == "dense", "arm"]) - {"dense"}):
        remade = arms[arms["arm"] == name]  # the same seed's trunk trained again: how far float-level differences carry
        parts = []
        for _, r in remade.iterrows():
            first_run = dense[dense["seed"] == r.seed].iloc[0]
            pct = {d: f"{100 * (r[f'ppl {d}'] / first_run[f'ppl {d}'] - 1):+.1f} %".replace("-", "−")
                   for d in ("legal", "biomedical", "general")}
            parts.append(f"seed {int(r.seed)}: legal {pct['legal']}, biomedical {pct['biomedical']}, "
                         f"general {pct['general']}")
        out["sweep.remade" if name == "dense-remade" else f"sweep.{name}.remade"] = "; ".join(parts)
    first = []
    for folder, key in [(t.folder / "plans", "sweep.plans")] + [
            (p, f"sweep.plans.{p.name}") for p in sorted((t.folder / "plans").iterdir()) if p.is_dir()]:
        plans = []
        for path in sorted(folder.glob("seed*.json")):
            plan = json.loads(path.read_text())
            first.append(min((r["step"] for r in plan["evidence"]["labels"] if r["n_pure_tail"] >= 1),
                             default=np.nan))
            at = "; ".join(f"layer {r['layer']}: {r['n_pure_tail']} pure tail, tail share {r['tail_share']:.2f}"
                           for r in plan["evidence"]["labels_at_step"])
            plans.append(f"{path.stem.replace('seed', 'seed ')}: step {plan_step(plan)} ({plan['warmup_rule']}; "
                         f"{at})")
        out[key] = "\n".join(f"- {p}" for p in plans)
    out["sweep.first_tail"] = fmt_range(first, 0)
    out.update(_tail_experts(t["routing"]))
    out["sweep.units"] = str(len(arms))
    # a unit resumed after an interruption records only its last part: the whole trunks took over 20 minutes
    trunks = arms[(arms["kind"] == "dense") & (arms["seconds"] > 1200)]["seconds"] / 60
    out["sweep.whole_trunks"] = str(len(trunks))
    late = arms[(arms["kind"] == "cse") & (arms["warmup"] == 1200) & (arms["seconds"] > 0)]["seconds"] / 60
    out["sweep.trunk_minutes"] = fmt_range(trunks, 0)
    out["sweep.late_arm_minutes"] = fmt_range(late, 0)
    for d in ("legal", "biomedical"):  # the largest difference between two trainings of one seed's trunk
        spread = max((abs(a / b - 1) for _, g in arms[arms["kind"] == "dense"].groupby("seed")
                      for a in g[f"ppl {d}"] for b in g[f"ppl {d}"]), default=np.nan)
        out[f"sweep.remade_max.{d}"] = f"{100 * spread:.1f} %"
        rule = pairs[(pairs["arm"] == "cse-rule") & (pairs["domain"] == d)]["pct"]
        if len(rule):
            out[f"sweep.cse-rule.{d}.over_remade"] = f"{abs(float(rule.iloc[0])) / (100 * spread):.1f}×"
    out["sweep.hours"] = fmt(arms["seconds"].sum() / 3600, 1)
    return out


def _tail_experts(routing: pd.DataFrame, layer: int = 3) -> dict:
    """Per routed arm (``sweep.ARM.tail_experts``): at ``layer``, for each seed and tail domain, the
    share of the domain's test blocks at its most-used expert, and that expert's share of the
    domain (its purity)."""
    out = {}
    routing = routing[routing["layer"] == layer].fillna(0)
    for arm, g in routing.groupby("arm"):
        parts = []
        for seed, rows in g.groupby("seed"):
            cells = []
            for d in ("legal", "biomedical"):
                top = rows.loc[rows[f"n {d}"].idxmax()]
                cells.append(f"{d} {100 * top[f'n {d}'] / rows[f'n {d}'].sum():.0f} % at one expert "
                             f"({100 * top[f'n {d}'] / top['n']:.0f} % {d})")
            parts.append(f"seed {int(seed)}: " + ", ".join(cells))
        out[f"sweep.{arm}.tail_experts"] = "; ".join(parts)
    return out


def claim_own_model(folder: Path) -> dict:
    """The README's "your model, your data" lines (figures/own-model): wall times, the plan, the
    comparison per domain."""
    times = json.loads((folder / "times.json").read_text())
    plan = json.loads((folder / "plan.json").read_text())
    table = pd.read_csv(folder / "comparison.csv")
    steps = ", ".join(f"{name} {seconds / 60:.1f} min" for name, seconds in times["seconds"].items())
    out = {"own.times": f"{steps}; {sum(times['seconds'].values()) / 60:.1f} min in all ({times['machine']})",
           "own.plan": f"layers {plan['layers']} and the warm-up at step {plan_step(plan)} "
                       f"(rule: {plan['warmup_rule']}; checkpoints {plan['source']['steps'][0]}–"
                       f"{plan['source']['steps'][-1]})"}
    arms = list(dict.fromkeys(table["arm"]))
    rows = ["| domain | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
    for domain, g in table.groupby("domain"):
        by = g.set_index("arm")
        cells = []
        for arm in arms:
            r = by.loc[arm]
            vs = "" if arm == "dense" else f", {100 * r['vs_dense']:+.1f} %".replace("-", "−")
            cells.append(f"{r['ppl']:.1f} [{r['ppl_low']:.1f}, {r['ppl_high']:.1f}]{vs}")
        rows.append(f"| {domain} ({int(by['texts'].iloc[0])} texts) | " + " | ".join(cells) + " |")
    out["own.table"] = "\n".join(rows)
    return out


def claim_tracker(table: pd.DataFrame) -> dict:
    """README and benchmarks/README.md: the GC tracker's overhead inside training, per setting."""
    plain = table[table["n"].isna()].iloc[0]
    out = {"bench.tracker.s_per_step": fmt(plain["wall_s"] / plain["steps"], 2),
           "bench.tracker.steps": str(int(plain["steps"]))}
    trained = table["train_s"].dropna()
    out["bench.tracker.train_range"] = f"{trained.min():.1f}–{trained.max():.1f}"
    again = table[table["arm"] == "no tracker, again"]
    if len(again):  # the same untracked run, last in the process: the drift of training over the arms
        r = again.iloc[0]
        out.update({"bench.tracker.drift": f"{100 * r.wall_excess:+.1f} %", "bench.tracker.again_s": f"{r.wall_s:.1f}",
                    "bench.tracker.train_over_again": f"{100 * (trained.min() / r.wall_s - 1):.0f}–"
                                                      f"{100 * (trained.max() / r.wall_s - 1):.0f} %"})
    for r in table[table["n"].notna()].itertuples():
        if r.arm.startswith("in-run GC"):  # every step, the training batch's domains: no estimate, no interval for 5 %
            key = "bench.tracker.inrun" + ("" if r.arm == "in-run GC" else "." + r.arm.split(", ")[1].replace(" ", ""))
            out.update({f"{key}.overhead": f"{100 * r.overhead:.1f} %", f"{key}.probe_s": fmt(r.s_per_probe, 3),
                        f"{key}.same_losses": "identical" if r.same_losses else "different",
                        f"{key}.wall_excess": f"{100 * r.wall_excess:.1f} %"})
            continue
        key = f"bench.tracker.n{int(r.n)}.every{int(r.every)}" + (".per_layer" if r.arm.endswith("per layer") else "")
        out.update({f"{key}.overhead": f"{100 * r.overhead:.1f} %", f"{key}.probe_s": fmt(r.s_per_probe, 1),
                    f"{key}.estimate_s": fmt(r.estimate_s, 1), f"{key}.wall_excess": f"{100 * r.wall_excess:.1f} %",
                    f"{key}.same_losses": "identical" if r.same_losses else "different", f"{key}.method": r.method,
                    f"{key}.every_for_5pct": str(int(np.ceil(r.every_for_5pct)))})
        if "floor_s" in table and not pd.isna(r.floor_s):  # the probe's forward and backward, timed in the run
            out.update({f"{key}.floor_s": fmt(r.floor_s, 2), f"{key}.over_floor": fmt(r.probe_over_floor, 2),
                        f"{key}.floor_target": "met" if r.probe_over_floor <= 1.5 else "missed"})
    layered, flat = (table[(table["n"] == 128) & (table["every"] == 100) & table["arm"].str.endswith(end)]
                     for end in ("per layer", "tracker"))
    if len(layered) and len(flat):  # the issue's "per_layer at most twice" the plain tracker's share
        ratio = layered["overhead"].iloc[0] / flat["overhead"].iloc[0]
        out["bench.tracker.per_layer_ratio"] = fmt(ratio, 2)
        out["bench.tracker.per_layer_twice"] = "held" if ratio <= 2 else "not held"
    return out


def claim_inrun_sketch(summary: pd.DataFrame, tracker: pd.DataFrame | None = None) -> dict:
    """docs/tracking.md, benchmarks/README.md and README: the sketched in-run GC against the exact
    one on the same steps (benchmarks/inrun_sketch_summary.csv), per width, on every row and on
    the rows whose exact direction no flag marks; with its overhead every step from
    benchmarks/tracker.csv where that has the width's arm."""
    out, lines = {}, []
    overhead = {}
    if tracker is not None:
        for r in tracker[tracker["arm"].str.startswith("in-run GC, sketch")].itertuples():
            overhead[int(r.arm.rsplit(" ", 1)[1])] = f"{100 * r.overhead:.1f} %"
    for _, r in summary.iterrows():
        width, over, flagged = int(r["width"]), int(r["over_0.1"]), int(r["over_0.1_flagged"])
        key = f"bench.sketch.k{width}.{'all' if r['rows'] == 'all' else 'defined'}"
        out.update({f"{key}.n": str(int(r["n"])), f"{key}.pearson": fmt(r["pearson"], 3),
                    f"{key}.pearson_abs": fmt(r["pearson_abs"], 3), f"{key}.max_diff": fmt(r["max_abs_diff"], 2),
                    f"{key}.median_diff": f"{r['median_abs_diff']:.1e}",
                    f"{key}.same_sign": f"{100 * r['same_sign']:.0f} %", f"{key}.over": str(over),
                    f"{key}.over_flagged": str(flagged)})
        rows = "every row" if r["rows"] == "all" else "not flagged"
        lines.append(f"| {width} | {overhead.get(width, '—')} | {rows} ({int(r['n'])}) | {fmt(r['pearson'], 3)} | "
                     f"{fmt(r['pearson_abs'], 3)} | {fmt(r['max_abs_diff'], 2)} | {100 * r['same_sign']:.0f} % | "
                     f"{over} ({flagged} flagged) |")
    out["bench.sketch.table"] = "\n".join(
        ["| width | overhead every step | rows | Pearson r (GC) | r (\\|GC\\|) | largest difference | same sign | "
         "rows off by more than 0.1 |", "|---|---|---|---|---|---|---|---|"] + lines)
    return out


def claim_inrun(table: pd.DataFrame, key: str = "bench.inrun") -> dict:
    """docs/tracking.md and benchmarks/README.md: in-run GC's overhead every step (benchmarks/inrun.csv
    on the CPU; benchmarks/inrun_gpu.csv, ``key`` bench.inrun.gpu, on a GPU)."""
    plain = table[table["arm"] == "plain"].iloc[0]
    inrun = table[table["arm"] == "in-run GC"].iloc[0]
    return {f"{key}.step_s": fmt(plain["s_per_step"], 3), f"{key}.gc_s": fmt(inrun["gc_s"], 3),
            f"{key}.overhead": f"{100 * inrun['overhead']:.0f} %",
            f"{key}.same_losses": "identical" if bool(inrun["same_losses"]) else "different",
            f"{key}.layers": str(int(inrun["layers_hooked"])), f"{key}.steps": str(int(inrun["steps"])),
            f"{key}.rounds": str(int(inrun["rounds"])), f"{key}.machine": str(inrun["machine"])}


def claim_tracked(t) -> dict:
    """README: Figure 3(a) from the tracker (figures/tail/tables/gc_tracked.csv) against the
    checkpoints' series (gc_over_steps.csv, draw 0) at the steps both measured."""
    tracked, walked = t["gc_tracked"], t["gc_over_steps"]
    walked = walked[walked["draw"] == 0] if "draw" in walked else walked
    both = tracked.merge(walked, on="step", suffixes=("", "_checkpoints"))
    diff = (both["abs_gc"] - both["abs_gc_checkpoints"]).abs()
    same = (both["versus_null"] == both["versus_null_checkpoints"]).sum()
    peak = gc_peak(tracked)
    early = both["step"] <= 150
    return {"tracked.probes": str(len(tracked)), "tracked.common": str(len(both)),
            "tracked.max_diff": f"{diff.max():.1e}", "tracked.first_diff": f"{diff.iloc[0]:.0e}",
            "tracked.first_step": str(int(both["step"].iloc[0])),
            "tracked.early_diff": f"{diff[early].max():.0e}", "tracked.same_verdict": f"{int(same)} of {len(both)}",
            "tracked.peak": f"at step {peak['step']}" if peak["shown"] else "not shown",
            "tracked.seconds": fmt(float(tracked["seconds"].median()), 1),
            "tracked.cka_min": fmt(float(tracked["kernel_cka"].min()), 3),
            "tracked.cka_min_step": str(int(tracked.loc[tracked["kernel_cka"].idxmin(), "step"]))}


def _band_cell(row, name: str) -> str:
    """"median [low, high]" of a band's columns, or "—" where it was not drawn (NaN)."""
    median = getattr(row, f"{name}_median")
    return "—" if median != median else f"{median:.2f} [{getattr(row, f'{name}_low'):.2f}, " \
                                        f"{getattr(row, f'{name}_high'):.2f}]"


def claim_experts(folder: Path) -> dict:
    """docs/figures.md: Figure 5(b, c) on the late-converted models (figures/warmup-map/fresh/experts:
    experts.csv and verdicts.json of ``ntkscope experiment experts``), the registered verdicts and
    a row per judged expert."""
    table, verdicts = pd.read_csv(folder / "experts.csv"), json.loads((folder / "verdicts.json").read_text())
    one, three = verdicts["experts_more_consistent"], verdicts["tail_experts"]
    seeds = sorted(int(s) for s in table["seed"].unique())
    out = {"experts.fresh.seeds": f"{len(seeds)} of 5 seeds ({', '.join(map(str, seeds))})",
           "experts.fresh.verdict1": f"{one['verdict']}: {one['wins']} of {one['seeds_ran']} seeds measured have more "
                                     "than half of their judged experts more consistent"
                                     + (f" ({one['why']})" if "why" in one else ""),
           "experts.fresh.verdict3": f"{three['verdict']}: {three['wins']} of {three['seeds_with_tail_expert']} seeds "
                                     "with a tail expert have one more consistent"}
    judged = table[table["judged"].astype(bool)]
    more = int(judged["more_consistent"].astype(bool).sum())
    coherent = int(judged["coherent_in_dense"].astype(bool).sum())
    out["experts.fresh.counts"] = (f"{more} of {len(judged)} judged experts more consistent than the dense FFN; "
                                   f"{coherent} of {len(judged)} clusters coherent in the dense model already")
    positive = int((judged["diff_median"] > 0).sum())
    out["experts.fresh.positive"] = (f"{positive} of {len(judged)} judged experts have a positive median paired "
                                     f"difference (mean {judged['diff_median'].mean():+.3f})")
    homogeneous = "homogeneous_median" in judged
    lines = ["| seed | layer | expert | blocks | top domain | expert | dense, same blocks | expert − dense | "
             "dense, random blocks |" + (" dense, ordinary blocks |" if homogeneous else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if homogeneous else "")]
    for r in judged.sort_values(["seed", "layer", "expert"]).itertuples():
        lines.append(f"| {r.seed} | {r.layer} | {r.expert} | {r.units} | {r.top_domain} ({100 * r.top_share:.0f} %) | "
                     f"{_band_cell(r, 'expert')} | {_band_cell(r, 'dense')} | "
                     f"{r.diff_median:+.2f} [{r.diff_low:+.2f}, {r.diff_high:+.2f}] | {_band_cell(r, 'null')} |"
                     + (f" {_band_cell(r, 'homogeneous')} |" if homogeneous else ""))
    out["experts.fresh.table"] = "\n".join(lines)
    return out
