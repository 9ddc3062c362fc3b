"""The warm-up map's claims (figures/warmup-map, docs/warmup-map.md and the README): the arms at
step 1200, the map over conversion steps, the pre-registered verdicts, the rule in each trunk
(in sample, out of sample, the second mix), the layer check and the two builds of the trunks.
:mod:`doc_claims.claims` gathers them with the others."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from doc_claims.values import Tables, fmt_range

IN_SAMPLE = (0, 1, 2)  # the seeds the sweep's rule was designed beside (CRITERIA.md)


def _pct(gain: float) -> str:
    """A log-perplexity difference as a signed percent change of perplexity."""
    return f"{100 * np.expm1(gain):+.1f} %".replace("-", "−")


def _cell(g: pd.Series) -> str:
    return _pct(g.mean()) + ("" if len(g) == 1 else f" ({_pct(g.min())} to {_pct(g.max())})")


def _seeds(seeds) -> str:
    return ", ".join(str(int(s)) for s in seeds) or "none"


def _at_step(at: pd.DataFrame, verdicts: dict, prefix: str = "map") -> dict:
    rows = ["| arm | seeds ran | tail (legal, biomedical) | legal | biomedical | general | against `dense-null` |",
            "|---|---|---|---|---|---|---|"]
    out = {}
    for arm in at[at["domain"] == "tail"].groupby("arm")["gain"].mean().sort_values().index:
        part = at[at["arm"] == arm]
        cells = {d: _cell(part[part["domain"] == d]["gain"]) for d in ("tail", "legal", "biomedical", "general")}
        out.update({f"{prefix}.{arm}.{d}": _pct(part[part["domain"] == d]["gain"].mean())
                    for d in ("tail", "legal", "biomedical", "general")})
        seeds = sorted(int(s) for s in part["seed"].unique())
        floor = verdicts["against_null"].get(arm, {})
        verdict = floor.get("verdict", "—") if arm != "dense-null" else "—"
        if floor.get("on_seeds_ran"):
            verdict += f" (on the seeds that ran: {floor['on_seeds_ran']})"
        out[f"{prefix}.{arm}.seeds"] = _seeds(seeds)
        out[f"{prefix}.{arm}.null"] = verdict
        rows.append(f"| `{arm}` | {_seeds(seeds)} | {cells['tail']} | {cells['legal']} | {cells['biomedical']} | "
                    f"{cells['general']} | {verdict} |")
    out[f"{prefix}.table"] = "\n".join(rows)
    null = at[(at["arm"] == "dense-null") & (at["domain"] == "tail")]["gain"]
    out[f"{prefix}.null.range"] = f"{_pct(null.min())} to {_pct(null.max())}"
    out[f"{prefix}.units"] = f"{verdicts['units']['done']} of {verdicts['units']['planned']}"
    out[f"{prefix}.seeds"] = str(len(verdicts["seeds"]))
    tail = at[at["domain"] == "tail"].groupby("arm")["gain"].mean()
    if {"cse", "demix"} <= set(tail.index):
        out[f"{prefix}.cse.demix_share"] = f"{tail['cse'] / tail['demix']:.2f}"
    return out


def _verdict_lines(verdicts: dict, prefix: str = "map", written_for: int = 5) -> dict:
    out = {}
    for name in ("clusters_vs_shuffled", "cse_vs_fair", "cse_vs_scratch"):
        if name not in verdicts:
            continue
        v = verdicts[name]
        text = v["verdict"]
        few = len(v["seeds_ran"]) < written_for and text in ("shown", "not shown")  # the criteria's seeds
        if few:
            text += f" on {len(v['seeds_ran'])} seeds only (a hint: the criteria were written for {written_for})"
        if "why" in v:
            text += f": {v['why']}"
        hint = v.get("on_seeds_ran")
        if hint:
            text += (f"; on the seeds that ran, CSE is lower in {hint['wins']}, by "
                     f"{_pct(v['mean_difference'])} on average against a null spread of ±{_pct(hint['null_spread'])[1:]}"
                     f" ({'the test passes there' if hint['shown'] else 'the test fails there'})")
        elif v["mean_difference"] is not None:
            text += (f": CSE is lower in {v['wins']} of {len(v['seeds_ran'])} seeds, by {_pct(v['mean_difference'])} "
                     f"on average against a null spread of ±{_pct(v['null_spread'])[1:]}")
        same = v.get("same_trunks", [])
        text += (f"; both arms branched from the same build of the trunk at seeds {_seeds(same)} only" if
                 len(same) < len(v["seeds_ran"]) else "; every pair on one build of the trunk")
        out[f"{prefix}.{name}"] = text
        out[f"{prefix}.{name}.short"] = f"{v['verdict']}, lower in {v['wins']} of {len(v['seeds_ran'])} seeds"
        strict = v.get("strict")
        if strict:
            line = (f"{strict['verdict']}{' (a hint)' if few else ''} against the spread of a difference of two arms "
                    f"(√2 × the null spread, ±{_pct(strict['difference_spread'])[1:]})")
            if strict["other_harm_share"]:
                line += (f"; the control's own harm ({_pct(strict['other_mean_gain'])} over dense) is "
                         f"{100 * strict['other_harm_share']:.0f} % of the difference")
            out[f"{prefix}.{name}.strict"] = line
    return out


def _curve(tail: pd.DataFrame) -> dict:
    mapped = [a for a, part in tail.groupby("arm") if part["step"].nunique() > 1]
    steps = sorted(tail.loc[tail["arm"].isin(mapped), "step"].unique())
    rows = ["| arm | " + " | ".join(f"step {s}" for s in steps) + " |", "|---|" + "---|" * len(steps)]
    out = {}
    for arm in sorted(mapped, key=lambda a: tail.loc[tail["arm"] == a, "gain"].mean()):
        part = tail[tail["arm"] == arm]
        cells = []
        for s in steps:
            g = part[part["step"] == s]["gain"]
            cells.append(f"{_cell(g)}, {len(g)} seeds" if len(g) else "—")
        rows.append(f"| `{arm}` | " + " | ".join(cells) + " |")
        mean = part.groupby("step")["gain"].mean()
        out[f"map.curve.{arm}.best_step"] = str(int(mean.idxmin()))
    out["map.curve"] = "\n".join(rows)
    cse = tail[tail["arm"] == "cse"]
    best = cse.loc[cse.groupby("seed")["gain"].idxmin()]
    out["map.curve.cse.best_steps"] = ", ".join(f"{int(r.step)} (seed {int(r.seed)})" for r in best.itertuples())
    low, high = int(best["step"].min()), int(best["step"].max())
    out["map.curve.cse.best_range"] = str(low) if low == high else f"{low}–{high}"
    return out


def _rule_rows(rule: dict, label) -> tuple[list, dict]:
    rows, counts = [], {}
    for seed, v in sorted(rule.items(), key=lambda kv: int(kv[0])):
        where = label(int(seed))
        c = counts.setdefault(where, {"good": 0, "chose": 0, "nothing": 0, "trunks": 0})
        c["trunks"] += 1
        if v["verdict"] == "the rule chose nothing":
            c["nothing"] += 1
            rows.append(f"| {where} | {seed} | none (fell back to {v['rule_step']}) | — | — | chose nothing | — |")
            continue
        c["chose"] += 1
        c["good"] += v["verdict"] == "good"
        own = v.get("on_plan_trunks")
        alone = f"{own['verdict']} (best {own['best_step']})" if own else "—"
        rows.append(f"| {where} | {seed} | {v['rule_step']} | {_pct(v['gain_at_rule'])} | {v['best_step']} "
                    f"({_pct(v['best_gain'])}) | {v['verdict']} | {alone} |")
    return rows, counts


def _rule(verdicts: dict, mix: dict | None) -> dict:
    header = ["| trunks | seed | rule's step | tail gain there | best map step (gain) | verdict | "
              "on the plan's build alone |", "|---|---|---|---|---|---|---|"]
    rows, counts = _rule_rows(verdicts["rule"], lambda s: "in sample" if s in IN_SAMPLE else "out of sample")
    if mix:
        more, mixed = _rule_rows(mix["rule"], lambda s: "second mix")
        rows += more
        counts.update(mixed)
    out = {"map.rule.table": "\n".join(header + rows)}
    for where, c in counts.items():
        key = where.replace(" ", "_")
        out[f"map.rule.{key}"] = (f"good in {c['good']} of the {c['chose']} trunks where it chose"
                                  + (f" (it chose nothing in {c['nothing']})" if c["nothing"] else ""))
    steps = [v["rule_step"] for v in verdicts["rule"].values() if v["verdict"] != "the rule chose nothing"]
    if mix:
        steps += [v["rule_step"] for v in mix["rule"].values() if v["verdict"] != "the rule chose nothing"]
    out["map.rule.steps"] = f"{min(steps)}–{max(steps)}" if steps else "none"
    good = sum(c["good"] for c in counts.values())
    out["map.rule.good"] = f"{good} of {sum(c['chose'] for c in counts.values())}"
    return out


def _layers(verdicts: dict) -> dict:
    v = verdicts["layers"]
    rows = ["| seed | structure {0, 1} | structure {2, 3} | tail gain {0, 1} | tail gain {2, 3} | one build | verdict |",
            "|---|---|---|---|---|---|---|"]
    for seed, e in sorted(v["trunks"].items(), key=lambda kv: int(kv[0])):
        rows.append(f"| {seed} | {e['structure']['0-1']:.3f} | {e['structure']['2-3']:.3f} | "
                    f"{_pct(e['tail_gain']['0-1'])} | {_pct(e['tail_gain']['2-3'])} | "
                    f"{'yes' if e['same_trunks'] else 'no'} | {e['verdict']} |")
    trunks = v["trunks"].values()
    bare = [s for s, e in sorted(v["trunks"].items(), key=lambda kv: int(kv[0])) if min(e["structure"].values()) == 0]
    both = [e for e in trunks if min(e["structure"].values()) > 0 and e["verdict"] in ("agrees", "disagrees")]
    return {"map.layers.table": "\n".join(rows), "map.layers.agree": f"{v['agree']} of {v['judged']}",
            "map.layers.bare": " and ".join(bare) or "none",
            "map.layers.both_agree": f"{sum(e['verdict'] == 'agrees' for e in both)} of {len(both)}",
            "map.layers.late_better": f"{sum(e['tail_gain']['2-3'] < e['tail_gain']['0-1'] for e in trunks)} of "
                                      f"{len(v['trunks'])}"}


def _builds(folder) -> dict:
    """How far the re-made trunks (another GPU kind) are from the first ones, per domain."""
    out, worst = {}, (0.0, "", 0)
    for d in ("legal", "biomedical", "general"):
        diffs = []
        for path in sorted((folder / "h100" / "results").glob("dense-seed*.json")):
            other = folder / "results" / path.name
            if other.is_file():
                a, b = json.loads(path.read_text()), json.loads(other.read_text())
                diffs.append((abs(np.log(b[f"ppl {d}"]) - np.log(a[f"ppl {d}"])), int(a["seed"])))
        if diffs:
            top = max(diffs)
            out[f"map.builds.{d}"] = f"{100 * np.expm1(top[0]):.1f} %"
            worst = max(worst, (top[0], d, top[1]))
    if worst[1]:
        out["map.builds.max"] = f"{100 * np.expm1(worst[0]):.1f} % ({worst[1]}, seed {worst[2]})"
    remade = []  # the H200's trunks re-made on another H200 (remade/): float rounding, not another build
    for path in sorted((folder / "remade" / "results").glob("dense-seed*.json")):
        a, b = json.loads((folder / "results" / path.name).read_text()), json.loads(path.read_text())
        la, lb = np.asarray(a["blocks"]["loss"]), np.asarray(b["blocks"]["loss"])
        remade.append(float(np.max(np.abs(lb - la) / np.abs(la))))
    if remade:
        out["map.remade.max"] = f"{max(remade):.1e}".replace("e-0", " × 10^-")
        out["map.remade.trunks"] = str(len(remade))
    return out


def _curves(folder) -> dict:
    """The trunk curves (tables/curves.csv): how many trunks, how often, and the arms that logged."""
    path = folder / "tables" / "curves.csv"
    if not path.is_file():
        return {}
    curves = pd.read_csv(path)
    trunks = curves[curves["arm"] == "dense"]
    steps = np.diff(sorted(trunks["step"].unique()))
    return {"map.curves.trunks": str(trunks["seed"].nunique()), "map.curves.every": f"{int(np.median(steps))}",
            "map.curves.arms": str(curves[curves["arm"] != "dense"].groupby(["arm", "seed"]).ngroups)}


def _flicker(folder) -> dict:
    """How often a trunk's consensus structure at a sparse layer falls back to zero inside the
    rule's window after it first appeared (the single-fit rule's failure, measured again)."""
    drops, series, firsts = 0, 0, []
    for path in sorted((folder / "plans").glob("seed*.json")):
        evidence = json.loads(path.read_text())["evidence"]
        window = set(evidence["structure_rule"]["window"])
        for layer in evidence["structure_rule"]["judged_at_layers"]:
            rows = [r for r in evidence["structure"][str(layer)] if r["step"] in window]
            values = [r["structure"] for r in rows]
            first = next((i for i, v in enumerate(values) if v > 0), None)
            series += 1
            drops += first is not None and any(v == 0 for v in values[first:])
            if first is not None:
                firsts.append(int(rows[first]["step"]))
    if not series:
        return {}
    return {"map.structure.drops": f"{drops} of {series}",
            "map.structure.first": f"{min(firsts)}–{max(firsts)}" if firsts else "never"}


def _seconds(folder, prefix: str = "map") -> dict:
    """The units' own times on the lent GPU (their state files), trunks and arms apart."""
    states = [json.loads(p.read_text()) for p in sorted((folder / "units").glob("*.json"))]
    took = pd.DataFrame([{"name": s["name"], "seconds": s["seconds"]} for s in states if s.get("seconds")])
    if took.empty:
        return {}
    kind = np.where(took["name"].str.startswith("dense-seed"), "trunk",
                    np.where(took["name"].str.startswith("plan-"), "plan", "arm"))
    return {f"{prefix}.seconds.{k}": f"{took.loc[kind == k, 'seconds'].median():.0f} s" for k in ("trunk", "plan", "arm")
            if (kind == k).any()}


def claim_warmup_map(t: Tables) -> dict:
    """The warm-up map's lines (figures/warmup-map and its second mix in mix/)."""
    gains, verdicts = t["gains"], t["tables/verdicts.json"]
    at = gains[gains["step"] == verdicts["step"]]
    out = {**_at_step(at, verdicts), **_verdict_lines(verdicts), **_curve(gains[gains["domain"] == "tail"])}
    tail = at[at["domain"] == "tail"]
    out["map.block_halfwidth"] = f"{100 * ((tail['high'] - tail['low']) / 2).median():.1f} %"
    mix_file = t.folder / "mix" / "tables" / "verdicts.json"
    mix = json.loads(mix_file.read_text()) if mix_file.is_file() else None
    if mix:
        out["map.mix.units"] = f"{mix['units']['done']} of {mix['units']['planned']}"
        m = pd.read_csv(t.folder / "mix" / "tables" / "gains.csv")
        out["map.mix.curve"] = _curve(m[m["domain"] == "tail"])["map.curve"] if m["step"].nunique() > 1 else ""
    out.update(_rule(verdicts, mix))
    out.update(_layers(verdicts))
    out.update(_builds(t.folder))
    out.update(_seconds(t.folder))
    out.update(_flicker(t.folder))
    out.update(_curves(t.folder))
    out.update(_scale(t.folder / "scale"))
    out.update(_scale_grown(t.folder / "scale-grown"))
    out.update(_count(t.folder / "count"))
    out.update(_signals(t.folder))
    return out


def _signals(folder) -> dict:
    """The candidate warm-up signals' cross-validation (figures/warmup-map/signals) and the fresh
    trunks' verdict (figures/warmup-map/fresh), when they exist."""
    path = folder / "signals" / "rule.json"
    if not path.is_file():
        return {}
    rule = json.loads(path.read_text())
    cv = pd.read_csv(folder / "signals" / "cv.csv")
    grid = pd.read_csv(folder / "signals" / "thresholds.csv")
    n = rule["trunks"]
    rows = [f"| signal | reads | good held out | threshold on all {n} | good in sample | its steps on the {n} trunks |",
            "|---|---|---|---|---|---|"]
    for name, g in cv.groupby("signal", sort=False):
        th = rule["thresholds"][name]
        at = grid[(grid["signal"] == name) & np.isclose(grid["threshold"], th)].iloc[0]
        reads = "labels" if not bool(g["label_free"].iloc[0]) else "no labels"
        rows.append(f"| `{name}` | {reads} | {int(g['good'].sum())} of {n} | {th:g} | {int(at['good'])} of {n} | "
                    f"{at['steps']} |")
    measured = {k: v for k, v in rule["cv_record"].items() if k != "schedule-fraction"}
    out = {"map.signals.table": "\n".join(rows), "map.signals.count": str(len(rule["cv_record"])),
           "map.signals.rule": f"`{rule['signal']}` at {rule['threshold']:g}",
           "map.signals.rule_good": f"{rule['cv_good']} of {n}",
           "map.signals.best_measured": f"{max(measured.values())} of {n}",
           "map.signals.trunks": str(n)}
    fresh = folder / "fresh" / "verdicts.json"
    if fresh.is_file():
        v = json.loads(fresh.read_text())["rule_on_fresh_trunks"]
        done = sum(json.loads(p.read_text()).get("status") == "done" for p in fresh.parent.glob("*/units/*.json"))
        decided = "".join(f"; {d}" for d in v.get("decided_by", []))
        of = f", of {v['planned']}" if v["judged"] < v["planned"] else ""
        out["map.fresh.verdict"] = (f"{v['verdict']}{decided} ({done} units on the CPU build; the rule "
                                    f"good in {v['good']} of the {v['judged']} trunks judged{of})")
        for family, f in v["per_family"].items():  # e.g. map.fresh.family.warmup-fresh: "2 of 5"
            out[f"map.fresh.family.{family}"] = f"{f['good']} of {f['judged']}"
        out["map.fresh.short"] = f"{v['verdict']}, good in {v['good']} of the {v['judged']} trunks judged"
        trunks = pd.read_csv(fresh.parent / "trunks.csv")
        rule_rows = trunks[trunks["signal"].str.startswith("rule") & trunks["verdict"].isin(["good", "not good"])]
        table = ["| family | seed | best step (tail gain) | the rule's step (tail gain) | share of the best | verdict |",
                 "|---|---|---|---|---|---|"]
        for r in rule_rows.itertuples():
            table.append(f"| `{r.family}` | {r.seed} | {int(r.best_step)} ({_pct(r.best_gain)}) | {int(r.step)} "
                         f"({_pct(r.gain)}) | {100 * r.gain / r.best_gain:.0f} % | {r.verdict} |")
        out["map.fresh.table"] = "\n".join(table)
        for family, g in rule_rows.groupby("family"):  # e.g. map.fresh.best.warmup-fresh: "1800 in 3, ... of 5 trunks"
            counts = g["best_step"].astype(int).value_counts()
            counts = counts.sort_index(ascending=False).sort_values(ascending=False, kind="stable")
            parts = [f"{s} in {n}" for s, n in counts.items()]
            out[f"map.fresh.best.{family}"] = (", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1
                                               else parts[0]) + f" of {len(g)} trunks"
        out["map.fresh.best_fraction"] = f"{rule_rows['best_fraction'].min():g}–{rule_rows['best_fraction'].max():g}"
        signals = json.loads(fresh.read_text()).get("signals", {})
        out["map.fresh.signals"] = "; ".join(f"`{name.rsplit(' ', 1)[0]}` at {name.rsplit(' ', 1)[1]}: good in "
                                             f"{e['good']} of {e['judged']}" for name, e in signals.items())
        short = sorted(100 * r.gain / r.best_gain for r in rule_rows.itertuples()  # the half schedule's trunks
                       if r.verdict == "not good" and r.family == "warmup-fresh-half")
        if short:
            out["map.fresh.short_share"] = f"{short[0]:.0f}–{short[-1]:.0f} %" if len(short) > 1 else f"{short[0]:.0f} %"
        probe = json.loads(fresh.read_text()).get("tail_expert")
        if probe:
            half = "; ".join(f"{k.split(' seed ')[1]}: step {v['step']}, {v['verdict']}"
                             for k, v in probe["reported"].items())
            so_far = " so far" if probe["judged"] < probe["planned"] else ""
            fired = trunks[(trunks["signal"] == probe["signal"]) & trunks["family"].isin(probe["judged_by"])]
            out["map.fresh.tail_expert.steps"] = "; ".join(
                f"{r.family.removeprefix('warmup-fresh-') if r.family != 'warmup-fresh' else 'main'} {r.seed}: "
                f"{'nothing' if pd.isna(r.step) else int(r.step)} (best {int(r.best_step)})" for r in fired.itertuples())
            out["map.fresh.tail_expert"] = (
                f"{probe['verdict']}" + (f" ({probe['decided_by']})" if "decided_by" in probe else "")
                + f"; good in {probe['good']} of the {probe['judged']} trunks judged{so_far}"
                + (f", of {probe['planned']}" if so_far else "")
                + (f"; on the half family's trunks, reported only (seed: its step, verdict): {half}" if half else ""))
            out["map.fresh.tail_expert.short"] = f"{probe['verdict']}, good in {probe['good']} of {probe['judged']}"
        layers = json.loads(fresh.read_text()).get("layers", {})
        judged = [(f.removeprefix("warmup-fresh-") if f != "warmup-fresh" else "main", e)
                  for f, e in layers.items() if e.get("judged")]
        out["map.fresh.layers"] = "; ".join(f"{name}: agrees in {e['agree']} of {e['judged']} trunks"
                                            for name, e in judged) or "not yet judged"
        if judged:
            out["map.fresh.layers.total"] = (f"{sum(e['agree'] for _, e in judged)} of "
                                             f"{sum(e['judged'] for _, e in judged)}")
        best = json.loads(fresh.read_text())["step_or_position"]["best_fraction"]
        steps = sorted(round(1200 * f) for f in best.values() if f is not None)  # the half family's 1200 steps
        if steps:
            counts = {s: steps.count(s) for s in sorted(set(steps))}
            out["map.fresh.half_best"] = " and ".join(f"{s} in {n}" for s, n in counts.items()) + \
                f" of {len(best)} trunks"
    else:
        out["map.fresh.verdict"] = "not yet run"
    return out


def _count(folder) -> dict:
    """The count question (figures/warmup-map/count): CSE at 300 and 1200 with its own fit and
    with the other step's expert counts, 3 seeds; its registered verdicts, and how far its CSE
    re-runs are from the map's same units."""
    path = folder / "tables" / "verdicts.json"
    if not path.is_file():
        return {}
    count = json.loads(path.read_text())["count"]
    gains = pd.read_csv(folder / "tables" / "gains.csv")
    tail = gains[gains["domain"] == "tail"]
    rows = ["| seed | experts at 300 (own) | at 1200 (own) | CSE at 300 | at 300, 1200's count | CSE at 1200 | "
            "at 1200, 300's count |", "|---|---|---|---|---|---|---|"]
    trained = pd.read_csv(folder / "tables" / "experts.csv")

    def experts(arm, seed):  # the experts the unit trained with, layer by layer
        part = trained[(trained["arm"] == arm) & (trained["seed"] == seed)].sort_values("layer")
        return "/".join(str(int(k)) for k in part["experts"]) or "—"

    for seed in count["seeds"]:
        cell = lambda arm, step: _pct(tail[(tail["arm"] == arm) & (tail["step"] == step)  # noqa: E731
                                           & (tail["seed"] == seed)]["gain"].iloc[0])
        rows.append(f"| {seed} | {experts('cse-at300', seed)} | {experts('cse-at1200', seed)} | {cell('cse', 300)} | "
                    f"{cell('cse-at300-k1200', 300)} | {cell('cse', 1200)} | {cell('cse-at1200-k300', 1200)} |")
    out = {"map.count.table": "\n".join(rows), "map.count.margin": f"±{_pct(count['margin'])[1:]}"}
    for name in ("count_matters_late", "count_brings_gain_early"):
        v = count[name]
        out[f"map.count.{name}"] = (f"{v['verdict']} (3 seeds, a hint): {_pct(v['mean'])} on average, on the same "
                                    f"side in {v['same_side']} of {len(v['per_seed'])} seeds, "
                                    f"{100 * v.get('share_of_late_gain', float('nan')):.0f} % of CSE's step-1200 gain")
        out[f"map.count.{name}.share"] = f"{100 * v.get('share_of_late_gain', float('nan')):.0f} %"
    mine = tail[tail["arm"] == "cse"].set_index(["step", "seed"])["gain"]
    theirs = pd.read_csv(folder.parent / "tables" / "gains.csv")
    theirs = theirs[(theirs["arm"] == "cse") & (theirs["domain"] == "tail")].set_index(["step", "seed"])["gain"]
    both = mine.index.intersection(theirs.index)
    if len(both):
        out["map.count.rerun_max"] = f"{float((mine[both] - theirs[both]).abs().max()):.1e}".replace("e-0", " × 10^-")
    return out


def _scale_grown(folder) -> dict:
    """Issue 60's run (figures/warmup-map/scale-grown: 8 layers x 512 on the grown pack, step 600,
    three seeds): its arms and registered verdicts, the trunks against the map's small ones per
    domain, CSE at a quarter of the schedule against half, and the units' times."""
    if not (folder / "tables" / "verdicts.json").is_file():
        return {}
    verdicts = json.loads((folder / "tables" / "verdicts.json").read_text())
    gains = pd.read_csv(folder / "tables" / "gains.csv")
    out = {**_at_step(gains[gains["step"] == verdicts["step"]], verdicts, "grown"),
           **_verdict_lines(verdicts, "grown", written_for=len(verdicts["seeds"])), **_seconds(folder, "grown")}
    fits = verdicts.get("fits_its_data")
    if fits:
        rows = ["| domain | 8 × 512 on the grown pack (seeds) | 4 × 128 on the shipped pack (seeds) | every seed lower |",
                "|---|---|---|---|"]
        mine, theirs = (k for k in next(iter(fits["domains"].values())) if k != "below")
        for d, v in fits["domains"].items():
            rows.append(f"| {d} | {fmt_range(v[mine], 1)} ({len(v[mine])}) | {fmt_range(v[theirs], 1)} ({len(v[theirs])}) | "
                        f"{'yes' if v['below'] else 'no'} |")
        out["grown.trunks.table"] = "\n".join(rows)
        out["grown.fits"] = fits["verdict"]
    pack = folder / "pack" / "manifest.json"
    if pack.is_file():
        train = json.loads(pack.read_text())["splits"]["train"]
        out["grown.pack.tokens"] = f"{train['bpe_tokens'] / 1e6:.2f} M"
        out["grown.pack.tokens_short"] = f"{train['bpe_tokens'] / 1e6:.1f} M"
        out["grown.pack.tail_share"] = f"{100 * (1 - train['by_domain']['general']['bpe_tokens'] / train['bpe_tokens']):.1f} %"
    trunks = folder / "tables" / "trunks.csv"
    if trunks.is_file():
        blocks = pd.read_csv(trunks).groupby("domain")["blocks"].first()
        out["grown.test_blocks"] = (f"{int(blocks.sum())} test blocks are the map's (the tail's share of them is "
                                    f"small: {int(blocks['legal'])} legal and {int(blocks['biomedical'])} biomedical "
                                    "blocks)")
    tail = gains[(gains["domain"] == "tail") & (gains["arm"] == "cse")].pivot_table(index="seed", columns="step",
                                                                                      values="gain")
    if tail.shape[1] == 2:
        early, late = tail.columns
        lower = int((tail[early] < tail[late]).sum())
        out["grown.early"] = (f"{_pct(tail[early].mean())} at step {early} against {_pct(tail[late].mean())} at step "
                              f"{late} on average; lower at {early} in {lower} of {len(tail)} seeds")
    return out


def _scale(folder) -> dict:
    """The medium-scale hint (figures/warmup-map/scale: 8 layers x 512, step 1200, two seeds):
    its arms and verdicts as the map's, and its dense trunks' perplexity beside the map's."""
    if not (folder / "tables" / "verdicts.json").is_file():
        return {}
    verdicts = json.loads((folder / "tables" / "verdicts.json").read_text())
    gains = pd.read_csv(folder / "tables" / "gains.csv")
    out = {**_at_step(gains[gains["step"] == verdicts["step"]], verdicts, "scale"),
           **_verdict_lines(verdicts, "scale"), **_seconds(folder, "scale")}
    for name, where in (("scale", folder), ("map", folder.parent)):
        ppl = [json.loads(p.read_text())["ppl"] for p in sorted((where / "results").glob("dense-seed*.json"))]
        low, high = f"{min(ppl):.1f}", f"{max(ppl):.1f}"
        out[f"{name}.dense.ppl"] = f"{low} in both seeds" if low == high and len(ppl) == 2 else f"{low}–{high}"
    return out
