"""The ``ntkscope corpus`` commands: which text sources are installed, building a corpus pack,
and a pack's tables (:mod:`ntkscope.app.cli` adds them to the command line)."""

from __future__ import annotations

from ntkscope.app import commands
from ntkscope.app.parsing import add_out, print_table
from ntkscope.text.corpus.pack import build_pack, load_pack
from ntkscope.text.corpus.sources import SOURCES, SourceMissingError
from ntkscope.text.corpus.table_pack import table_pack
from ntkscope.text.corpus.grow import grow_pack
from ntkscope.text.corpus.thin import thin_pack
from ntkscope.text.frequency import NORMALISATIONS


def _corpus_sources(args) -> int:
    for name, source in SOURCES.items():
        try:
            where = str(source.locate(args.root, args.data_dir))
        except SourceMissingError:
            where = f"missing: {source.install}"
        print(f"{name:12s} {source.domain:10s} {where}")
    return 0


def _corpus_build(args) -> int:
    out = build_pack(args.out, sources=args.sources, share=args.share, max_tokens=args.max_tokens, seed=args.seed,
                     vocab_size=args.vocab_size, root=args.root, data_dir=args.data_dir, overwrite=args.force)
    m = load_pack(out).manifest
    print(f"wrote {out} (version {m['version']}): "
          + ", ".join(f"{s} {v['records']} records / {v['tokens']} tokens" for s, v in m["splits"].items()))
    print(f"long-tail share: asked {m['share_asked']:.2%}, measured {m['share_measured']:.2%} "
          f"({m['share_measured_bpe']:.2%} of BPE tokens)")
    return 0


def _corpus_from_table(args) -> int:
    out = table_pack(args.out, args.table, text_column=args.text_column, label_column=args.label_column,
                     tail=args.tail.split(",") if args.tail else None, validation=args.validation, test=args.test,
                     vocab_size=args.vocab_size, seed=args.seed, tokenizer=args.tokenizer, overwrite=args.force)
    m = load_pack(out).manifest
    print(f"wrote {out} (version {m['version']}): {m['table']['rows_kept']} rows of {args.table}; domains "
          f"{sorted(m['domains'])}, the long tail {m['tail']} ({100 * m['share_measured']:.1f} % of the words); "
          + ", ".join(f"{s} {m['splits'][s]['records']}" for s in ("train", "validation", "test")) + " rows")
    return 0


def _corpus_thin(args) -> int:
    keep = {}
    for item in args.keep:
        domain, _, share = item.partition("=")
        try:
            keep[domain] = float(share)
        except ValueError:
            raise SystemExit(f"ntkscope corpus thin: --keep takes DOMAIN=SHARE items (got {item!r})") from None
    out = thin_pack(args.out, keep, pack=args.pack, seed=args.seed, overwrite=args.force)
    m = load_pack(out).manifest
    print(f"wrote {out} (version {m['version']}): train keeps {keep} of those domains' records; long-tail share "
          f"of train {m['share_measured_train']:.2%}")
    return 0


def _corpus_grow(args) -> int:
    out = grow_pack(args.out, train_tokens=args.train_tokens, pack=args.pack, share=args.share, seed=args.seed,
                    sources=args.sources, root=args.root, data_dir=args.data_dir, overwrite=args.force)
    m = load_pack(out).manifest
    train = m["splits"]["train"]
    print(f"wrote {out} (version {m['version']}): train {train['records']} records, {train['tokens']} words, "
          f"{train['bpe_tokens']} BPE tokens, long-tail share {m['share_measured_train_bpe']:.2%} of the BPE tokens; "
          f"validation, test, probes and tokenizer those of {m['derived_from']['version']}")
    return 0


def _corpus_info(args) -> int:
    r = commands.corpus_info(args.pack, tokenizer=args.tokenizer, normalisation=args.normalisation, bins=args.bins,
                             top=args.top, out=args.out)
    m = r["pack"].manifest
    print(f"pack {r['pack'].path} version {m['version']}, seed {m['seed']}: long-tail share "
          f"{m['share_measured']:.2%} (asked {m['share_asked']:.2%})")
    print_table(f"the {args.top} largest categories (tokens = regex words):", r["domains"], 2)
    print(f"\nsentence frequency score ({args.normalisation}, tokenizer {r['tokenizer'].name}, counts over train):\n")
    print(r["sentences"].groupby("domain")["score"].describe()[["count", "25%", "50%", "75%"]]
          .rename(columns={"50%": "median"}).to_string(float_format=lambda x: f"{x:.3f}"))
    print_table("percentage of sentences per score bin:", r["histogram"])
    if args.out:
        print(f"\nwrote the tables to {args.out}/")
    return 0


def _add_source_args(parser) -> None:
    parser.add_argument("--root", default="/", help="file-system root of the system packages (default /)")
    parser.add_argument("--data-dir", help="downloaded sources (default $NTKSCOPE_SOURCES or ~/.cache/ntkscope/sources)")


def add_parsers(sub) -> None:
    """``ntkscope corpus sources|build|from-table|thin|grow|info``."""
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
    thin = csub.add_parser("thin", help="a second mix: a pack with some domains' training records thinned")
    thin.add_argument("out", help="directory to create")
    thin.add_argument("--keep", nargs="+", required=True, metavar="DOMAIN=SHARE",
                      help="the share of each domain's training records kept, e.g. legal=0.5 biomedical=0.5")
    thin.add_argument("--pack", help="the pack to thin (default: the small pack shipped with ntkscope)")
    thin.add_argument("--seed", type=int, default=0)
    thin.add_argument("--force", action="store_true", help="replace OUT if it exists")
    thin.set_defaults(run=_corpus_thin)
    grow = csub.add_parser("grow", help="a larger pack: more training text from the installed sources, the pack's "
                           "validation, test, probes and tokenizer as they are",
                           description="Example: ntkscope corpus grow packs/grown --train-tokens 9000000")
    grow.add_argument("out", help="directory to create")
    grow.add_argument("--train-tokens", type=int, required=True,
                      help="training words wanted (the pack's word unit; the card gives the BPE tokens)")
    grow.add_argument("--pack", help="the pack to grow (default: the small pack shipped with ntkscope)")
    grow.add_argument("--share", type=float, help="legal + biomedical share of the training words "
                      "(default: the pack's measured share)")
    grow.add_argument("--sources", nargs="+", help="source names (default: the pack's)")
    grow.add_argument("--seed", type=int, default=0)
    grow.add_argument("--force", action="store_true", help="replace OUT if it exists")
    _add_source_args(grow)
    grow.set_defaults(run=_corpus_grow)
    own = csub.add_parser("from-table", help="a pack of your own table's rows (a text and a label column): "
                          "every command and experiment that reads a pack reads it",
                          description="Example: ntkscope corpus from-table packs/mine rows.jsonl --label-column "
                          "domain --tail licence")
    own.add_argument("out", help="directory to create")
    own.add_argument("table", help="a .jsonl, .csv, .tsv or .parquet table")
    own.add_argument("--text-column", default="text")
    own.add_argument("--label-column", default="label", help="the domains (default label)")
    own.add_argument("--tail", help="comma-separated labels of the long tail (default: every label but the one "
                     "with the most words)")
    own.add_argument("--validation", type=float, default=0.1, help="share of the rows held out for validation")
    own.add_argument("--test", type=float, default=0.1, help="share of the rows held out for testing")
    own.add_argument("--vocab-size", type=int, default=8192, help="of the BPE trained on the train split")
    own.add_argument("--tokenizer", help="your model's tokenizer.json (or its HF directory): the pack's tokenizer as "
                     "it is, instead of a BPE trained here")
    own.add_argument("--seed", type=int, default=0, help="fixes the split")
    own.add_argument("--force", action="store_true", help="replace OUT if it exists")
    own.set_defaults(run=_corpus_from_table)
    info = csub.add_parser("info", help="domain sizes and sentence frequency scores of a pack")
    info.add_argument("pack", nargs="?", help="pack directory (default: the small pack shipped with ntkscope)")
    info.add_argument("--tokenizer", help="tokenizer.json, HF directory, .tiktoken file or 'gpt2' (default: the pack's BPE)")
    info.add_argument("--normalisation", default="max", choices=NORMALISATIONS)
    info.add_argument("--bins", type=int, default=10)
    info.add_argument("--top", type=int, default=20, help="rows of the domain table (default 20)")
    add_out(info, kind="dir", help="directory for the tables (CSV and parquet)")
    info.set_defaults(run=_corpus_info)
