"""The sweep's tables and its pre-registered verdict, from the units that finished.

- ``arms.csv``: one row per finished (arm, seed): warm-up, its rule, test perplexity overall and
  per domain, wall seconds.
- ``paired.csv``: per arm and domain, against the dense trunk of the same seeds: the log
  perplexity difference per seed (negative: better than dense), its mean, the seeds that are
  better, a paired t-test (scipy) on the log perplexities, and the share of DEMix's gap over
  dense that the arm closes (mean difference over DEMix's, same seeds).
- ``load.csv``: per CSE arm, seed, 50-step window after conversion, layer and expert: the
  training sequences the expert received, in all and per domain (``metrics.jsonl``).
- ``routing.csv``: per CSE arm, seed, layer and expert, the test blocks it receives by domain.
- ``experts.csv``: per sparse arm, seed and layer, the experts it trained with.
- ``curves.csv``: per arm (the trunk ``dense`` included), seed, step and domain, the validation
  loss and perplexity its training logged (``validation.csv``, every ``eval_every`` steps:
  :mod:`cse_models.validation`) and the step's learning rate; units trained without the log
  have no rows.
- ``RUN/loads.png``: per CSE arm and layer, the smallest expert's share per window and each tail
  domain's share at its most-used expert (:func:`ntkscope.plotting.expert_loads`).
- ``verdict.json``: each pre-registered criterion (figures/sweep/README.md), its numbers, and
  whether it holds; "not run" where its units have not finished.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from ntkscope.core.checks import fail
from ntkscope.core.files import write_json, write_text
from ntkscope.core.names import block_of
from ntkscope.plotting import expert_loads, save_figure
from ntkscope.reproduction.arm_kinds import ARM_KINDS



@dataclass(frozen=True)
class Criteria:
    """The pre-registered criteria a sweep is judged by (figures/sweep/README.md): each of
    ``arms`` must beat the dense trunk on every ``tail`` domain in every seed, close at least
    ``close_share`` of DEMix's gap over dense there, beat its Switch (``switch_for[arm]``, else
    ``switch``) and keep general perplexity within ``general_tolerance`` of dense; an expert
    below ``starved_share`` of its layer's sequences in a window starves."""

    arms: tuple = ("cse-rule", "cse-rule-drift", "cse-gc", "cse-gc-drift", "cse-late", "cse-encoder")
    tail: tuple = ("legal", "biomedical")
    close_share: float = 1 / 3
    general_tolerance: float = 0.01
    starved_share: float = 0.01
    switch: str = "switch-rule"
    switch_for: dict = field(default_factory=lambda: {"cse-gc": "switch-gc"})


def _results(run_dir: Path) -> pd.DataFrame:
    rows = [json.loads(p.read_text()) for p in sorted((run_dir / "results").glob("*.json"))]
    keep = ["arm", "seed", "kind", "warmup", "warmup_rule", "mean_rate", "same_as"]
    frame = pd.DataFrame([{k: r.get(k) for k in keep} | {"trunk": r.get("trunk") or "dense"}
                          | {k: v for k, v in r.items() if k.startswith("ppl")} | {"seconds": r.get("seconds")}
                          for r in rows])
    return frame.sort_values(["arm", "seed"]).reset_index(drop=True) if len(frame) else frame


def paired(arms: pd.DataFrame) -> pd.DataFrame:
    """Per (arm, domain): each arm against the dense trunk it branched from (its ``trunk``: "dense",
    or a re-made trunk), paired by seed, on log perplexity."""
    columns = [c for c in arms.columns if c.startswith("ppl")]
    if "trunk" not in arms.columns:
        arms = arms.assign(trunk="dense")
    logs = arms.set_index(["arm", "seed"])[columns].apply(np.log)
    trunks = set(arms.loc[arms["kind"] == "dense", "arm"]) if "kind" in arms.columns else {"dense"}
    if "dense" not in logs.index.get_level_values(0):
        return pd.DataFrame()
    demix = logs.loc["demix"] if "demix" in logs.index.get_level_values(0) else None
    dense = logs.loc["dense"]
    rows = []
    for arm in sorted(set(logs.index.get_level_values(0)) - trunks):
        mine = logs.loc[arm]
        trunk_of = arms[arms["arm"] == arm].set_index("seed")["trunk"]  # each seed's own trunk
        base = pd.DataFrame([logs.loc[(trunk_of[s], s)] for s in mine.index if (trunk_of[s], s) in logs.index],
                            index=[s for s in mine.index if (trunk_of[s], s) in logs.index])
        seeds = sorted(base.index)
        for column in columns:
            diff = (mine.loc[seeds, column] - base.loc[seeds, column]).to_numpy()
            row = {"arm": arm, "domain": column[4:] if column != "ppl" else "all", "seeds": len(seeds),
                   "diff_per_seed": " ".join(f"{d:+.4f}" for d in diff), "mean_diff": float(diff.mean()),
                   "pct": float(100 * (math.exp(diff.mean()) - 1)), "better_seeds": int((diff < 0).sum()),
                   "t": float("nan"), "p": float("nan"), "gap_closed": float("nan")}
            if len(seeds) >= 2 and diff.std() > 0:
                test = stats.ttest_rel(mine.loc[seeds, column], base.loc[seeds, column])
                row.update(t=float(test.statistic), p=float(test.pvalue))
            if demix is not None:  # DEMix against its trunk, the arm against its own
                both = sorted(set(seeds) & set(demix.index) & set(dense.index))
                gap = float((demix.loc[both, column] - dense.loc[both, column]).mean()) if both else float("nan")
                mine_both = float((mine.loc[both, column] - base.loc[both, column]).mean()) if both else float("nan")
                row["gap_closed"] = mine_both / gap if both and gap < 0 else float("nan")
            rows.append(row)
    return pd.DataFrame(rows)


def loads(sweep) -> pd.DataFrame:
    """Per routed arm, seed, logged window, layer, expert: sequences received, in all and per domain;
    the rows of each finished unit are its kind's (:attr:`~ntkscope.reproduction.arm_kinds.ArmKind.load_rows`),
    kind by kind in the order they were registered."""
    rows = []
    for kind in ARM_KINDS.values():
        for arm in [a for a in sweep.arms if a.kind == kind.name] if kind.load_rows is not None else []:
            for seed in sweep.seeds:
                if sweep.done(arm.name, seed):
                    rows.extend(kind.load_rows(sweep, arm, seed))
    frame = pd.DataFrame(rows)
    if len(frame):
        frame["share"] = frame["n"] / frame.groupby(["arm", "seed", "step", "layer"])["n"].transform("sum")
    return frame


def routing(sweep) -> pd.DataFrame:
    rows = []
    for path in sorted((sweep.run_dir / "results").glob("*.json")):
        r = json.loads(path.read_text())
        for layer, experts in (r.get("routing") or {}).items():
            for expert, counts in experts.items():
                rows.append({"arm": r["arm"], "seed": r["seed"], "layer": int(layer), "expert": int(expert),
                             "n": sum(counts.values()), **{f"n {d}": n for d, n in counts.items()}})
    return pd.DataFrame(rows)


CURVE_COLUMNS = ["arm", "seed", "step", "lr", "domain", "blocks", "tokens", "loss", "ppl"]


def curves(run_dir: Path) -> pd.DataFrame:
    """``curves.csv`` (above): every ``RUN/models/ARM-seedK/validation.csv``, one frame."""
    frames = []
    for path in sorted(Path(run_dir).glob("models/*-seed*/validation.csv")):
        arm, _, seed = path.parent.name.rpartition("-seed")
        if seed.isdigit() and path.stat().st_size:
            frames.append(pd.read_csv(path).assign(arm=arm, seed=int(seed)))
    if not frames:
        return pd.DataFrame(columns=CURVE_COLUMNS)
    return pd.concat(frames, ignore_index=True)[CURVE_COLUMNS].sort_values(
        ["arm", "seed", "step", "domain"], kind="stable", ignore_index=True)


def expert_counts(run_dir: Path) -> pd.DataFrame:
    """``experts.csv``: per sparse arm, seed and layer, the experts it trained with (the routing
    load of its last logged step, ``metrics.jsonl``; the test blocks may reach fewer)."""
    rows = []
    for path in sorted(Path(run_dir).glob("models/*-seed*/metrics.jsonl")):
        arm, _, seed = path.parent.name.rpartition("-seed")
        load = None
        for line in path.read_text().splitlines():
            record = json.loads(line)
            load = record.get("load") or load
        for layer, counts in (load or {}).items():
            rows.append({"arm": arm, "seed": int(seed), "layer": _block_index(layer), "experts": len(counts)})
    return pd.DataFrame(rows, columns=["arm", "seed", "layer", "experts"])


def verdict(pairs: pd.DataFrame, load: pd.DataFrame, n_seeds: int, criteria: Criteria = Criteria()) -> dict:
    """The pre-registered ``criteria`` (figures/sweep/README.md), evaluated on what finished."""
    out, c = {}, criteria
    for arm in c.arms:
        rows = pairs[pairs["arm"] == arm] if len(pairs) else pairs
        if not len(rows):
            out[arm] = {"status": "not run"}
            continue
        by = rows.set_index("domain")
        switch = pairs[pairs["arm"] == c.switch_for.get(arm, c.switch)].set_index("domain") \
            if len(pairs) else None
        checks = {}
        for d in c.tail:
            r = by.loc[d]
            checks[f"{d}: better than dense in every seed"] = bool(r["better_seeds"] == r["seeds"] == n_seeds)
            checks[f"{d}: closes >= {_share(c.close_share)} of DEMix's gap"] = bool(r["gap_closed"] >= c.close_share) \
                if np.isfinite(r["gap_closed"]) else None
            if switch is not None and d in switch.index and switch.loc[d, "seeds"] == r["seeds"]:
                checks[f"{d}: better than Switch at the same step"] = bool(r["mean_diff"] < switch.loc[d, "mean_diff"])
        checks[f"general within {100 * c.general_tolerance:g} % of dense"] = bool(
            abs(by.loc["general", "pct"]) <= 100 * c.general_tolerance) \
            if "general" in by.index else None
        starved = load[(load["arm"] == arm) & (load["share"] < c.starved_share)] if len(load) else load
        windows = load[load["arm"] == arm] if len(load) else load
        numbers = {d: {k: float(by.loc[d, k]) for k in ("seeds", "mean_diff", "pct", "better_seeds", "p", "gap_closed")}
                   for d in by.index}
        primary = [v for k, v in checks.items() if k.split(":")[0] in c.tail and "Switch" not in k]
        out[arm] = {"status": "complete" if int(by["seeds"].min()) == n_seeds else "partial",
                    "checks": checks, "numbers": numbers,
                    "starved_windows": int(len(starved)), "windows": int(len(windows)),
                    "shown": None if not primary or any(v is None for v in primary) else all(primary)}
    return out


def _share(x: float) -> str:
    """1/3 for a third, else the number."""
    return "1/3" if math.isclose(x, 1 / 3) else f"{x:g}"


def _block_index(layer) -> int:
    """2 for 2, "2", "transformer.h.2.mlp" or "hf.gpt_neox.layers.2.mlp.layer"."""
    found = block_of(layer)
    if found is None:
        raise fail("summarise", "layer", "must name a block (an index or a module path such as transformer.h.2.mlp)",
                   layer)
    return found[0]


def summarise(sweep, *, earlier_load: Path | None = None, criteria: Criteria = Criteria()) -> dict:
    """Write RUN/tables (arms, paired, load, routing, curves, experts CSVs; verdict.json) and return the verdict.
    ``earlier_load``: a load.csv of units whose training logs are no longer in RUN (a run directory
    lost and resumed elsewhere): its rows are kept for the units RUN does not log."""
    tables = sweep.run_dir / "tables"
    arms = _results(sweep.run_dir)
    pairs = paired(arms) if len(arms) else pd.DataFrame()
    load = loads(sweep)
    if earlier_load is not None and Path(earlier_load).is_file():
        kept = pd.read_csv(earlier_load)
        logged = set(zip(load["arm"], load["seed"])) if len(load) else set()
        kept = kept[[(a, s) not in logged for a, s in zip(kept["arm"], kept["seed"])]]
        load = pd.concat([kept, load], ignore_index=True).sort_values(["arm", "seed", "step", "layer", "expert"],
                                                                      kind="stable", ignore_index=True)
    if len(load):  # one name per layer: its block index (training logs name the module, transformer.h.2.mlp)
        load["layer"] = [_block_index(v) for v in load["layer"]]
    for name, frame in (("arms", arms), ("paired", pairs), ("load", load), ("routing", routing(sweep)),
                        ("curves", curves(sweep.run_dir)), ("experts", expert_counts(sweep.run_dir))):
        write_text(tables / f"{name}.csv", frame.to_csv(index=False))
    result = verdict(pairs, load, len(sweep.seeds), criteria)
    write_json(tables / "verdict.json", result)
    if len(load):
        save_figure(expert_loads(load), sweep.run_dir / "loads.png")
    return result
