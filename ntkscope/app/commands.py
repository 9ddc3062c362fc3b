"""What each ``ntkscope`` command does, as library functions: load, analyse, and write the
results (JSON + CSV + PNG, .npy, tables) atomically. The command line (:mod:`ntkscope.app.cli`)
only parses arguments and prints what these return.

Every result file is written into a temporary directory first and moved into ``out``
only when the whole command succeeded, so a failed command leaves no partial output.
A re-run with the same options and inputs finds its ``result.json`` and reuses it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np

from cse_models.domains import context_length, evaluate_domains
from cse_models.expert_report import expert_report, has_experts
from cse_models.hf import architecture
from ntkscope import __version__
from ntkscope.core.checks import InputError, UserError
from ntkscope.core.files import Staging, check_output, digest, write_json, write_table
from ntkscope.gc.options import GCOptions
from ntkscope.core.memory import available_memory_bytes, format_bytes
from ntkscope.core.provenance import provenance
from ntkscope.kernel.distributed import from_rank0, writes
from ntkscope.kernel.experts import find_mixtures
from ntkscope.kernel.ntk import empirical_ntk
from ntkscope.kernel.objectives import CausalLMLoss, resolve_output
from ntkscope.kernel.options import KernelOptions
from ntkscope.kernel.uncertainty import Resampling
from ntkscope.plotting import gc_over_steps, gc_vs_frequency, ntk_heatmap, routing_shares, save_figure
from ntkscope.representation.clusters import layer_separation
from ntkscope.representation.plan import gc_peak, make_plan
from ntkscope.runs.checkpoints import (check_vocab, checkpoint_tokenizer, is_run_dir, list_checkpoints,
                                       load_checkpoint, schedule_length)
from ntkscope.runs.dynamics import (cluster_dynamics, clusters_analysis, clusters_table, gc_analysis, gc_series,
                                    gc_table, persistence_tables, router_analysis, router_table, walk)
from ntkscope.runs.embeddings import layer_embeddings
from ntkscope.runs.families import family_of
from ntkscope.runs.signals import warmup_record
from ntkscope.gc.groups import GC_OUTPUT, gc_by_group, gc_sensitivity, group_labels, homogeneous_pools
from ntkscope.gc.experts import expert_view
from ntkscope.gc.tokens import extreme_tokens, token_scores
from ntkscope.text.corpus.pack import load_pack
from ntkscope.text.corpus.text import Record
from ntkscope.text.frequency import (count_tokens, domain_table, long_tail_subset, score_histogram,
                                     sentence_table)
from ntkscope.text.inputs import as_source
from ntkscope.text.sentences import Sentences, load_analysis_data
from ntkscope.text.tokenization import load_tokenizer

log = logging.getLogger(__name__)

#: result.json's layout: 2 added ``provenance``; a result cached in an older layout is computed again
RESULT_FORMAT = 2
#: every figure a command writes, as PNG and PDF
FORMATS = ("png", "pdf")


def cached_result(out: Path | None, key: str) -> dict | None:
    """The ``result.json`` in ``out`` when it was made with the same options and inputs (``key``)."""
    if out is None or not (Path(out) / "result.json").is_file():
        return None
    result = json.loads((Path(out) / "result.json").read_text())
    return result if result.get("key") == key else None


def load_model_and_tokenizer(checkpoint, tokenizer=None, data=None):
    """The model of ``checkpoint`` and its tokenizer (the one resolution rule), vocabulary checked."""
    model = load_checkpoint(checkpoint)
    tok = checkpoint_tokenizer(checkpoint, tokenizer, data)
    check_vocab(model, tok, "ntkscope")
    return model, tok


def analysis_sentences(model, tok, data, sentences: Sentences):
    """The ``sentences`` of ``data`` for ``model``: refused in one line when they are longer than the
    model's context (``seq_len`` above it), before the model sees them."""
    ad = load_analysis_data(data, tok, n=sentences.n, seq_len=sentences.seq_len, seed=sentences.seed)
    seq_len = sentences.seq_len
    try:
        context = context_length(model)
    except ValueError:  # a model that does not say: its own error, if any, comes later
        context = None
    longest = int(ad.batch["input_ids"].shape[1])
    if context is not None and longest > context:
        raise InputError("seq-len", f"must be at most the model's context of {context} tokens (sentences of "
                         f"{longest} tokens were read)", seq_len)
    return ad


def memory_note(model, options: KernelOptions) -> str:
    """The memory this analysis may use on ``options``' device; what each method needs is the
    method table's to estimate (:func:`ntkscope.kernel.methods.choose` logs it next)."""
    budget = options.max_memory
    return (f"memory: {format_bytes(available_memory_bytes(options.device))} available on "
            f"{options.device or 'cpu'}; budget {format_bytes(budget) if budget else 'half of that'}; the model "
            f"has {sum(p.numel() for p in model.parameters()):,} parameters; 'auto' estimates each method's memory "
            "and time next, and picks the cheapest that fits")


def data_files(source) -> list:
    """The files ``source``'s text comes from, for ``provenance``: its files, or the pack's directory."""
    return source.files or ([source.pack().path] if source.kind == "pack" else [])


def _key_options(data, sentences: Sentences, kernel: KernelOptions, resampling: Resampling | None = None,
                 **more) -> dict:
    """A command's options as they go into its cache key and ``result.json``: every field of
    every options object, the data source's, and the code's version."""
    return {**data.options(), "sentences": sentences.to_dict(), "kernel": kernel.to_dict(),
            **({} if resampling is None else {"resampling": dataclasses.asdict(resampling)}), **more,
            "version": __version__, "format": RESULT_FORMAT}


def gc_command(checkpoint, data=None, *, sentences: Sentences = Sentences(),
               kernel: KernelOptions = KernelOptions(output=GC_OUTPUT), gc: GCOptions = GCOptions(),
               resampling: Resampling = Resampling(), tokens: int = 0, out=None) -> dict:
    """GC of each subset (frequency bin or label: ``gc``) against the whole set of the ``sentences``,
    with intervals, bias, sign confidence, conditioning and the null bands (``resampling``: random,
    homogeneous: ``gc.homogeneous_label``'s sentences or gradient-space neighbours, matched on length
    and loss), the kernel computed as ``kernel`` says; ``gc.outputs`` (several scalar outputs) puts
    them side by side with an ``output`` column. A table whose every row is flagged is kept, with a
    warning in ``result["warnings"]``.

    ``tokens`` > 0: each group's ``tokens`` highest- and lowest-scoring tokens against its primary
    direction (:func:`~ntkscope.gc.tokens.token_scores`, one output) in ``tokens.csv``.

    Writes ``gc.csv``, ``histogram.csv``, ``result.json`` and ``gc_vs_frequency.png`` to ``out``.
    """
    check_output("gc", out)
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise InputError("tokens", "must be a count of tokens, 0 or more", tokens, func="gc")
    if tokens and gc.outputs:
        raise InputError("tokens", "must be 0 with several outputs side by side (token scores take one output)",
                         tokens, func="gc")
    data = as_source(data)
    options = {"checkpoint": str(checkpoint), **_key_options(data, sentences, kernel, resampling, gc=gc.to_dict()),
               **({"tokens": tokens} if tokens else {})}
    tok = checkpoint_tokenizer(checkpoint, sentences.tokenizer, data)  # its file is an input: retrained, a new key
    tokenizer_files = [Path(tok.name)] if Path(tok.name).exists() else []
    key = digest(options, paths=[checkpoint, *data.files, *tokenizer_files])
    cached = from_rank0(cached_result(out, key))  # every process takes rank 0's decision
    if cached:
        log.info("gc: reusing the result in %s (same options and inputs)", out)
        return cached
    model, tok = load_model_and_tokenizer(checkpoint, sentences.tokenizer, data)
    if tokens and not isinstance(resolve_output(kernel.output, model), CausalLMLoss):  # before the GC's minutes
        raise InputError("tokens", "needs a per-token output of a causal language model (--output loss, true-logit "
                         f"or centred-true-logit), not {kernel.output!r}", tokens, func="gc")
    ad = analysis_sentences(model, tok, data, sentences)
    log.info("%s", memory_note(model, kernel))
    by_output = gc_sensitivity if gc.outputs else gc_by_group  # gc.outputs: several side by side
    table, hist, skipped = by_output(model, ad, gc=gc, resampling=resampling, options=kernel)
    extremes = None
    if tokens:
        labels, _ = group_labels(ad, gc.by, gc.bins, gc.binning)
        members = {str(lab): np.flatnonzero(labels == lab) for lab in table["label"]}
        extremes = extreme_tokens(token_scores(model, ad.batch, members, output=kernel.output, params=kernel.params,
                                               method=kernel.method), tok, tokens)
    out = out if writes() else None
    result = {"key": key, "options": options, "data": ad.source, "n": sentences.n, "groups": table.to_dict("records"),
              "skipped": skipped, "warnings": flag_warnings(table),
              "provenance": provenance(weights=checkpoint, data_files=data_files(data), tokenizer=tok.name)}
    for warning in result["warnings"]:
        log.warning("gc: %s", warning)
    with Staging(out) as files:
        table.to_csv(files.path("gc.csv"), index=False)
        hist.to_csv(files.path("histogram.csv"), index=False)
        if extremes is not None:
            extremes.to_csv(files.path("tokens.csv"), index=False)
        if gc.by == "frequency-bins":
            save_figure(gc_vs_frequency(table, hist, title=f"{Path(checkpoint).name}: GC against sentence "
                                        f"frequency (n={sentences.n})"), files.path("gc_vs_frequency.png"),
                        formats=FORMATS)
        write_json(files.path("result.json"), result)
    result["files"] = files.written
    return result


def flag_warnings(table) -> list:
    """One warning per output whose every row is flagged: its directions are not to be read."""
    out = []
    by = table.groupby("output") if "output" in table.columns else [(None, table)]
    for output, rows in by:
        flags = rows["flags"].fillna("")
        if len(rows) and (flags != "").all():
            out.append(f"every row{f' of output {output}' if output else ''} is flagged "
                       f"({', '.join(sorted({f for fl in flags for f in fl.split()}))}): its directions are ill-defined "
                       "and its |GC| is not to be read; try another --output (docs/gc-outputs.md)")
    return out


def gc_run_command(run_dir, data=None, *, sentences: Sentences = Sentences(),
                   kernel: KernelOptions = KernelOptions(output=GC_OUTPUT), gc: GCOptions = GCOptions(),
                   resampling: Resampling = Resampling(), cache_dir=None, out=None) -> dict:
    """GC of the long-tail subset (``gc.tail_fraction`` of the sentences, lowest frequency scores)
    against the whole set at every checkpoint of a run, with its statistics: ``gc_over_steps.csv``,
    ``result.json`` and ``gc_over_steps.png``. ``peak``: :func:`ntkscope.gc_peak` (step, shown, why).
    ``sentences``, ``kernel``, ``resampling`` and ``gc.homogeneous_label`` as for :func:`gc_command`,
    at every checkpoint (``gc``'s grouping fields are for one checkpoint: the command line refuses
    them here). Each checkpoint's result is cached in ``cache_dir`` (default: RUN/analysis when
    the run is ours to write, else the user's cache)."""
    check_output("gc", out)
    checkpoints = list_checkpoints(run_dir)
    model, tok = load_model_and_tokenizer(checkpoints[-1][1], sentences.tokenizer, data)
    ad = analysis_sentences(model, tok, data, sentences)
    tail = long_tail_subset(ad.labels["score"], gc.tail_fraction)
    try:
        pools = homogeneous_pools(ad, gc.homogeneous_label)
    except InputError as err:  # named as the command names it
        raise InputError("homogeneous_label", err.rule, gc.homogeneous_label, func="gc") from None
    frame = gc_series(run_dir, ad.batch, tail, resampling=resampling, pools=pools, cache_dir=cache_dir, options=kernel)
    peak = gc_peak(frame)
    result = {"run": str(run_dir), "data": ad.source, "n": sentences.n, "n_tail": len(tail),
              "options": _key_options(as_source(data), sentences, kernel, resampling,
                                      gc={k: gc.to_dict()[k] for k in ("tail_fraction", "homogeneous_label")}),
              "peak": peak, "series": frame.to_dict("records"),
              "provenance": provenance(weights={step: path for step, path in checkpoints},
                                       data_files=data_files(as_source(data)), tokenizer=tok.name)}
    with Staging(out) as files:
        frame.to_csv(files.path("gc_over_steps.csv"), index=False)
        save_figure(gc_over_steps(frame, warmup=peak["step"] if peak["shown"] else None, rule="gc-peak"),
                    files.path("gc_over_steps.png"), formats=FORMATS)
        write_json(files.path("result.json"), result)
    result["files"] = files.written
    return result


def ntk_command(checkpoint, data=None, *, sentences: Sentences = Sentences(n=64),
                kernel: KernelOptions = KernelOptions(), blocks=None, out=None) -> dict:
    """The empirical NTK of the ``sentences``, computed as ``kernel`` says: ``ntk.npy`` (n, n),
    ``blocks.npz`` (one kernel per block of ``blocks``), ``labels.csv`` and ``ntk.png`` (samples
    ordered by label)."""
    check_output("ntk", out)
    model, tok = load_model_and_tokenizer(checkpoint, sentences.tokenizer, data)
    ad = analysis_sentences(model, tok, data, sentences)
    log.info("%s", memory_note(model, kernel))
    result_ntk = empirical_ntk(model, ad.batch, blocks=blocks, options=kernel)
    matrix = result_ntk.matrix.detach().cpu().numpy()
    out = out if writes() else None
    result = {"checkpoint": str(checkpoint), "data": ad.source, "n": sentences.n, "method": result_ntk.method,
              "reason": result_ntk.reason, "blocks": list(result_ntk.blocks or {}),
              "trace": float(np.trace(matrix)), "options": _key_options(as_source(data), sentences, kernel),
              "provenance": provenance(weights=checkpoint, data_files=data_files(as_source(data)),
                                       tokenizer=tok.name)}
    with Staging(out) as files:
        np.save(files.path("ntk.npy"), matrix)
        if result_ntk.blocks:
            np.savez(files.path("blocks.npz"), **{k: v.detach().cpu().numpy() for k, v in result_ntk.blocks.items()})
        ad.labels.to_csv(files.path("labels.csv"), index=False)
        save_figure(ntk_heatmap(matrix, ad.labels["label"], title=f"NTK of {Path(checkpoint).name} (n={sentences.n})"),
                    files.path("ntk.png"), formats=FORMATS)
        write_json(files.path("result.json"), result)
    result["files"] = files.written
    return result


def _write_tables(out, tables: dict) -> list[str]:
    """Each {file name: DataFrame} into directory ``out``, all or nothing."""
    if out is None:
        return []
    with Staging(out) as files:
        for name, frame in tables.items():
            write_table(frame, files.path(name))
    return files.written


def corpus_info(pack=None, *, tokenizer=None, normalisation: str = "max", bins: int = 10, top: int = 20,
                out=None) -> dict:
    """A pack's domain sizes, sentence frequency scores and their histogram (``ntkscope corpus info``)."""
    check_output("corpus info", out)
    pack = load_pack(pack)
    tok = load_tokenizer(tokenizer) if tokenizer else pack.tokenizer()
    counts = count_tokens(pack.records("train"), tok)
    sentences = sentence_table(pack.records("all"), tok, counts=counts, normalisation=normalisation)
    hist = score_histogram(sentences["score"], bins=bins, range=(0.0, float(sentences["score"].max())))
    written = _write_tables(out, {"domain_table.csv": domain_table(pack.records("all"), top=None),
                                  "score_histogram.csv": hist, "sentence_scores.parquet": sentences,
                                  "token_counts.parquet": counts.to_frame(tok)})
    return {"pack": pack, "tokenizer": tok, "domains": domain_table(pack.records("all"), top=top),
            "sentences": sentences, "histogram": hist, "files": written}


def freq_command(data="default", *, tokenizer=None, normalisation: str = "max", bins: int = 10, out=None) -> dict:
    """Token counts and sentence frequency scores of any data :func:`~ntkscope.text.inputs.as_source`
    reads (``ntkscope freq``): every sentence of a pack, or of a table's / a file's rows."""
    check_output("freq", out)
    data = as_source(data)
    if data.kind == "pack":
        pack = data.pack()
        records = pack.records("all")
        tok = load_tokenizer(tokenizer) if tokenizer else pack.tokenizer()
    else:
        records = [Record(t, "file", label, label, f"file:{i}") for i, (t, label) in enumerate(data.rows())]
        if not tokenizer:
            raise UserError(f"freq: {data.kind} data needs --tokenizer (a tokenizer.json, an HF directory, or "
                            "'gpt2')")
        tok = load_tokenizer(tokenizer)
    counts = data.reference_counts(tok)
    # a pack's records are paragraphs, split into sentences; a table's or a file's rows are scored as the rows
    # that gc analyses, whole (one population for both commands)
    table = sentence_table(records, tok, counts=counts, normalisation=normalisation, split=data.kind == "pack")
    hist = score_histogram(table["score"], bins=bins)
    written = _write_tables(out, {"sentence_scores.parquet": table, "histogram.csv": hist,
                                  "token_counts.parquet": counts.to_frame(tok)})
    return {"tokenizer": tok, "sentences": table, "histogram": hist, "files": written}


def eval_command(checkpoint, data="default", *, tokenizer=None, batch_size: int = 16, n_boot: int = 1000,
                 seed: int = 0, out=None, ablate: bool = True, expert_kernels: int = 0) -> dict:
    """Perplexity per domain of ``data``'s rows and, for a sparse model, where each domain is
    routed and what the experts learned (:func:`cse_models.expert_report.expert_report`: purity,
    NMI, each expert's shares, and with ``ablate`` each expert ablated), findings first
    (``ntkscope eval``): any causal checkpoint ``load_checkpoint`` reads (HF or ``cse_models``,
    dense or sparse); a table's label column names the domains. ``expert_kernels`` N > 0: the
    per-expert view on N of the texts (:func:`ntkscope.gc.experts.expert_view`: each expert's
    split-half |GC| and its labels' GC among its units)."""
    check_output("eval", out)
    source = as_source(data)
    model, tok = load_model_and_tokenizer(checkpoint, tokenizer, source)
    rows = source.rows("test") if source.kind == "pack" else source.rows()
    texts, labels = [t for t, _ in rows], [label for _, label in rows]
    encoded = tok.encode(texts)
    result = evaluate_domains(model, encoded, labels, batch_size=batch_size, n_boot=n_boot, seed=seed)
    report = expert_report(model, encoded, labels, batch_size=batch_size, n_boot=min(n_boot, 500), seed=seed,
                           ablate=ablate) if has_experts(model) else None
    view = expert_view(model, encoded, labels, texts=expert_kernels, context=result.context, seed=seed) \
        if expert_kernels and find_mixtures(model) else None
    written = []
    if out is not None:
        with Staging(out) as files:
            write_table(result.perplexity, files.path("perplexity.csv"))
            if report is not None:
                write_table(report.layers, files.path("expert_layers.csv"))
                write_table(report.experts, files.path("experts.csv"))
                if len(report.ablation):
                    write_table(report.ablation, files.path("ablation.csv"))
            if view is not None:
                write_table(view[0], files.path("expert_kernels.csv"))
                write_table(view[1], files.path("expert_gc.csv"))
            if len(result.routing):
                write_table(result.routing, files.path("routing.csv"))
                save_figure(routing_shares(result.routing, title=f"routing of {checkpoint}"),
                            files.path("routing"), formats=FORMATS)
            write_json(files.path("result.json"), {
                "checkpoint": str(checkpoint), **source.options(), "tokenizer": tok.name, "texts": len(texts),
                "context": result.context, "interval": f"{result.level:.0%} percentile bootstrap over texts",
                "n_boot": n_boot, "seed": seed, "batch_size": batch_size,
                "perplexity": result.perplexity.to_dict("records"),
                "findings": [] if report is None else report.findings,
                "provenance": provenance(weights=checkpoint, data_files=data_files(source),
                                         tokenizer=tok.name)})
        written = files.written
    return {"perplexity": result.perplexity, "routing": result.routing, "context": result.context,
            "experts": report, "expert_kernels": view, "tokenizer": tok, "files": written}


def clusters_command(target, data="default", *, sentences: Sentences = Sentences(), point: str = "block",
                     k_max: int = 10, projection_dim: int = 64, top_k: int = 2, cache_dir=None, out=None) -> dict:
    """How a model's (or every checkpoint of a run's) sequence embeddings cluster, layer by layer
    (``ntkscope clusters``): elbow K and separation, and for one model the CSE layers they choose;
    the projection and K-means are seeded with ``sentences.seed``."""
    check_output("clusters", out, kind="file", suffixes=(".csv", ".parquet"))
    result = {"n": sentences.n, "point": point, "run": is_run_dir(target)}
    checkpoint = list_checkpoints(target)[-1][1] if result["run"] else target
    model, tok = load_model_and_tokenizer(checkpoint, sentences.tokenizer, data)
    ad = analysis_sentences(model, tok, data, sentences)
    seed = sentences.seed
    if result["run"]:
        table = cluster_dynamics(target, ad.batch, point=point, k_max=k_max, projection_dim=projection_dim, seed=seed,
                                 cache_dir=cache_dir)
    else:
        emb = layer_embeddings(load_checkpoint(target), ad.batch, point=point)
        table = layer_separation(emb, k_max=k_max, projection_dim=projection_dim, seed=seed)
        result["plan"] = make_plan(table, top_k=top_k)
    if out is not None:
        write_table(table, out)
    return {**result, "table": table}


#: how ``ntkscope plan`` sets the warm-up: its measured rules, or the cross-validated schedule fraction
WARMUP_BY = ("measured", "schedule-fraction")


def plan_command(run_dir, data="default", *, sentences: Sentences = Sentences(),
                 kernel: KernelOptions = KernelOptions(output=GC_OUTPUT), point: str = "block", k_max: int = 10,
                 projection_dim: int = 64, top_k: int = 2, module: str = "ffn", tail_fraction: float = GCOptions.tail_fraction,
                 overlap: float = 0.8, router: dict | None = None, tail_labels=None, choose_by: str = "structure",
                 warmup_by: str = "measured", schedule_steps: int | None = None, cache_dir=None,
                 out="plan.json") -> dict:
    """CSE layers and the warm-up from a run's checkpoints (``ntkscope plan``), saved to ``out``
    (:func:`~ntkscope.make_plan`'s rules): the earliest checkpoint from which the router's small
    clusters persist (:func:`~ntkscope.fit_router` with ``router``, default its defaults), else
    the long tail's GC peak when its statistics show one, else the earliest checkpoint whose
    router clusters are stable (adjusted Rand >= ``overlap``). When the data's sentences carry
    two or more labels, the plan also reports what the clusters hold of the ``tail_labels``
    (default: every label but the most frequent), and ``choose_by="labels"`` chooses by them. The
    long tail's GC is computed as ``kernel`` says; the clusters, router and GC statistics are
    seeded with ``sentences.seed``.

    The plan's ``evidence["warmup_record"]`` says how those rules and the cross-validated signal
    did on the warm-up map (:func:`~ntkscope.runs.signals.warmup_record`) and the step each
    gives here; ``warmup_by="schedule-fraction"`` takes the cross-validated signal's step (half
    the run's schedule: ``schedule_steps``, else the run's own record of its length)."""
    check_output("plan", out, kind="file")
    if warmup_by not in WARMUP_BY:
        raise InputError("warmup_by", f"must be one of {list(WARMUP_BY)}", warmup_by, func="ntkscope plan")
    if schedule_steps is not None and (isinstance(schedule_steps, bool) or not isinstance(schedule_steps, int)
                                       or schedule_steps < 1):
        raise InputError("schedule_steps", "must be a positive integer", schedule_steps, func="ntkscope plan")
    total = schedule_steps if schedule_steps is not None else schedule_length(run_dir)
    if warmup_by == "schedule-fraction" and total is None:
        raise InputError("warmup_by", "'schedule-fraction' needs the run's schedule length: the run has neither "
                         "train_config.json steps nor trainer_state.json max_steps; give schedule_steps "
                         "(--schedule-steps)", warmup_by, func="ntkscope plan")
    last_path = list_checkpoints(run_dir)[-1][1]
    last_model, tok = load_model_and_tokenizer(last_path, sentences.tokenizer, data)
    ad = analysis_sentences(last_model, tok, data, sentences)
    seed = sentences.seed
    tail = long_tail_subset(ad.labels["score"], tail_fraction)
    labelled = ad.labels["label"].nunique() >= 2
    if tail_labels is None and labelled:
        counts = ad.labels["label"].value_counts()
        tail_labels = sorted(counts.index[counts.index != counts.idxmax()])
    if choose_by == "labels" and not labelled:
        raise InputError("choose_by", "'labels' needs data whose sentences carry two or more labels", choose_by,
                         func="ntkscope plan")
    routing = dict(point="attn_input" if module == "attn" else "ffn_input", router={"seed": seed, **(router or {})},
                   **({"domains": ad.labels["label"].astype(str).tolist(), "tail": list(tail_labels)} if labelled else {}))
    analyses = {"clusters": clusters_analysis(ad.batch, point=point, k_max=k_max, projection_dim=projection_dim,
                                              seed=seed),
                "gc": gc_analysis(ad.batch, tail, resampling=Resampling(seed=seed), options=kernel),
                "router": router_analysis(ad.batch, **routing)}  # every layer: one fit per checkpoint, shared
    checkpoints, found = walk(run_dir, analyses, cache_dir=cache_dir, models={last_path: last_model},
                              func="ntkscope plan")  # each checkpoint loaded once, for all three
    table, gc = clusters_table(found["clusters"]), gc_table(found["gc"])
    routers = router_table(checkpoints, found["router"])
    plan = make_plan(table, gc, top_k=top_k, module=module, overlap=overlap, choose_by=choose_by,
                     persistence=lambda layers: {k: v for k, v in persistence_tables(
                         checkpoints, found["router"], n=len(ad.labels)).items() if k in layers},
                     labels=(lambda layers: routers) if labelled else None,
                     stability=lambda layers: routers.query("layer in @layers"))
    steps = [step for step, _ in checkpoints]
    record = warmup_record(plan.convert_at, plan.warmup_rule, total)
    if warmup_by == "schedule-fraction":
        plan = dataclasses.replace(plan, convert_at=record["cross_validated"]["step"],
                                   warmup_rule="schedule-fraction")
    plan = dataclasses.replace(plan, evidence={**plan.evidence, "warmup_record": record})
    plan = dataclasses.replace(plan, source={
        **architecture(last_model), "family": family_of(last_model).name, "tokenizer": tok.name,
        "vocab_size": tok.vocab_size, **as_source(data).options(), "run": str(run_dir), "steps": steps,
        "sentences": sentences.n, "seq_len": sentences.seq_len, "options": _key_options(
            as_source(data), sentences, kernel, Resampling(seed=seed), point=point, k_max=k_max,
            projection_dim=projection_dim, top_k=top_k, module=module, tail_fraction=tail_fraction, overlap=overlap,
            router=router, choose_by=choose_by),
        "provenance": provenance(weights=dict(checkpoints), data_files=data_files(as_source(data)),
                                 tokenizer=tok.name)})
    plan.save(out)
    return {"separation": table, "gc": gc, "n_tail": len(tail), "plan": plan, "tail_labels": tail_labels}
