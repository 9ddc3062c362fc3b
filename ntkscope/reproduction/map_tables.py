"""The warm-up map's tables and pre-registered verdicts (issue 42; figures/warmup-map/CRITERIA.md).

From the units that finished (``RUN/results/*.json``, each with its per-block test losses):

- :func:`gains`: per (arm, step, seed, domain), the paired tail gain ``log ppl(arm) - log
  ppl(trunk)`` against the same seed's dense trunk at the last step, with a 90 % block-bootstrap
  interval (test blocks resampled within each domain, the same blocks for both models);
  ``domain`` is legal, biomedical, their mean ("tail") or general;
- :func:`verdicts`: the pre-registered comparisons at step 1200 (clusters against
  ``cse-shuffled``, CSE against the fair control, every arm against ``dense-null``) and the
  rule's pick in each trunk against the map, each "shown", "not shown" or "not decided" (with
  why: the seeds or steps that did not run).

Arm names follow the spec: an arm of several steps is ``NAME-atSTEP``; its *family* is NAME.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

TAIL = ("legal", "biomedical")
GAIN_COLUMNS = ["arm", "step", "seed", "domain", "gain", "low", "high", "ppl", "ppl_dense"]


def family(arm: str) -> str:
    """``cse-at300`` -> ``cse``; names without a step suffix are their own family."""
    head, _, tail = arm.rpartition("-at")
    return head if head and tail.isdigit() else arm


def _log_ppl(loss: np.ndarray, tokens: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """log perplexity of the blocks ``idx`` (..., k) of per-block ``loss`` and ``tokens`` sums."""
    return loss[idx].sum(axis=-1) / tokens[idx].sum(axis=-1)


def gains(results: dict, domains, *, n_boot: int = 2000, confidence: float = 0.9, seed: int = 0) -> pd.DataFrame:
    """The paired gains of every finished arm against its seed's trunk.

    results: {unit name: result dict} (``dense-seedK`` the trunks); domains: (N,) the domain of
    each test block, in the results' block order. Returns GAIN_COLUMNS, one row per (arm, step,
    seed, domain), domain in legal, biomedical, tail, general."""
    domains = np.asarray(domains)
    rng = np.random.default_rng(seed)
    where = {d: np.flatnonzero(domains == d) for d in (*TAIL, "general")}
    draws = {d: rng.integers(len(i), size=(n_boot, len(i))) for d, i in where.items()}
    q = (1 - confidence) / 2
    rows = []
    for name, result in sorted(results.items()):
        if result.get("kind") == "dense" or "blocks" not in result:
            continue
        trunk = results.get(f"dense-seed{result['seed']}")
        if trunk is None or "blocks" not in trunk:
            continue
        a = {k: np.asarray(result["blocks"][k], dtype=np.float64) for k in ("loss", "tokens")}
        b = {k: np.asarray(trunk["blocks"][k], dtype=np.float64) for k in ("loss", "tokens")}
        point, boot = {}, {}
        for d, idx in where.items():
            point[d] = _log_ppl(a["loss"], a["tokens"], idx) - _log_ppl(b["loss"], b["tokens"], idx)
            chosen = idx[draws[d]]  # (n_boot, k) block indices, the same for both models
            boot[d] = _log_ppl(a["loss"], a["tokens"], chosen) - _log_ppl(b["loss"], b["tokens"], chosen)
        point["tail"] = (point["legal"] + point["biomedical"]) / 2
        boot["tail"] = (boot["legal"] + boot["biomedical"]) / 2
        for d in (*TAIL, "tail", "general"):
            ppl = None if d == "tail" else float(result[f"ppl {d}"])
            rows.append({"arm": family(result["arm"]), "step": int(result["warmup"]), "seed": int(result["seed"]),
                         "domain": d, "gain": float(point[d]), "low": float(np.quantile(boot[d], q)),
                         "high": float(np.quantile(boot[d], 1 - q)), "ppl": ppl,
                         "ppl_dense": None if d == "tail" else float(trunk[f"ppl {d}"])})
    return pd.DataFrame(rows, columns=GAIN_COLUMNS)


def _paired(tail: pd.DataFrame, arm: str, other: str, step: int) -> pd.Series:
    a = tail[(tail["arm"] == arm) & (tail["step"] == step)].set_index("seed")["gain"]
    b = tail[(tail["arm"] == other) & (tail["step"] == step)].set_index("seed")["gain"]
    return (a - b).dropna()


def verdicts(table: pd.DataFrame, seeds, *, step: int = 1200, plans: dict | None = None) -> dict:
    """The pre-registered verdicts (CRITERIA.md) from a :func:`gains` table over ``seeds``
    (the spec's). ``plans``: {seed: plan dict} for the rule's verdict, when the plans ran."""
    seeds = list(seeds)
    need = math.ceil(0.8 * len(seeds))  # 4 of 5
    tail = table[(table["domain"] == "tail") & table["seed"].isin(seeds)]  # the spec's seeds only
    null = tail[(tail["arm"] == "dense-null") & (tail["step"] == step)].set_index("seed")["gain"]
    out = {"seeds": seeds, "step": step, "needs": f"{need} of {len(seeds)} seeds"}

    def against(arm, other, what):
        diff = _paired(tail, arm, other, step)
        base = {"what": what, "seeds_ran": sorted(int(s) for s in diff.index), "wins": int((diff < 0).sum()),
                "mean_difference": float(diff.mean()) if len(diff) else None,
                "null_spread": float(null.abs().max()) if len(null) == len(seeds) else None}
        if len(diff) < len(seeds) or base["null_spread"] is None:
            missing = sorted(set(seeds) - set(int(s) for s in diff.index))
            nulls = sorted(set(seeds) - set(int(s) for s in null.index))
            ran = {"verdict": "not decided", "why": f"not run: {arm} or {other} at seeds {missing}"
                   + (f"; dense-null at seeds {nulls}" if nulls else "")}
            if len(diff) and len(null):  # the same test on what ran: a hint, not the verdict
                spread = float(null.abs().max())
                ran["on_seeds_ran"] = {"wins": f"{base['wins']} of {len(diff)}", "null_spread": spread,
                                       "null_seeds": sorted(int(s) for s in null.index),
                                       "shown": bool(base["wins"] >= min(need, len(diff))
                                                     and base["mean_difference"] < -spread)}
            return {**base, **ran}
        shown = base["wins"] >= need and base["mean_difference"] < -base["null_spread"]
        return {**base, "verdict": "shown" if shown else "not shown"}

    out["clusters_vs_shuffled"] = against("cse", "cse-shuffled", "CSE below cse-shuffled on the tail")
    out["cse_vs_fair"] = against("cse", "switch-fair", "CSE below the fair capacity control on the tail")
    floor = {}
    for arm in sorted(set(tail.loc[tail["step"] == step, "arm"]) - {"dense-null"}):
        gain = tail[(tail["arm"] == arm) & (tail["step"] == step)].set_index("seed")["gain"]
        both = sorted(set(int(s) for s in gain.index) & set(int(s) for s in null.index))
        entry = {"seeds_ran": sorted(int(s) for s in gain.index), "mean_gain": float(gain.mean()),
                 "below_null": int(sum(gain[s] < null[s] for s in both)),
                 "above_null": int(sum(gain[s] > null[s] for s in both))}
        if len(both) < len(seeds):
            entry.update(verdict="not decided", why=f"{arm} and dense-null both ran at seeds {both} only")
            if both:  # the same test on what ran: a hint, not the verdict
                mean = float(gain[both].mean())
                entry["on_seeds_ran"] = (
                    "below the null" if entry["below_null"] == len(both) and mean < null.min() else
                    "above the null" if entry["above_null"] == len(both) and mean > null.max() else "within the null")
        elif entry["below_null"] >= need and entry["mean_gain"] < null.min():
            entry["verdict"] = "beats the noise floor"
        elif entry["above_null"] >= need and entry["mean_gain"] > null.max():
            entry["verdict"] = "worse than the noise floor"
        else:
            entry["verdict"] = "within the noise floor"
        floor[arm] = entry
    out["against_null"] = floor
    out["rule"] = _rule_verdicts(tail, plans or {})
    return out


def _rule_verdicts(tail: pd.DataFrame, plans: dict) -> dict:
    """Per trunk: the rule's step against the trunk's CSE map (CRITERIA.md, verdict 4)."""
    out = {}
    cse = tail[tail["arm"] == "cse"]
    for seed, plan in sorted(plans.items()):
        curve = cse[cse["seed"] == seed].set_index("step")["gain"].sort_index()
        entry = {"rule_step": plan.get("warmup_steps"), "warmup_rule": plan.get("warmup_rule"),
                 "map_steps": [int(s) for s in curve.index]}
        if plan.get("warmup_rule") != "consensus-structure":
            out[str(seed)] = {**entry, "verdict": "the rule chose nothing"}
            continue
        if len(curve) < 5:
            out[str(seed)] = {**entry, "verdict": "not decided", "why": "the trunk's CSE map is incomplete"}
            continue
        step = int(plan["warmup_steps"])
        gain = float(np.interp(step, curve.index.to_numpy(), curve.to_numpy()))
        best = int(curve.idxmin())
        good = curve[best] < 0 and -gain >= 0.8 * -curve[best] and step <= best
        out[str(seed)] = {**entry, "gain_at_rule": gain, "best_step": best, "best_gain": float(curve[best]),
                          "extrapolated": step < int(curve.index.min()),
                          "verdict": "good" if good else "not good"}
    return out


def read_results(run_dir) -> dict:
    """{unit name: result} of a run directory's finished units."""
    folder = Path(run_dir) / "results"
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))} if folder.is_dir() else {}

