"""What every column of the tables ``ntkscope`` writes means, in one place: the report's
glossary (:mod:`ntkscope.app.report`) reads it, and a test holds every column of the committed
tables to it. Columns named after a domain, a null or a layer follow the patterns below."""

from __future__ import annotations

import re

COLUMNS = {
    # where a row sits
    "step": "Training step (optimizer steps done) of the checkpoint or probe.",
    "label": "The subset: a frequency bin (\"bin k\"), a label of the data, or a tracker's named probe subset.",
    "layer": "Layer: an index, or for a tracker the parameter block (\"all\": the whole model's kernel).",
    "draw": "Which independent draw of analysis sentences the row belongs to.",
    "output": "The scalar f(x) whose gradients make the kernel (docs/gc-outputs.md).",
    "left": "Lower edge of the frequency-score bin.",
    "right": "Upper edge of the frequency-score bin.",
    "bin": "Index of the frequency-score bin (0: the rarest sentences).",
    "count": "Sentences in the bin.",
    "percent": "Share of the sentences (or tokens) in the row, in percent.",
    # gradient consistency and its statistics
    "gc": "Gradient consistency: cos(g(X), g(X')) of the subset's primary gradient direction with the whole set's.",
    "gc_low": "Lower end of GC's interval (jackknife, 90 % by default).",
    "gc_high": "Upper end of GC's interval.",
    "abs_gc": "|GC|: the sign of an eigenvector is arbitrary, so the magnitude is what is compared.",
    "abs_gc_low": "Lower end of |GC|'s interval.",
    "abs_gc_high": "Upper end of |GC|'s interval.",
    "abs_gc_se": "Jackknife standard error of |GC|: the draw-to-draw noise to compare two GCs by.",
    "abs_gc_bias": "Jackknife estimate of |GC|'s finite-sample bias (positive: the point overstates the large-sample value).",
    "abs_gc_large": "Bias-corrected large-sample |GC|, where the half-sample check claims it (else empty).",
    "abs_gc_large_low": "Lower end of the large-sample |GC|'s interval.",
    "abs_gc_large_high": "Upper end of the large-sample |GC|'s interval.",
    "large_sample": "\"claimed\", or why the large-sample estimate is not (the bias is not O(1/n)).",
    "null_low": "Lower end of the random null band: |GC| of random subsets of the same size.",
    "null_median": "Median |GC| of random subsets of the same size.",
    "null_high": "Upper end of the random null band.",
    "versus_null": "Where |GC| lies against the random null band: below, within or above.",
    "excess": "|GC| minus the random null's median: how much less (negative) or more coherent the subset is than chance.",
    "excess_se": "Standard error of the excess.",
    "sign_confidence": "Chance that an independent draw keeps GC's sign (jackknife normal approximation).",
    "gc_signed": "GC where its sign is confident, else empty.",
    "mean_gradient": "Cosine of the subset's mean gradient with the whole set's (no eigenvector involved).",
    "mean_gradient_low": "Lower end of the mean-gradient cosine's interval.",
    "mean_gradient_high": "Upper end of the mean-gradient cosine's interval.",
    "flags": "Why a direction is ill-defined: eigengap(-subset): the top two eigenvalues are close; cos-ones(-subset): "
             "the eigenvector is far from the all-ones direction; sign: the sign is a coin toss.",
    "extended": "Whether the interval was widened to the statistic's range because a replicate left it.",
    "n_subset": "Samples in the subset.",
    "n": "Samples in the whole set (or in the row's group).",
    "eigenvalue": "Top eigenvalue of the whole set's NTK (|g(X)|^2).",
    "eigenvalue_subset": "Top eigenvalue of the subset's NTK.",
    "eigengap": "Second over first eigenvalue of the whole set's NTK (near 1: the direction is ill-defined).",
    "eigengap_subset": "Second over first eigenvalue of the subset's NTK.",
    "cos_ones": "|cos| of the whole set's top eigenvector with the all-ones vector.",
    "cos_ones_subset": "|cos| of the subset's top eigenvector with the all-ones vector.",
    "method": "How the kernel was computed: exact, structured, projected or matrix-free.",
    "interval_method": "The interval's method: jackknife (default), basic or bca bootstrap.",
    "resamples": "Jackknife deletions (or bootstrap resamples) behind the interval.",
    "seed": "Seed of the resampling, the null draws, or the training run.",
    "mean_frequency_score": "Mean frequency score of the subset's sentences.",
    "kernel_cka": "Centred kernel alignment of this probe's NTK with the previous probe's (1: the kernel only rescaled).",
    "seconds": "Seconds the probe took.",
    # representations and clusters
    "k": "The elbow K of K-Means on the layer's embeddings.",
    "knee_strength": "How sharp the elbow is (0: no elbow).",
    "k_silhouette": "The K with the best silhouette (1 when none reaches 0.25).",
    "silhouette": "Best silhouette over K.",
    "inter_distance": "Mean distance between cluster centres.",
    "mean_radius": "Mean distance of points to their cluster centre.",
    "separation": "Inter-cluster distance over mean radius: how separated the layer's clusters are.",
    "n_clusters": "Clusters the CSE router finds (HDBSCAN) in the layer's embeddings.",
    "n_noise": "Points the router leaves as noise.",
    "largest_share": "Share of the points in the largest cluster.",
    "overlap_next": "Adjusted Rand index of the router's labels with the next checkpoint's (stability).",
    "n_pure": "Clusters at least 80 % of one domain.",
    "n_pure_tail": "Pure clusters of a long-tail domain.",
    "tail_share": "Share of long-tail sentences that sit in pure tail clusters.",
    "ari": "Adjusted Rand index of the router's clusters with the domains.",
    "cluster": "Cluster label (-1: noise).",
    "size": "Points in the cluster.",
    "x": "First coordinate of the 2-D view.",
    "y": "Second coordinate of the 2-D view.",
    # routing and models
    "expert": "Expert index of the sparse layer.",
    "domain": "Domain of the text (general, legal, biomedical, or the data's labels).",
    "model": "The model (row of the paper's tables).",
    "perplexity": "Perplexity on all test text.",
    "average": "Average accuracy over the probing tasks.",
    "score": "Sentence frequency score: mean log frequency of its tokens (low: rare words).",
    "n_tokens": "Tokens in the sentence.",
    "loss": "Cross-entropy loss, nats per token.",
    "median_perplexity": "Median perplexity of the bin's sentences.",
    "mean_loss": "Mean loss of the bin's sentences.",
    "ppl": "Perplexity (exp of the loss).",
    "lr": "Learning rate at the step.",
    "tokens_per_s": "Training throughput, tokens per second.",
    "grad_norm": "Gradient norm before clipping.",
    "aux": "Auxiliary (load-balancing) loss of the sparse layers.",
    "texts": "Texts evaluated.",
    "tokens": "Tokens evaluated.",
    "ppl_low": "Lower end of perplexity's bootstrap interval.",
    "ppl_high": "Upper end of perplexity's bootstrap interval.",
    "vs_dense": "Relative change of perplexity against the dense model (negative: better).",
    "arm": "The arm of a comparison (dense, CSE, Switch, ...).",
    "checkpoint": "The checkpoint evaluated.",
    "seeds": "Training seeds in the mean.",
}

#: columns named after something: (pattern, meaning with {0} for the name)
PATTERNS = [
    (r"null_(.+)_low", "Lower end of the {0} null band."),
    (r"null_(.+)_median", "Median |GC| of the {0} null's subsets."),
    (r"null_(.+)_high", "Upper end of the {0} null band."),
    (r"versus_(.+)", "Where |GC| lies against the {0} null band: below, within or above."),
    (r"tail_share (.+)", "Share of {0} sentences in pure {0} clusters."),
    (r"knn_lift (.+)", "How much more often a {0} sentence's nearest neighbours are {0} than chance."),
    (r"silhouette (.+)", "Silhouette of {0} against the rest in the routing space."),
    (r"share (.+)", "Share of the row's points from {0}."),
    (r"n (.+)", "Points from {0}."),
    (r"ppl (.+)", "Perplexity on {0} test text."),
    (r"load/(.+)", "Share of tokens routed to {0}."),
    (r"(.+) mean", "Mean over seeds of {0}."),
    (r"(.+) std", "Standard deviation over seeds of {0}."),
    (r"(.+-.+)", "Accuracy of the {0} probing task."),
]


def describe(column: str) -> str | None:
    """What ``column`` means, or None when it is not written down."""
    if column in COLUMNS:
        return COLUMNS[column]
    for pattern, text in PATTERNS:
        found = re.fullmatch(pattern, column)
        if found:
            inner = found.group(1)
            return text.format(describe(inner).rstrip(".").lower() if pattern.startswith("(.+) ")
                               and describe(inner) else inner)
    return None
