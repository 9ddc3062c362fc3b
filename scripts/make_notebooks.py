"""Write the notebooks in notebooks/ (one per figure of the CSE paper, one for the figures'
Tables 1-2 slice, one for the paper's tables with every row)
and, with --execute, run them in place against RUN_DIR (default: the committed run).

    python scripts/make_notebooks.py [--execute] [--only NAME ...]

Each notebook has a cell tagged "parameters" (RUN_DIR, MODE), uses only the public API
(``ntkscope``, ``ntkscope.plotting``) and writes its figures into RUN_DIR/figures.
Each panel is drawn by ``Reproduction.figure`` (the ``ntkscope.plotting`` call behind it is
in the cell's comment, to copy and change), so the notebooks and ``ntkscope reproduce`` write
the same files; a figure is shown from the written PNG.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from ntkscope.reproduction.panels import PANELS

ROOT = Path(__file__).resolve().parent.parent
PARAMETERS = 'RUN_DIR = "../figures/tail"  # a reproduction run directory (created and filled if empty)\n' \
             'MODE = "tail"  # "smoke", "quick" (2 CPU cores, 15 min), "tail" (2 CPU cores, ~1 h) or "full" (GPU)'
PAPER_PARAMETERS = 'RUN_DIR = "../figures/tables"  # a reproduction run directory (created and filled if empty)\n' \
    'MODE = "tables"  # "tables" (2 CPU cores, see docs/tables.md) or "smoke"'
SETUP = ("import ntkscope\n"
         "from IPython.display import Image, Markdown\n"
         "from ntkscope import plotting\n\n"
         "rep = ntkscope.Reproduction(RUN_DIR, MODE)  # trains and measures only what RUN_DIR lacks\n"
         "rep.settings")


def save(panel: str) -> str:
    """Draw ``panel`` as ``ntkscope reproduce`` does (the comment shows the plotting call behind it,
    from the reproduction's panel table)."""
    return (f"fig = rep.figure({panel!r})  # draws {PANELS[panel].call}\n"
            f"paths = plotting.save_figure(fig, rep.figure_path({panel!r}), formats=(\"png\", \"pdf\"))\n"
            "Image(filename=str(paths[0]))")


NOTEBOOKS = {
    "fig1_long_tail": [
        "# Figure 1: the long tail, and what it costs\n\n(a) The corpus's largest categories: a few general "
        "sources hold most of the text; legal and biomedical text is a long tail. (b) The dense GPT's perplexity "
        "on held-out sentences against their sentence frequency score (docs/design.md §2): the rarer a sentence's tokens, "
        "the higher its perplexity.",
        PARAMETERS, SETUP,
        't = rep.tables("fig1")\nt["domain_sizes"]',
        save("fig1a"),
        't["perplexity_by_bin"]',
        save("fig1b"),
    ],
    "fig2_gradient_consistency": [
        "# Figure 2: gradient consistency and frequency; a CSE layer's clusters\n\n(a) GC of each frequency bin "
        "against the whole analysis set, on the dense GPT's last checkpoint, for three outputs: |GC| with its "
        "finite-n interval beside the null bands of random and of homogeneous subsets (docs/design.md §1.1), "
        "the mean-gradient consistency, and a strip with the share of sentences per bin. (b) The fitting sample (training blocks) at the first CSE layer's input at the warm-up, in the "
        "router's space (centred, L2-normalised; 2-D PCA), coloured by the clusters the router was built from "
        "(HDBSCAN), with each cluster's domain make-up.",
        PARAMETERS, SETUP,
        't = rep.tables("fig2")\nt["gc_by_bin"][["label", "abs_gc", "abs_gc_low", "abs_gc_high", "versus_null", '
        '"versus_homogeneous", "versus_matched-length", "versus_matched-loss", "flags"]]',
        save("fig2a"),
        save("fig2b"),
    ],
    "fig3_training_dynamics": [
        "# Figure 3: over training\n\n(a) GC of the long-tail subset (the third of the analysis sentences with the "
        "lowest frequency scores) at every dense checkpoint, on independent draws of analysis sentences, and its "
        "excess over the random null with the null bands in the same coordinates; a warm-up is the excess's "
        "peak when the statistics show one (unflagged checkpoints only), else the earliest checkpoint with stable "
        "router clusters. (b) Per "
        "layer: the silhouette K (1 = no structure) beside the paper's elbow K, the best silhouette, and (c) the "
        "distance between elbow centres; second row: the router's clusters of the fitting sample, the pure "
        "tail clusters, the tail share in them and the tail domains' kNN lift.",
        PARAMETERS, SETUP,
        't = rep.tables("fig3")\nt["gc_over_steps"]',
        save("fig3a"),
        't["router_dynamics"]',
        save("fig3bc"),
        "rep.plan()  # the plan the CSE runs were built with",
        "ntkscope.gc_peak(t[\"gc_over_steps\"])  # the peak test on the excess over the null",
    ],
    "fig4_cse_layer": [
        "# Figure 4: the CSE layer; cluster snapshots\n\n(a) The layer, drawn. (b) The fitting sample at one "
        "planned layer's FFN input at evenly spaced dense checkpoints, coloured by the router's clusters.",
        PARAMETERS, SETUP,
        save("fig4a"),
        't = rep.tables("fig4")\nt["snapshot_clusters"]',
        save("fig4b"),
    ],
    "fig5_experts": [
        "# Figure 5: where CSE sends each block, and each expert's NTK\n\n(a) Every held-out (validation) block "
        "coloured by the expert the trained CSE model routes it to; the table gives each expert's domain make-up. (b) Each expert's empirical NTK (over its own FFN "
        "parameters) on the sentences routed to it; (c) the dense baseline's NTK (same layer's FFN) on the same "
        "sentences, ordered by expert. Kernels are shown as cosines Θ_ij / sqrt(Θ_ii Θ_jj).",
        PARAMETERS, SETUP,
        't = rep.tables("fig5")\nt["routing_summary"]',
        save("fig5a"),
        't["expert_ntk"]',
        save("fig5bc"),
    ],
    "tables_results": [
        "# Tables 1-2: the models compared\n\nTest perplexity (all text and per domain) and linear-probe accuracy "
        "on frozen embeddings for the pack's probe tasks (stand-ins for the paper's downstream tasks), for the "
        "dense GPT, its domain-finetuned copies, Switch and CSE (MoF); then CSE, Switch (upcycled from the same "
        "warm-up) and the dense continuation over seeds, mean and standard deviation.",
        PARAMETERS, SETUP,
        'paths = rep.write_tables()\nMarkdown(paths[1].read_text())',
        'rep.tables("tables")["seeds_summary"]',
    ],
    "tables_paper": [
        "# The paper's tables, every row: BERT and GPT, MoF and MoA, tuned rows, DEMix\n\nEvery row of the CSE "
        "paper's Table 1 (BERT) and Table 2 (GPT) over three pretraining seeds (`ntkscope reproduce --tables`, "
        "docs/tables.md): dense, dense tuned on each long-tail domain, Switch and Switch tuned, CSE on the FFN (MoF) "
        "and on attention (MoA) with no tuning, and DEMix. Cells are mean ± std over pretraining seeds; a difference "
        "is called one only when mean ± std are apart and Welch's t-test gives p < 0.05. Then the general-tasks "
        "table: what tuning costs the general domain, and whether CSE pays it.",
        PAPER_PARAMETERS, SETUP,
        'paths = rep.write_paper_tables()\nMarkdown(paths[0].read_text())',
        't = rep.tables("paper")\nt["table_gpt"][["model", "perplexity mean", "perplexity std", "average mean", '
        '"average std", "experts", "active_params", "tuning_tokens"]]',
        't["table_tests"].query("verdict != \'not shown\'")',
    ],
}


def build(name: str, cells: list) -> nbformat.NotebookNode:
    nb = new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    for i, source in enumerate(cells):
        cell = new_markdown_cell(source) if i == 0 else new_code_cell(source)
        if source in (PARAMETERS, PAPER_PARAMETERS):
            cell.metadata["tags"] = ["parameters"]
        nb.cells.append(cell)
    return nb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--execute", action="store_true", help="run each notebook in place (needs nbclient)")
    parser.add_argument("--only", nargs="+", choices=sorted(NOTEBOOKS), help="write (and run) only these notebooks")
    args = parser.parse_args()
    for name, cells in NOTEBOOKS.items():
        if args.only and name not in args.only:
            continue
        path = ROOT / "notebooks" / f"{name}.ipynb"
        nb = build(name, cells)
        if args.execute:
            from nbclient import NotebookClient

            NotebookClient(nb, timeout=1800, resources={"metadata": {"path": str(path.parent)}}).execute()
        nbformat.write(nb, path)
        print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()

