"""The warm-up map's tables and pre-registered verdicts (figures/warmup-map/CRITERIA.md).

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

import math
from pathlib import Path

import numpy as np
import pandas as pd

from ntkscope.core.checks import UserError
from ntkscope.core.files import read_json_object
from ntkscope.representation.plan import plan_step

TAIL = ("legal", "biomedical")
GAIN_COLUMNS = ["arm", "step", "seed", "trunks", "domain", "gain", "low", "high", "ppl", "ppl_dense"]


def family(arm: str) -> str:
    """``cse-at300`` -> ``cse``; names without a step suffix are their own family."""
    head, _, tail = arm.rpartition("-at")
    return head if head and tail.isdigit() else arm


def _log_ppl(loss: np.ndarray, tokens: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """log perplexity of the blocks ``idx`` (..., k) of per-block ``loss`` and ``tokens`` sums."""
    return loss[idx].sum(axis=-1) / tokens[idx].sum(axis=-1)


def gains(results: dict, domains, *, trunks: str = "", n_boot: int = 2000, confidence: float = 0.9,
          seed: int = 0, tail=TAIL) -> pd.DataFrame:
    """The paired gains of every finished arm against its seed's trunk.

    results: {unit name: result dict} of one build of the trunks (``dense-seedK`` the trunks, every
    other unit branched from them); domains: (N,) the domain of each test block, in the results'
    block order; ``trunks``: that build's label (e.g. the GPU that trained it: a trunk re-made on
    another GPU kind is another model); ``tail``: the long tail's domains (a spec's
    ``settings.finetune_domains``). Returns GAIN_COLUMNS, one row per (arm, step, seed, domain),
    domain in the tail's domains, "tail" (their mean) and every other domain (the shipped pack:
    legal, biomedical, tail, general)."""
    domains = np.asarray(domains)
    rng = np.random.default_rng(seed)
    tail = tuple(tail)
    others = sorted(set(domains.tolist()) - set(tail)) or ["general"]
    where = {d: np.flatnonzero(domains == d) for d in (*tail, *others)}
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
        point["tail"] = sum(point[d] for d in tail) / len(tail)
        boot["tail"] = sum(boot[d] for d in tail) / len(tail)
        for d in (*tail, "tail", *others):
            ppl = None if d == "tail" else float(result[f"ppl {d}"])
            rows.append({"arm": family(result["arm"]), "step": int(result["warmup"]), "seed": int(result["seed"]),
                         "trunks": trunks, "domain": d, "gain": float(point[d]), "low": float(np.quantile(boot[d], q)),
                         "high": float(np.quantile(boot[d], 1 - q)), "ppl": ppl,
                         "ppl_dense": None if d == "tail" else float(trunk[f"ppl {d}"])})
    return pd.DataFrame(rows, columns=GAIN_COLUMNS)


def _paired(tail: pd.DataFrame, arm: str, other: str, step: int) -> pd.Series:
    a = tail[(tail["arm"] == arm) & (tail["step"] == step)].set_index("seed")["gain"]
    b = tail[(tail["arm"] == other) & (tail["step"] == step)].set_index("seed")["gain"]
    return (a - b).dropna()


def _same_trunks(tail: pd.DataFrame, arm: str, other: str, step: int) -> list:
    """The seeds at which ``arm`` and ``other`` at ``step`` branched from the same build of the
    trunk (a pair across builds still compares two paired gains, but not on one model)."""
    at = tail[tail["step"] == step].set_index(["arm", "seed"])["trunks"]
    seeds = sorted(set(s for a, s in at.index if a == arm) & set(s for a, s in at.index if a == other))
    return [int(s) for s in seeds if at[(arm, s)] == at[(other, s)]]


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
                "same_trunks": _same_trunks(tail, arm, other, step),
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
        # the stricter reading beside the registered one: a difference of two arms varies about
        # sqrt(2) times one arm's spread, and part of it can be the other arm's own harm (its gain
        # over dense, when positive)
        spread = math.sqrt(2) * base["null_spread"]
        harm = float(tail[(tail["arm"] == other) & (tail["step"] == step)]["gain"].mean())
        strict = {"difference_spread": spread,
                  "verdict": "shown" if base["wins"] >= need and base["mean_difference"] < -spread else "not shown",
                  "other_mean_gain": harm,
                  "other_harm_share": (max(harm, 0.0) / -base["mean_difference"]
                                       if base["mean_difference"] < 0 else None)}
        return {**base, "verdict": "shown" if shown else "not shown", "strict": strict}

    out["clusters_vs_shuffled"] = against("cse", "cse-shuffled", "CSE below cse-shuffled on the tail")
    out["cse_vs_fair"] = against("cse", "switch-fair", "CSE below the fair capacity control on the tail")
    if (tail["arm"] == "scratch").any():  # a spec with the mixture of experts trained from scratch
        out["cse_vs_scratch"] = against("cse", "scratch", "CSE below the mixture of experts trained from scratch "
                                        "(CSE's counts, the same tokens) on the tail")
    floor = {}
    for arm in sorted(set(tail.loc[tail["step"] == step, "arm"]) - {"dense-null"}):
        gain = tail[(tail["arm"] == arm) & (tail["step"] == step)].set_index("seed")["gain"]
        both = sorted(set(int(s) for s in gain.index) & set(int(s) for s in null.index))
        entry = {"seeds_ran": sorted(int(s) for s in gain.index), "mean_gain": float(gain.mean()),
                 "same_trunks": _same_trunks(tail, arm, "dense-null", step),
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
    out["layers"] = layer_verdicts(tail, plans or {}, step)
    return out


PAIRS = {"cse": (2, 3), "cse-l01": (0, 1)}  # the arm that converts at each layer pair at the verdict's step


def layer_verdicts(tail: pd.DataFrame, plans: dict, step: int) -> dict:
    """Per trunk: does the layer pair the plan ranks higher by consensus structure at its warm-up
    (the pair's mean) have the lower tail gain at ``step``? (CRITERIA.md, verdict 5.) A pair shows
    structure when its mean is at least the rule's ``min_structure``; where neither does, the
    plan made no choice."""
    at = tail[tail["step"] == step].set_index(["arm", "seed"])
    per, agree, judged = {}, 0, 0
    for seed, plan in sorted(plans.items()):
        evidence = plan.get("evidence") or {}
        by_layer = {int(r["layer"]): float(r["structure"]) for r in evidence.get("structure_by_layer", [])}
        if not by_layer or any((arm, seed) not in at.index for arm in PAIRS):
            continue
        floor = float(evidence.get("structure_rule", {}).get("min_structure", 0.05))
        mean = {arm: float(np.mean([by_layer.get(L, 0.0) for L in pair])) for arm, pair in PAIRS.items()}
        gain = {arm: float(at.loc[(arm, seed), "gain"]) for arm in PAIRS}
        entry = {"structure": {"-".join(map(str, PAIRS[a])): m for a, m in mean.items()},
                 "tail_gain": {"-".join(map(str, PAIRS[a])): g for a, g in gain.items()},
                 "same_trunks": bool(at.loc[("cse", seed), "trunks"] == at.loc[("cse-l01", seed), "trunks"])}
        if max(mean.values()) < floor:
            per[str(seed)] = {**entry, "verdict": "no choice"}
            continue
        ranked, better = max(mean, key=mean.get), min(gain, key=gain.get)
        judged += 1
        agree += ranked == better
        per[str(seed)] = {**entry, "ranked_higher": list(PAIRS[ranked]), "map_better": list(PAIRS[better]),
                          "verdict": "agrees" if ranked == better else "disagrees"}
    return {"trunks": per, "agree": agree, "judged": judged}


def judge_step(curve: pd.Series, step: int) -> dict:
    """The rule's ``step`` against one CSE map ``curve`` (step -> tail gain), CRITERIA.md verdict 4."""
    gain = float(np.interp(step, curve.index.to_numpy(), curve.to_numpy()))
    best = int(curve.idxmin())
    good = curve[best] < 0 and -gain >= 0.8 * -curve[best] and step <= best
    return {"gain_at_rule": gain, "best_step": best, "best_gain": float(curve[best]),
            "extrapolated": step < int(curve.index.min()), "verdict": "good" if good else "not good"}


def _rule_verdicts(tail: pd.DataFrame, plans: dict) -> dict:
    """Per trunk: the rule's step against the trunk's CSE map (CRITERIA.md, verdict 4). Where the
    map's steps come from more than one build of the trunk (a plan's ``trunks`` names its own),
    the same judgement on the plan's build alone is given beside it (``on_plan_trunks``)."""
    out = {}
    cse = tail[tail["arm"] == "cse"]
    for seed, plan in sorted(plans.items()):
        rows = cse[cse["seed"] == seed].set_index("step").sort_index()
        curve = rows["gain"]
        entry = {"rule_step": plan_step(plan), "warmup_rule": plan.get("warmup_rule"),
                 "map_steps": [int(s) for s in curve.index],
                 "map_trunks": {str(int(s)): str(t) for s, t in rows["trunks"].items()}}
        if plan.get("warmup_rule") != "consensus-structure":
            out[str(seed)] = {**entry, "verdict": "the rule chose nothing"}
            continue
        if len(curve) < 5:
            out[str(seed)] = {**entry, "verdict": "not decided", "why": "the trunk's CSE map is incomplete"}
            continue
        step = int(plan_step(plan))
        out[str(seed)] = {**entry, **judge_step(curve, step)}
        own = rows["trunks"] == plan.get("trunks", rows["trunks"].iloc[0])
        if not own.all() and own.sum() >= 2:
            out[str(seed)]["on_plan_trunks"] = {"map_steps": [int(s) for s in curve[own].index],
                                                **judge_step(curve[own], step)}
    return out


TRUNK_COLUMNS = ["model", "seed", "domain", "ppl", "blocks", "tokens"]


def trunk_perplexities(results: dict, domains, model: str) -> pd.DataFrame:
    """TRUNK_COLUMNS: each dense trunk's (``dense-seedK``) test perplexity per domain of
    ``domains`` (each test block's domain, in the results' block order), from its per-block losses."""
    domains = np.asarray(domains)
    rows = []
    for name, result in sorted(results.items()):
        if not name.startswith("dense-seed") or "blocks" not in result:
            continue
        loss, tokens = (np.asarray(result["blocks"][k], dtype=np.float64) for k in ("loss", "tokens"))
        if len(loss) != len(domains):
            raise UserError(f"experiment map: {name} of {model} has {len(loss)} test blocks, not the {len(domains)} "
                            "of this pack: the two sets of trunks were not measured on the same blocks")
        for d in sorted(set(domains.tolist())):
            idx = np.flatnonzero(domains == d)
            rows.append({"model": model, "seed": int(result["seed"]), "domain": d,
                         "ppl": float(np.exp(_log_ppl(loss, tokens, idx))), "blocks": int(idx.size),
                         "tokens": int(tokens[idx].sum())})
    return pd.DataFrame(rows, columns=TRUNK_COLUMNS)


def fits_its_data(table: pd.DataFrame, model: str, other: str) -> dict:
    """The trunks' verdict (a model that fits its data better than ``other``): shown when every seed
    of ``model`` has a lower test perplexity than every seed of ``other`` on each domain."""
    out = {"what": f"every {model} trunk below every {other} trunk on each domain", "domains": {}}
    for d, rows in table.groupby("domain"):
        mine, theirs = rows.loc[rows["model"] == model, "ppl"], rows.loc[rows["model"] == other, "ppl"]
        out["domains"][d] = {model: [round(float(x), 2) for x in mine], other: [round(float(x), 2) for x in theirs],
                             "below": bool(len(mine) and len(theirs) and mine.max() < theirs.min())}
    out["verdict"] = "shown" if out["domains"] and all(v["below"] for v in out["domains"].values()) else "not shown"
    return out


def read_results(run_dir) -> dict:
    """{unit name: result} of a run directory's finished units; a result that is not what a unit
    writes (an arm, a seed, and per-block test losses and token counts of one length) is one
    line naming its file."""
    folder = Path(run_dir) / "results"
    out = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        result = read_json_object(path, "experiment map")
        if "blocks" not in result:  # a record without per-block losses (an adopted sweep's): gains() skips it
            out[path.stem] = result
            continue
        blocks = result.get("blocks")
        ok = isinstance(result.get("arm"), str) and isinstance(result.get("seed"), int) and isinstance(blocks, dict) \
            and all(isinstance(blocks.get(k), list) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                             and math.isfinite(x) for x in blocks[k])
                    for k in ("loss", "tokens")) and len(blocks["loss"]) == len(blocks["tokens"]) > 0
        if not ok:
            raise UserError(f"experiment map: {path} is not a unit's result (it needs arm, seed and blocks: "
                            "{loss: [...], tokens: [...]} of finite numbers, one per test block)")
        out[path.stem] = result
    return out



def count_verdicts(table: pd.DataFrame, seeds, margin: float, *, early: int = 300, late: int = 1200) -> dict:
    """The count question's verdicts (figures/warmup-map/count/CRITERIA.md) from a :func:`gains`
    table holding CSE at ``early`` and ``late`` with its own fit (arm ``cse``) and with the other
    step's counts (``cse-atLATE-kEARLY``, ``cse-atEARLY-kLATE``): d1 = gain with the early counts
    at the late step minus CSE's own there, d2 = gain with the late counts at the early step minus
    CSE's own there, paired by seed; each judged against ``margin`` (the registered delta) with
    2 of 3 seeds on the same side."""
    tail = table[(table["domain"] == "tail") & table["seed"].isin(list(seeds))]

    def at(arm, step):
        return tail[(tail["arm"] == arm) & (tail["step"] == step)].set_index("seed")["gain"]

    own_early, own_late = at("cse", early), at("cse", late)
    d1 = (at(f"cse-at{late}-k{early}", late) - own_late).dropna()
    d2 = (at(f"cse-at{early}-k{late}", early) - own_early).dropna()
    need = math.ceil(2 * len(list(seeds)) / 3)
    out = {"seeds": list(seeds), "margin": margin, "needs": f"{need} of {len(list(seeds))} seeds"}
    for name, diff, sign, what in (
            ("count_matters_late", d1, 1, f"fewer experts (step {early}'s) at step {late}"),
            ("count_brings_gain_early", d2, -1, f"more experts (step {late}'s) at step {early}")):
        entry = {"what": what, "per_seed": {str(int(k)): float(v) for k, v in diff.items()},
                 "mean": float(diff.mean()) if len(diff) else None, "same_side": int((sign * diff > 0).sum())}
        if len(diff) < len(list(seeds)):
            entry["verdict"] = "not decided"
        else:
            entry["verdict"] = "shown" if entry["same_side"] >= need and sign * entry["mean"] > margin else "not shown"
        out[name] = entry
    gap = (own_late - own_early).dropna()
    if len(d2) and len(gap) and gap.mean() < 0:
        out["count_brings_gain_early"]["share_of_late_gain"] = float(d2.mean() / gap.mean())
    if len(d1) and len(own_late) and own_late.mean() < 0:
        out["count_matters_late"]["share_of_late_gain"] = float(d1.mean() / -own_late.mean())
    return out
