"""``ntkscope experiment experts``: Figure 5(b, c) on a sweep's converted models, as registered in
``figures/warmup-map/fresh/experts/CRITERIA.md``: is each expert's NTK more consistent on the
blocks routed to it than the dense trunk's FFN at the same layer and step on the same blocks?

For each seed, the CSE arm's last checkpoint and the dense trunk's checkpoint at the same step;
the probe of :mod:`ntkscope.experiments.probe` (the first ``per_domain`` validation blocks of
each domain). Per expert of each CSE layer: the split-half |GC| of the expert's kernel and of the
dense FFN's kernel on its blocks over the same halves (paired), and the dense kernel's split-half
|GC| on random sets of as many blocks (the null). One table, ``OUT/experts.csv`` (EXPERT_COLUMNS),
the verdicts, ``OUT/verdicts.json``, and the figure, ``OUT/experts.png``; a seed already in the
table is not measured again.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from cse_models.evaluate import at_most_per_domain
from ntkscope.core.checks import MissingInput
from ntkscope.core.files import write_json, write_table
from ntkscope.experiments.kinds import make_sweep
from ntkscope.experiments.runner import spec_pack
from ntkscope.experiments.spec import Spec
from ntkscope.kernel.experts import expert_ntk, halves, subset_abs_gc
from ntkscope.kernel.ntk import empirical_ntk
from ntkscope.plotting import expert_consistency, save_figure
from ntkscope.runs.checkpoints import list_checkpoints, load_checkpoint

log = logging.getLogger(__name__)

EXPERT_COLUMNS = ["seed", "step", "layer", "expert", "units", "judged", "top_domain", "top_share", "tail_share",
                  "expert_median", "expert_low", "expert_high", "dense_median", "dense_low", "dense_high",
                  "diff_median", "diff_low", "diff_high", "null_median", "null_low", "null_high", "more_consistent",
                  "coherent_in_dense"]
QUANTILES = (0.05, 0.5, 0.95)


def _band(values: np.ndarray) -> tuple:
    low, median, high = np.quantile(values, QUANTILES)
    return float(median), float(low), float(high)


def measure_seed(cse, dense, blocks: torch.Tensor, domains: list, *, tail: tuple, min_units: int = 8,
                 draws: int = 200, seed: int = 0) -> list[dict]:
    """The rows of one seed (EXPERT_COLUMNS without seed and step): every expert of every CSE
    layer of ``cse`` on ``blocks`` (n, T), against the dense FFN of the same block index."""
    domains = np.asarray(domains)
    rows = []
    kernels = expert_ntk(cse, blocks, min_units=1, method="exact", dtype=torch.float64)
    dense_k = {}
    for k in kernels:
        block_index = k.layer.split(".")[-2]  # transformer.h.L.mlp
        if k.layer not in dense_k:
            dense_k[k.layer] = empirical_ntk(dense, blocks, params=f"transformer.h.{block_index}.mlp.*",
                                             method="exact", dtype=torch.float64).matrix.numpy()
        idx = k.samples()
        m, own = len(idx), domains[idx]
        shares = pd.Series(own).value_counts(normalize=True)
        row = {"layer": int(block_index), "expert": k.expert, "units": m, "judged": m >= min_units,
               "top_domain": shares.index[0], "top_share": float(shares.iloc[0]),
               "tail_share": float(np.isin(own, tail).mean())}
        if m >= 4:
            H = halves(m, draws, seed)
            e = subset_abs_gc(k.matrix, H)
            d = subset_abs_gc(dense_k[k.layer][np.ix_(idx, idx)], H)
            rng = np.random.default_rng([seed, 5, m])
            null = []
            for _ in range(draws):  # a random set of m blocks of the probe, one random half of it
                pick = np.sort(rng.choice(len(blocks), size=m, replace=False))
                half = np.sort(rng.choice(m, size=m // 2, replace=False))
                null.append(subset_abs_gc(dense_k[k.layer], [half], whole=pick)[0])
            for name, values in (("expert", e), ("dense", d), ("diff", e - d), ("null", np.asarray(null))):
                row[f"{name}_median"], row[f"{name}_low"], row[f"{name}_high"] = _band(values)
            row["more_consistent"] = bool(row["diff_low"] > 0)
            row["coherent_in_dense"] = bool(row["dense_median"] > row["null_high"])
        rows.append(row)
    return rows


def verdicts(table: pd.DataFrame, seeds: list) -> dict:
    """CRITERIA.md's three verdicts from the expert table (judged experts only)."""
    judged = table[table["judged"].astype(bool)]
    per_seed = {}
    for s in seeds:
        part = judged[judged["seed"] == s]
        per_seed[int(s)] = {"judged": int(len(part)), "more_consistent": int(part["more_consistent"].sum()),
                            "coherent_in_dense": int(part["coherent_in_dense"].sum()),
                            "majority": bool(len(part) and part["more_consistent"].sum() > len(part) / 2)}
    ran = [s for s in per_seed if per_seed[s]["judged"]]
    wins = sum(per_seed[s]["majority"] for s in ran)
    one = {"verdict": "shown" if wins >= 4 else "not shown", "seeds_ran": len(ran), "wins": wins,
           "rule": "in at least 4 of the 5 seeds, more than half of the judged experts more consistent"}
    if len(ran) < 5:
        one["why"] = f"{len(ran)} of 5 seeds measured"
        one["verdict"] = "not shown" if wins + (5 - len(ran)) < 4 else "open"
    tail = judged[judged["tail_share"] >= 0.5]
    tail_seeds = {int(s): bool(part["more_consistent"].any()) for s, part in tail.groupby("seed")}
    three = {"seeds_with_tail_expert": len(tail_seeds), "wins": sum(tail_seeds.values()),
             "rule": "a tail expert (>= 50 % legal or biomedical) more consistent in at least 4 of the seeds that "
                     "have one (at least 3 such seeds)"}
    three["verdict"] = ("not enough tail experts" if len(tail_seeds) < 3
                        else "shown" if three["wins"] >= min(4, len(tail_seeds)) else "not shown")
    return {"experts_more_consistent": one, "per_seed": per_seed, "tail_experts": three,
            "coherent_in_dense": {int(s): v["coherent_in_dense"] for s, v in per_seed.items()}}


def expert_figure(spec: Spec, run_dir, out, *, arm: str = "cse-at1200", pack=None, seeds=None, per_domain: int = 64,
                  min_units: int = 8, draws: int = 200) -> dict:
    """Measure each seed of ``seeds`` (default: the spec's) whose ``arm`` unit and dense trunk have
    finished in ``run_dir``; write ``OUT/experts.csv`` and ``OUT/verdicts.json``; returns the verdicts."""
    run_dir, out = Path(run_dir), Path(out)
    sweep = make_sweep(spec, run_dir, spec_pack(spec, run_dir, pack, build=False, func="expert_figure"))
    probe = at_most_per_domain(sweep.blocks("validation"), per_domain)
    domains = [probe.domain_names[int(d)] for d in probe.domains]
    tail = tuple(sweep.settings.finetune_domains)
    path = out / "experts.csv"
    table = pd.read_csv(path) if path.is_file() else pd.DataFrame(columns=EXPERT_COLUMNS)
    seeds = list(seeds or spec.seeds)
    for seed in seeds:
        if seed in set(table["seed"].astype(int)):
            continue
        cse_dir, trunk = sweep.model_dir(arm, seed), sweep.model_dir(sweep.trunk.name, seed)
        if not sweep.result_path(arm, seed).is_file() or not (trunk / "checkpoints").is_dir():
            log.warning("expert_figure: seed %d has no finished %s unit or trunk in %s: left out", seed, arm, run_dir)
            continue
        step, last = list_checkpoints(cse_dir)[-1]
        same = dict(list_checkpoints(trunk)).get(step)
        if same is None:
            raise MissingInput(f"expert_figure: the dense trunk of seed {seed} has no checkpoint at step {step}")
        rows = measure_seed(load_checkpoint(last).eval(), load_checkpoint(same).eval(), probe.input_ids, domains,
                            tail=tail, min_units=min_units, draws=draws, seed=seed)
        table = pd.concat([table, pd.DataFrame([{"seed": seed, "step": step, **r} for r in rows],
                                               columns=EXPERT_COLUMNS)], ignore_index=True)
        out.mkdir(parents=True, exist_ok=True)
        write_table(table, path)  # seed by seed: an interrupted run resumes
        log.info("expert_figure: seed %d measured (%d experts)", seed, len(rows))
    found = verdicts(table, seeds)
    found.update({"arm": arm, "per_domain": per_domain, "min_units": min_units, "draws": draws})
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "verdicts.json", found)
    judged = table[table["judged"].astype(bool)]
    if len(judged):
        save_figure(expert_consistency(judged), out / "experts.png")
    return found
