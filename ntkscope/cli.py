"""The ``ntkscope`` command. The library computes; this module presents.

Exit codes: 0 success, 1 a user error (one clear line on stderr), 2 usage.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ntkscope import __version__


def _demo(args) -> int:
    from ntkscope.demo import perplexity, run_demo

    result = run_demo(steps=args.steps, n=args.n, seed=args.seed, method=args.method)
    final = sum(result.losses[-20:]) / min(20, len(result.losses))
    print(f"trained a 2-layer GPT on {result.n_sentences} sentences of the default corpus pack for "
          f"{len(result.losses)} steps: loss {result.losses[0]:.2f} -> {final:.2f} "
          f"(perplexity {perplexity(final):.1f} per BPE token)")
    cols = ["by", "label", "n_subset", "mean_frequency_score", "score", "eigengap_subset", "method"]
    print("\ngradient consistency of each group against the whole analysis batch (n=%d):\n" % args.n)
    print(result.table[cols].rename(columns={"score": "GC", "n_subset": "n"}).to_string(
        index=False, float_format=lambda x: f"{x:.3f}"))
    print(f"\ndone in {result.seconds:.0f} s")
    if args.out:
        result.table.to_csv(args.out, index=False)
        print(f"wrote {args.out}")
    return 0


def _corpus_sources(args) -> int:
    from ntkscope.corpus.sources import SOURCES, SourceMissingError

    for name, source in SOURCES.items():
        try:
            where = str(source.locate(args.root, args.data_dir))
        except SourceMissingError:
            where = f"missing: {source.install}"
        print(f"{name:12s} {source.domain:10s} {where}")
    return 0


def _corpus_build(args) -> int:
    from ntkscope.corpus.pack import build_pack, load_pack

    out = build_pack(args.out, sources=args.sources, share=args.share, max_tokens=args.max_tokens, seed=args.seed,
                     vocab_size=args.vocab_size, root=args.root, data_dir=args.data_dir, overwrite=args.force)
    m = load_pack(out).manifest
    print(f"wrote {out} (version {m['version']}): "
          + ", ".join(f"{s} {v['records']} records / {v['tokens']} tokens" for s, v in m["splits"].items()))
    print(f"long-tail share: asked {m['share_asked']:.2%}, measured {m['share_measured']:.2%} "
          f"({m['share_measured_bpe']:.2%} of BPE tokens)")
    return 0


def _corpus_info(args) -> int:
    from pathlib import Path

    from ntkscope.corpus.pack import load_pack
    from ntkscope.frequency import count_tokens, domain_table, save_table, score_histogram, sentence_table
    from ntkscope.tokenization import load_tokenizer

    pack = load_pack(args.pack)
    m = pack.manifest
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else pack.tokenizer()
    train = pack.records("train")
    counts = count_tokens(train, tokenizer)
    sentences = sentence_table(pack.records("all"), tokenizer, counts=counts, normalisation=args.normalisation)
    domains = domain_table(pack.records("all"), top=args.top)
    hist = score_histogram(sentences["score"], bins=args.bins, range=(0.0, float(sentences["score"].max())))
    print(f"pack {pack.path} version {m['version']}, seed {m['seed']}: long-tail share {m['share_measured']:.2%} "
          f"(asked {m['share_asked']:.2%})")
    print(f"\nthe {args.top} largest categories (tokens = regex words):\n")
    print(domains.to_string(index=False, float_format=lambda x: f"{x:.2f}"))
    print(f"\nsentence frequency score ({args.normalisation}, tokenizer {tokenizer.name}, counts over train):\n")
    print(sentences.groupby("domain")["score"].describe()[["count", "25%", "50%", "75%"]]
          .rename(columns={"50%": "median"}).to_string(float_format=lambda x: f"{x:.3f}"))
    print("\npercentage of sentences per score bin:\n")
    print(hist.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for name, frame in [("domain_table.csv", domain_table(pack.records("all"), top=None)),
                            ("score_histogram.csv", hist), ("sentence_scores.parquet", sentences),
                            ("token_counts.parquet", counts.to_frame(tokenizer))]:
            save_table(frame, out / name)
        print(f"\nwrote the tables to {out}/")
    return 0


def _add_source_args(parser) -> None:
    parser.add_argument("--root", default="/", help="file-system root of the system packages (default /)")
    parser.add_argument("--data-dir", help="downloaded sources (default $NTKSCOPE_SOURCES or ~/.cache/ntkscope/sources)")


def _add_corpus(sub) -> None:
    corpus = sub.add_parser("corpus", help="list sources, build a corpus pack, show a pack's tables")
    csub = corpus.add_subparsers(dest="corpus_command", required=True)
    sources = csub.add_parser("sources", help="which text sources are installed, and how to install the others")
    _add_source_args(sources)
    sources.set_defaults(run=_corpus_sources)
    build = csub.add_parser("build", help="build a pack from the installed sources",
                            description="Example: ntkscope corpus build packs/full --share 0.07")
    build.add_argument("out", help="directory to create")
    build.add_argument("--sources", nargs="+", help="source names (default: all)")
    build.add_argument("--share", type=float, default=0.07, help="legal + biomedical share of tokens (default 0.07)")
    build.add_argument("--max-tokens", type=int, help="total tokens (default: as many as the sources allow)")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--vocab-size", type=int, default=8192, help="of the BPE trained on train (default 8192)")
    build.add_argument("--force", action="store_true", help="replace OUT if it exists")
    _add_source_args(build)
    build.set_defaults(run=_corpus_build)
    info = csub.add_parser("info", help="domain sizes and sentence frequency scores of a pack")
    info.add_argument("pack", nargs="?", help="pack directory (default: the small pack shipped with ntkscope)")
    info.add_argument("--tokenizer", help="tokenizer.json, HF directory, .tiktoken file or 'gpt2' (default: the pack's BPE)")
    info.add_argument("--normalisation", default="max", choices=["max", "log", "prob", "rank"])
    info.add_argument("--bins", type=int, default=10)
    info.add_argument("--top", type=int, default=20, help="rows of the domain table (default 20)")
    info.add_argument("--out", help="directory for the tables (CSV and parquet)")
    info.set_defaults(run=_corpus_info)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ntkscope", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"ntkscope {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train a small GPT on the default corpus pack and print GC per domain and frequency bin",
        description="Example: ntkscope demo --steps 800 --n 128",
    )
    demo.add_argument("--steps", type=int, default=800, help="training steps before the analysis (default 800)")
    demo.add_argument("--n", type=int, default=128, help="sentences in the analysis batch (default 128)")
    demo.add_argument("--seed", type=int, default=0, help="seed for data sampling, init and training")
    demo.add_argument("--method", default="auto", choices=["auto", "exact", "matrix-free", "projected"],
                      help="how the NTK eigenvectors are found (default auto: exact when J fits in memory)")
    demo.add_argument("--out", help="also write the GC table to this CSV file")
    demo.set_defaults(run=_demo)
    _add_corpus(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, FileExistsError, ImportError) as err:  # user errors; anything else is a bug: keep its traceback
        print(f"ntkscope {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
