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
    print(f"trained a 2-layer GPT on {result.n_sentences} real sentences for {len(result.losses)} steps: "
          f"loss {result.losses[0]:.2f} -> {final:.2f} (perplexity {perplexity(final):.1f} per byte)")
    cols = ["by", "label", "n_subset", "mean_frequency_score", "score", "eigengap_subset", "method"]
    print("\ngradient consistency of each group against the whole analysis batch (n=%d):\n" % args.n)
    print(result.table[cols].rename(columns={"score": "GC", "n_subset": "n"}).to_string(
        index=False, float_format=lambda x: f"{x:.3f}"))
    print(f"\ndone in {result.seconds:.0f} s")
    if args.out:
        result.table.to_csv(args.out, index=False)
        print(f"wrote {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ntkscope", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"ntkscope {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train a small GPT on real text (stdlib docstrings + licence texts) and print GC per group",
        description="Example: ntkscope demo --steps 400 --n 128",
    )
    demo.add_argument("--steps", type=int, default=400, help="training steps before the analysis (default 400)")
    demo.add_argument("--n", type=int, default=128, help="sentences in the analysis batch (default 128)")
    demo.add_argument("--seed", type=int, default=0, help="seed for data sampling, init and training")
    demo.add_argument("--method", default="auto", choices=["auto", "exact", "matrix-free", "projected"],
                      help="how the NTK eigenvectors are found (default auto: exact when J fits in memory)")
    demo.add_argument("--out", help="also write the GC table to this CSV file")
    demo.set_defaults(run=_demo)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as err:  # user errors; anything else is a bug: keep its traceback
        print(f"ntkscope {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
