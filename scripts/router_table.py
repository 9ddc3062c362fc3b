"""Rule x representation of the CSE router on a run's fitting sample (docs/router.md).

For a dense checkpoint: the fitting sample a CSE conversion would cluster (the same seeded
draw of training blocks, :func:`cse_models.train.fitting_sample`), its FFN-input sequence
embeddings at each layer, and for each clustering rule and representation: the number of
clusters, of pure ones (>= 80 % one domain), the tail share in pure clusters of their own
domain, the adjusted Rand index against the domains, and the seconds the fit took::

    python scripts/router_table.py RUN/models/gpt-dense/checkpoints/step-000800 --out docs/router-table.csv
"""

from __future__ import annotations

import argparse
import itertools
import logging
import time

import pandas as pd

from cse_models.train import fitting_sample, load_data
from ntkscope.representation.router import fit_router
from ntkscope.representation.structure import cluster_purity
from ntkscope.runs.checkpoints import load_checkpoint

TAIL = ("legal", "biomedical")

#: (rule, options) rows measured; representations x projections are crossed with each
RULES = [("dbscan-knee", {}), ("dbscan-percentile", {"percentile": 10.0}),
         ("hdbscan", {"min_cluster_size": 5}), ("hdbscan", {"min_cluster_size": 15}),
         ("hdbscan", {"min_cluster_size": 30}), ("hdbscan", {"min_cluster_size": 15, "selection": "leaf"})]
SPACES = [("raw", 32), ("raw", 128), ("centred", 128), ("centred-cosine", 32), ("centred-cosine", 64),
          ("centred-cosine", 128)]


def measure(checkpoint, *, n: int = 3000, seed: int = 0, seq_len: int = 48, layers=None) -> pd.DataFrame:
    from cse_models.train import TrainConfig

    blocks, _ = load_data(TrainConfig.from_dict({"data": {"seq_len": seq_len}}))
    idx = fitting_sample(len(blocks), n, seed)
    domains = [blocks.domain_names[int(d)] for d in blocks.domains[idx]]
    model = load_checkpoint(checkpoint).eval()
    layers = list(range(model.config.n_layer)) if layers is None else layers
    emb = model.module_inputs(blocks.input_ids[idx], None, layers)
    rows = []
    for layer, (rule, opts), (rep, dim) in itertools.product(layers, RULES, SPACES):
        start = time.perf_counter()
        fit = fit_router(emb[layer].double().numpy(), rule=rule, representation=rep, proj_dim=dim,
                         max_experts=None, seed=seed, **opts)
        seconds = time.perf_counter() - start
        quality = cluster_purity(fit.labels, domains, tail=TAIL)
        rule_name = rule + "".join(f" {k}={v}" for k, v in opts.items())
        rows.append({"layer": layer, "rule": rule_name, "representation": rep, "proj_dim": min(dim, emb[layer].shape[1]),
                     **quality, "seconds": round(seconds, 2)})
        logging.info("layer %d %s %s/%d: %d clusters, %d pure (%d tail), tail share %.2f, ARI %.2f", layer,
                     rule_name, rep, dim, quality["n_clusters"], quality["n_pure"], quality["n_pure_tail"],
                     quality["tail_share"], quality["ari"])
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--n", type=int, default=3000, help="fitting-sample size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, nargs="*")
    parser.add_argument("--out", default="router-table.csv")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    table = measure(args.checkpoint, n=args.n, seed=args.seed, layers=args.layers)
    table.to_csv(args.out, index=False)
    logging.info("wrote %s (%d rows)", args.out, len(table))


if __name__ == "__main__":
    main()
