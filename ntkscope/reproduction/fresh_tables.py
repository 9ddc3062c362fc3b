"""The fresh trunks' verdicts (figures/warmup-map/fresh/CRITERIA.md, registered before any of
them ran): the cross-validated rule (:data:`~ntkscope.runs.signals.CROSS_VALIDATED`) and the
other signals at their thresholds judged on each fresh trunk by the map's verdict 4, the step or
schedule position on the half schedule, the plan's layers, and the gain at the rule's step.

:mod:`ntkscope.experiments.fresh` reads the families' folders and writes the tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from ntkscope.reproduction.map_tables import judge_step, layer_verdicts
from ntkscope.runs.signals import CROSS_VALIDATED, SIGNALS, TrunkLog, schedule_fraction_step, trunk_log
from ntkscope.runs.trunk_probe import tail_expert_step

#: the registered families: name -> their trunks (seeds)
FAMILIES = {"warmup-fresh": 5, "warmup-fresh-half": 3, "warmup-fresh-mix": 3}
NEED_ALL, NEED_EACH = 9, 2  # verdict 1: good in 9 of the 11 trunks and 2 of 3 of each of half and mix
CSE_STEPS = 5
STRUCTURE_SIGNALS = ("consensus-structure", "cluster-count")  # they read the plan's consensus structure
#: the probe rule of CRITERIA.md's addendum (seventeenth session), registered before its judges existed
TAIL_EXPERT = {"signal": "tail-expert", "purity": 0.9, "min_blocks": 5, "from_step": 100, "layers": (2, 3),
               "judged_by": ("warmup-fresh-mix", "warmup-fresh"), "needs": 6, "reported": ("warmup-fresh-half",)}


@dataclass(frozen=True)
class Family:
    """One fresh family: its gains table (:func:`~ntkscope.reproduction.map_tables.gains`), the
    trunks' plans ({seed: plan}), the dense trunks' validation curves (or None), the schedule's
    length and the seeds."""

    name: str
    gains: pd.DataFrame
    plans: dict
    total_steps: int
    seeds: tuple
    curves: pd.DataFrame | None = None
    device: str = ""
    probes: dict | None = None  # {seed: the trunk probe's table}, when the trunks were probed


def _log(family: Family, seed: int) -> TrunkLog | None:
    if family.curves is None:
        return None
    rows = family.curves[(family.curves["arm"] == "dense") & (family.curves["seed"] == seed)]
    return trunk_log(rows, family.plans.get(seed) or {}, family.total_steps) if len(rows) else None


def trunk_rows(family: Family, thresholds: dict) -> list:
    """A row per trunk and judged signal (the rule first): its step, gain there, the best step
    and the verdict."""
    tail = family.gains[family.gains["domain"] == "tail"]
    rows = []
    for seed in family.seeds:
        mine = tail[(tail["arm"] == "cse") & (tail["seed"] == seed)]
        if mine["trunks"].nunique() > 1:  # one build per comparison: a map of two builds is not judged
            mine = mine.iloc[0:0]
        curve = mine.set_index("step")["gain"].sort_index()
        log = _log(family, seed)
        judged = [("rule: " + CROSS_VALIDATED["signal"], CROSS_VALIDATED["threshold"])]
        judged += [(name, th) for name, th in thresholds.items() if name != CROSS_VALIDATED["signal"]]
        judged += [("consensus-structure", 0.05)]  # the rule registered before the map
        for name, threshold in judged:
            signal = SIGNALS[name.removeprefix("rule: ")]
            row = {"family": family.name, "seed": seed, "signal": name, "threshold": threshold,
                   "total_steps": family.total_steps, "map_steps": len(curve)}
            if len(curve) < CSE_STEPS:
                rows.append({**row, "verdict": "not decided"})
                continue
            if signal.name == "schedule-fraction":
                step = schedule_fraction_step(family.total_steps, threshold)
            elif log is None or (signal.name in STRUCTURE_SIGNALS and log.structure is None):
                rows.append({**row, "verdict": "no log"})
                continue
            else:
                step = signal.step(log, threshold)
            best = int(curve.idxmin())
            row.update(best_step=best, best_fraction=best / family.total_steps, best_gain=float(curve[best]))
            if step is None:
                rows.append({**row, "verdict": "chose nothing"})
                continue
            j = judge_step(curve, int(step))
            rows.append({**row, "step": int(step), "gain": j["gain_at_rule"], "verdict": j["verdict"]})
    return rows


def tail_expert_rows(family: Family) -> list:
    """A row per trunk for the addendum's probe rule: its step (:func:`tail_expert_step` on the
    trunk's probe table at the registered settings), the gain there on the trunk's CSE map, the
    best step, and the map's verdict 4 (a rule that never fires is "not good")."""
    tail = family.gains[family.gains["domain"] == "tail"]
    rows = []
    for seed in family.seeds:
        mine = tail[(tail["arm"] == "cse") & (tail["seed"] == seed)]
        crossed = mine["trunks"].nunique() > 1  # one build per comparison: a map of two builds is not judged
        curve = pd.Series(dtype=float) if crossed else mine.set_index("step")["gain"].sort_index()
        row = {"family": family.name, "seed": seed, "signal": TAIL_EXPERT["signal"], "map_steps": len(curve)}
        probe = (family.probes or {}).get(seed)
        if probe is None:
            rows.append({**row, "verdict": "not probed"})
            continue
        step = tail_expert_step(probe, TAIL_EXPERT["layers"], purity=TAIL_EXPERT["purity"],
                                min_blocks=TAIL_EXPERT["min_blocks"], from_step=TAIL_EXPERT["from_step"])
        row["step"] = step
        if len(curve) < CSE_STEPS:
            why = "its CSE map crosses builds" if crossed else f"{len(curve)} of {CSE_STEPS} CSE steps finished"
            rows.append({**row, "verdict": "not decided", "why": why})
            continue
        best = int(curve.idxmin())
        row.update(best_step=best, best_gain=float(curve[best]))
        if step is None:
            rows.append({**row, "verdict": "not good", "why": "the rule never fired"})
            continue
        j = judge_step(curve, int(step))
        rows.append({**row, "gain": j["gain_at_rule"], "verdict": j["verdict"]})
    return rows


def tail_expert_verdict(families: list) -> tuple:
    """(verdict, rows): the addendum's verdict: good in at least 6 of the 8 trunks of
    warmup-fresh-mix and warmup-fresh ("not shown" as soon as the trunks left cannot reach 6),
    the half family's trunks reported beside it, and the same count for the cross-validated rule."""
    rows = pd.DataFrame([r for f in families for r in tail_expert_rows(f)])
    judged_by = TAIL_EXPERT["judged_by"]
    planned = sum(FAMILIES[f] for f in judged_by)
    counted = rows[rows["family"].isin(judged_by)] if len(rows) else rows
    decided = counted[counted["verdict"].isin(["good", "not good"])] if len(counted) else counted
    good = int((decided["verdict"] == "good").sum()) if len(decided) else 0
    entry = {**{k: list(v) if isinstance(v, tuple) else v for k, v in TAIL_EXPERT.items()},
             "good": good, "judged": int(len(decided)), "planned": planned}
    if len(decided) == planned:
        entry["verdict"] = "shown" if good >= TAIL_EXPERT["needs"] else "not shown"
    elif good + planned - len(decided) < TAIL_EXPERT["needs"]:
        entry["verdict"] = "not shown"
        entry["decided_by"] = f"{good} good of {len(decided)} judged: {TAIL_EXPERT['needs']} of {planned} out of reach"
    else:
        entry["verdict"] = "not decided"
    half = rows[rows["family"].isin(TAIL_EXPERT["reported"])] if len(rows) else rows
    entry["reported"] = {f"{r['family']} seed {int(r['seed'])}": {"step": _int(r.get("step")),
                                                                     "verdict": r["verdict"]}
                         for _, r in half.iterrows()}
    return entry, rows


def _int(value):
    return None if value is None or pd.isna(value) else int(value)


def fresh_verdicts(families: list, thresholds: dict) -> tuple:
    """(verdicts, trunks): CRITERIA.md's verdicts 1-5 over ``families``, and the per-trunk table.
    Verdict 1 is "not shown" as soon as the trunks not yet judged can no longer make it hold
    (``decided_by`` says which count fell short); "shown" waits for every trunk."""
    trunks = pd.DataFrame([r for f in families for r in trunk_rows(f, thresholds)])
    rule_name = "rule: " + CROSS_VALIDATED["signal"]
    out = {"rule": {"signal": CROSS_VALIDATED["signal"], "threshold": CROSS_VALIDATED["threshold"]},
           "devices": {f.name: f.device for f in families}}
    rule = trunks[trunks["signal"] == rule_name] if len(trunks) else trunks
    planned = sum(FAMILIES.values())
    decided = rule[rule["verdict"].isin(["good", "not good"])] if len(rule) else rule
    good = decided[decided["verdict"] == "good"] if len(decided) else decided
    per_family = {f: {"good": int((good["family"] == f).sum()) if len(good) else 0,
                      "judged": int((decided["family"] == f).sum()) if len(decided) else 0, "trunks": n}
                  for f, n in FAMILIES.items()}
    entry = {"good": int(len(good)), "judged": int(len(decided)), "planned": planned, "per_family": per_family,
             "needs": f"{NEED_ALL} of {planned}, and {NEED_EACH} of 3 in each of warmup-fresh-half and warmup-fresh-mix"}
    each = ("warmup-fresh-half", "warmup-fresh-mix")
    shown = len(good) >= NEED_ALL and all(per_family[f]["good"] >= NEED_EACH for f in each)
    short = [f for f in each if per_family[f]["good"] + per_family[f]["trunks"] - per_family[f]["judged"] < NEED_EACH]
    if len(good) + planned - len(decided) < NEED_ALL:
        short.append(f"{len(good)} good of {len(decided)} judged: {NEED_ALL} of {planned} out of reach")
    if len(decided) == planned:
        entry["verdict"] = "shown" if shown else "not shown"
    elif not short:  # shown waits for every trunk
        entry["verdict"] = "not decided"
    else:  # whatever the trunks not yet judged give, the criterion can no longer be met
        entry["verdict"] = "not shown"
        entry["decided_by"] = [f"{f}: {per_family[f]['good']} good of {per_family[f]['trunks']} trunks, below "
                               f"{NEED_EACH}" if f in per_family else f for f in short]
    out["rule_on_fresh_trunks"] = entry
    half = rule[rule["family"] == "warmup-fresh-half"] if len(rule) else rule
    out["step_or_position"] = {
        "best_fraction": {str(int(r["seed"])): r.get("best_fraction") for _, r in half.iterrows()},
        "rule_good": int((half["verdict"] == "good").sum()) if len(half) else 0, "trunks": len(half)}
    others = trunks[trunks["signal"] != rule_name] if len(trunks) else trunks
    out["signals"] = {f"{name} {th:g}": {"good": int((g["verdict"] == "good").sum()),
                                         "judged": int(g["verdict"].isin(["good", "not good", "chose nothing"]).sum())}
                      for (name, th), g in others.groupby(["signal", "threshold"], sort=False)} if len(others) else {}
    out["tail_expert"], probe_rows = tail_expert_verdict(families)
    if len(probe_rows):  # the same count for the cross-validated rule on the trunks the probe rule judged
        judged = probe_rows[probe_rows["family"].isin(TAIL_EXPERT["judged_by"])
                            & probe_rows["verdict"].isin(["good", "not good"])]
        pairs = set(zip(judged["family"], judged["seed"]))
        rule_there = rule[[(f, s) in pairs for f, s in zip(rule["family"], rule["seed"])]] if len(rule) else rule
        out["tail_expert"]["rule_on_the_same_trunks"] = {
            "good": int((rule_there["verdict"] == "good").sum()) if len(rule_there) else 0,
            "judged": int(rule_there["verdict"].isin(["good", "not good"]).sum()) if len(rule_there) else 0}
        trunks = pd.concat([trunks, probe_rows], ignore_index=True)
    out["layers"], out["gain_at_rule"] = {}, {}
    for f in families:
        step = schedule_fraction_step(f.total_steps, CROSS_VALIDATED["threshold"])
        tail = f.gains[f.gains["domain"] == "tail"]
        out["layers"][f.name] = layer_verdicts(tail, f.plans, step)
        at = tail[(tail["arm"] == "cse") & (tail["step"] == step)].sort_values("seed")
        out["gain_at_rule"][f.name] = {"step": step, "per_seed": {
            str(int(r["seed"])): {"gain": float(r["gain"]), "low": float(r["low"]), "high": float(r["high"])}
            for _, r in at.iterrows()}}
    return out, trunks
