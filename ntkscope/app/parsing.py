"""What the command lines share: the ``--data`` help, the column flags, the data source they
name, and printing a table."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from ntkscope.core.checks import fail
from ntkscope.text.inputs import FORMATS, DataSource, as_source

DATA_HELP = ("a corpus pack directory, 'default' (the shipped pack), a table with a text column (.jsonl, .csv, .tsv, "
             ".parquet), a datasets save_to_disk directory, or a UTF-8 text file (a headerless .tsv: label<TAB>text)")


def _number(text: str, kind):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'} (got {text!r})") \
            from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number (got {text!r})")
    return value


def ranged(kind, low=None, high=None, *, open_low=False, open_high=False):
    """An argparse ``type`` that reads ``kind`` (int or float) in [low, high] (ends open as said), so
    an impossible value is a usage error (exit 2) before any work, naming the option and its range."""
    left, right = "(" if open_low else "[", ")" if open_high else "]"
    rule = (f"in {left}{low}, {high}{right}" if low is not None and high is not None else
            f"{'>' if open_low else '>='} {low}" if low is not None else f"{'<' if open_high else '<='} {high}")

    def parse(text: str):
        value = _number(text, kind)
        below = low is not None and (value <= low if open_low else value < low)
        above = high is not None and (value >= high if open_high else value > high)
        if below or above:
            raise argparse.ArgumentTypeError(f"must be {rule} (got {text!r})")
        return value

    parse.__name__ = f"{kind.__name__} {rule}"  # argparse names the type in its own messages
    return parse


POSITIVE_INT = ranged(int, 1)
COUNT = ranged(int, 0)                                  # 0 allowed: "none"
FRACTION = ranged(float, 0, 1, open_low=True, open_high=True)
POSITIVE = ranged(float, 0, open_low=True)


#: how a command's ``--out`` is held while it works: "dir" or "file" (the command line's one lock on
#: it, from before the work to the last write, and its kind checked), or "own" (the command locks
#: and stages it itself: compare, reproduce, experiment run and map)
OUT_KINDS = ("dir", "file", "own")


def add_out(parser, *, kind: str, **kwargs) -> None:
    """``--out`` on ``parser`` (``kwargs`` as ``add_argument``'s), declaring how it is held
    (:data:`OUT_KINDS`). Every command that writes to ``--out`` adds it this way."""
    if kind not in OUT_KINDS:
        raise fail("add_out", "kind", f"must be one of {list(OUT_KINDS)}", kind)
    parser.add_argument("--out", **kwargs)
    parser.set_defaults(out_kind=kind)


def add_column_args(parser) -> None:
    """``--text-column``, ``--label-column`` and ``--frequency-from``."""
    parser.add_argument("--text-column", default="text", help="a table's text column (default text)")
    parser.add_argument("--label-column", help="a table's label column (default: 'label' when there is one)")
    parser.add_argument("--frequency-from", help="other data whose token counts define sentence frequency, e.g. the "
                        "training set (default: a pack's train split, or the data itself)")
    parser.add_argument("--format", default="auto", choices=FORMATS,
                        help="the data file's format (default auto: by its suffix; a pipe such as "
                        "<(zcat rows.jsonl.gz) or a name without one is sniffed: JSON lines, a CSV/TSV header, "
                        "Parquet, gzip)")


def source(args) -> DataSource:
    """The data ``--data`` and the column flags name."""
    return as_source(DataSource(None if args.data in (None, "default") else Path(args.data), args.text_column,
                                args.label_column, args.frequency_from, args.format))


def print_table(title, frame, digits: int = 3):
    print(f"\n{title}\n")
    print(frame.to_string(index=False, float_format=lambda x: f"{x:.{digits}f}"))
