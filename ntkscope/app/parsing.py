"""What the command lines share: the ``--data`` help, the column flags, the data source they
name, and printing a table."""

from __future__ import annotations

from pathlib import Path

from ntkscope.text.inputs import DataSource, as_source

DATA_HELP = ("a corpus pack directory, 'default' (the shipped pack), a table with a text column (.jsonl, .csv, .tsv, "
             ".parquet), a datasets save_to_disk directory, or a UTF-8 text file (a headerless .tsv: label<TAB>text)")


def add_column_args(parser) -> None:
    """``--text-column``, ``--label-column`` and ``--frequency-from``."""
    parser.add_argument("--text-column", default="text", help="a table's text column (default text)")
    parser.add_argument("--label-column", help="a table's label column (default: 'label' when there is one)")
    parser.add_argument("--frequency-from", help="other data whose token counts define sentence frequency, e.g. the "
                        "training set (default: a pack's train split, or the data itself)")


def source(args) -> DataSource:
    """The data ``--data`` and the column flags name."""
    return as_source(DataSource(None if args.data in (None, "default") else Path(args.data), args.text_column,
                                args.label_column, args.frequency_from))


def print_table(title, frame, digits: int = 3):
    print(f"\n{title}\n")
    print(frame.to_string(index=False, float_format=lambda x: f"{x:.{digits}f}"))
