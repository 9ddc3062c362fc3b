"""--data in the formats researchers hold: JSON lines, CSV, TSV, Parquet and a datasets
save_to_disk directory give the same sentences, labels, scores and batch as the pack
path on the same text; the commands take them; a bad file is one clear line."""

import gzip
import json

import numpy as np
import pandas as pd
import pytest
import torch

import ntkscope as ns
from ntkscope.app.cli import main
from ntkscope.text.corpus.pack import DEFAULT_PACK
from ntkscope.text.inputs import DataSource, as_source
from ntkscope.text.sentences import load_analysis_data

TOKENIZER = str(DEFAULT_PACK / "tokenizer.json")


@pytest.fixture(scope="module")
def rows():
    """The pack path's rows: its validation sentences, labelled by domain."""
    return pd.DataFrame(DataSource().rows("validation"), columns=["sentence", "domain"])


def write(frame: pd.DataFrame, path):
    """``frame`` in the format ``path`` names, with each format's own writer."""
    name = path.name
    if name.endswith(".jsonl.gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in frame.to_dict("records"))
    elif name.endswith(".jsonl"):
        frame.to_json(path, orient="records", lines=True, force_ascii=False)
    elif name.endswith(".csv"):
        frame.to_csv(path, index=False)
    elif name.endswith(".tsv"):
        frame.to_csv(path, sep="\t", index=False)
    elif name.endswith(".parquet"):
        frame.to_parquet(path)
    else:
        datasets = pytest.importorskip("datasets")
        datasets.Dataset.from_pandas(frame, preserve_index=False).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.jsonl.gz", "rows.csv", "rows.tsv", "rows.parquet", "rows-ds"])
def test_each_format_reads_back_the_pack_paths_rows(rows, name, tmp_path):
    path = write(rows, tmp_path / name)
    source = as_source(DataSource(path, text_column="sentence", label_column="domain"))
    assert source.kind == ("datasets" if name == "rows-ds" else "table")
    assert source.rows() == list(rows.itertuples(index=False, name=None))  # every row, in order


def test_a_table_gives_the_pack_paths_sentences_scores_and_batch(rows, tmp_path):
    tok = ns.load_tokenizer(TOKENIZER)
    expected = load_analysis_data("default", tok, n=48, seq_len=24, seed=3)
    path = write(rows, tmp_path / "rows.parquet")
    got = load_analysis_data(DataSource(path, text_column="sentence", label_column="domain",
                                        frequency_from=str(DEFAULT_PACK)), tok, n=48, seq_len=24, seed=3)
    pd.testing.assert_frame_equal(got.labels, expected.labels)
    for key in ("input_ids", "attention_mask"):
        assert torch.equal(got.batch[key], expected.batch[key])
    # no frequency_from: counts over the file itself; no label column: label "text"
    own = load_analysis_data(DataSource(path, text_column="sentence"), tok, n=48, seq_len=24, seed=3)
    assert set(own.labels["label"]) == {"text"} and list(own.labels["text"]) == list(expected.labels["text"])
    assert not np.allclose(own.labels["score"], expected.labels["score"])


def test_a_label_column_is_found_and_a_headerless_tsv_is_label_tab_text(tmp_path):
    texts = ["The first sentence is here.", "A second one follows it.", "And a third."]
    write(pd.DataFrame({"text": texts, "label": ["a", "b", "a"], "id": [1, 2, 3]}), tmp_path / "t.parquet")
    assert as_source(tmp_path / "t.parquet").rows() == list(zip(texts, ["a", "b", "a"]))
    (tmp_path / "old.tsv").write_text("a\tThe first sentence is here.\nb\tA second one follows it.\n")
    assert as_source(tmp_path / "old.tsv").kind == "text"
    assert as_source(tmp_path / "old.tsv").rows() == [(texts[0], "a"), (texts[1], "b")]


def test_commands_take_a_table(rows, tmp_path):
    from cse_models import GPT, GPTConfig

    torch.manual_seed(0)
    GPT(GPTConfig(vocab_size=8192, block_size=32, n_layer=2, n_head=2, n_embd=16)).save_pretrained(tmp_path / "gpt")
    (tmp_path / "gpt" / "tokenizer.json").write_bytes((DEFAULT_PACK / "tokenizer.json").read_bytes())
    data = write(rows.rename(columns={"sentence": "text", "domain": "topic"}), tmp_path / "rows.jsonl")
    out = tmp_path / "gc"
    assert main(["-q", "gc", str(tmp_path / "gpt"), "--data", str(data), "--label-column", "topic", "--by", "label",
                 "--n", "40", "--seq-len", "16", "--min-count", "3", "--resamples", "50", "--null-draws", "20",
                 "--out", str(out)]) == 0
    labels = set(pd.read_csv(out / "gc.csv")["label"])
    assert labels and labels <= set(rows["domain"])
    assert json.loads((out / "result.json").read_text())["options"]["label_column"] == "topic"
    assert main(["-q", "freq", str(data), "--tokenizer", TOKENIZER, "--frequency-from", str(DEFAULT_PACK),
                 "--out", str(tmp_path / "freq")]) == 0
    assert len(pd.read_parquet(tmp_path / "freq" / "sentence_scores.parquet")) > 100


BAD = {
    "missing column": ("x.jsonl", '{"body": "some text"}\n', [], "text_column must name a column of"),
    "missing label column": ("x.csv", "text\nsome text here\n", ["--label-column", "topic"],
                             "label_column must name a column of"),
    "wrong type": ("x.jsonl", '{"text": "fine"}\n{"text": 5}\n', [], "column 'text' must hold text; row 2 holds int '5' "
                   "(1 such rows in all)"),
    "empty file": ("x.csv", "", [], "is empty"),
    "header only": ("x.csv", "text,label\n", [], "has no rows"),
    "malformed line": ("x.jsonl", '{"text": "fine"}\n{"text": oops}\n', [], "line 2 is not JSON"),
    "no text at all": ("x.jsonl", '{"text": ""}\n{"text": null}\n', [], "has no non-empty text"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_file_is_one_clear_line(case, tmp_path, capsys):
    name, content, extra, message = BAD[case]
    (tmp_path / name).write_text(content)
    assert main(["-q", "freq", str(tmp_path / name), "--tokenizer", TOKENIZER, *extra]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and str(tmp_path / name) in err, err


def test_a_dataset_dict_names_its_splits(rows, tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    frame = rows.rename(columns={"sentence": "text"}).head(50)
    datasets.DatasetDict({"train": datasets.Dataset.from_pandas(frame), "validation": datasets.Dataset.from_pandas(
        frame.head(10))}).save_to_disk(str(tmp_path / "dd"))
    assert main(["-q", "freq", str(tmp_path / "dd"), "--tokenizer", TOKENIZER]) == 1
    assert f"is a datasets DatasetDict; name one split's directory ({tmp_path / 'dd' / 'train'}" in \
        capsys.readouterr().err
    assert len(as_source(tmp_path / "dd" / "validation").rows()) == 10


def test_a_pipe_is_read_once(tmp_path):
    """A FIFO (or --data <(zcat ...)) works; it was opened twice and hung."""
    import os
    import subprocess
    import sys
    import threading

    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    rows = [{"text": f"Sentence number {i} about the court and the patient, with enough words.", "label": "a"}
            for i in range(20)]

    def write():
        with open(fifo, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    proc = subprocess.run([sys.executable, "-m", "ntkscope", "-q", "freq", str(fifo), "--tokenizer", str(DEFAULT_PACK),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)  # hung before
    writer.join(timeout=5)
    assert proc.returncode == 0, proc.stderr
    assert len(pd.read_parquet(tmp_path / "out" / "sentence_scores.parquet")) == 20


def test_gzip_text_and_damaged_gzip_files(tmp_path):
    """A .txt.gz is read decompressed; a truncated .gz is one line."""
    import gzip

    from ntkscope.text.inputs import DataSource, as_source

    text = "The court held that the contract was void for lack of consideration.\n" \
           "The patient presented with fever and a persistent cough for three days.\n"
    (tmp_path / "t.txt.gz").write_bytes(gzip.compress(text.encode()))
    assert [t for t, _ in as_source(tmp_path / "t.txt.gz").rows()] == [line for line in text.splitlines()]
    rows = "".join(json.dumps({"text": f"Row {i} of a table about the court and its rulings."}) + "\n" for i in range(40))
    whole = gzip.compress(rows.encode())
    for name, data in (("cut.txt.gz", gzip.compress(text.encode())[:20]), ("cut.jsonl.gz", whole[: len(whole) // 2])):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=r"is a truncated or damaged gzip file"):
            as_source(tmp_path / name).rows()
    assert DataSource(str(tmp_path / "t.txt.gz")).kind == "text"  # a str path, as a user writes it


def test_encode_refuses_a_single_string():
    from ntkscope.text.corpus.pack import load_pack

    tok = load_pack().tokenizer()
    with pytest.raises(ValueError, match=r"TextTokenizer.encode: texts must be a sequence of strings"):
        tok.encode("a string")
    assert tok.encode(["a string"]) == [tok.encode(["a string"])[0]]


def test_lines_of_a_text_file_are_rows_and_freq_scores_what_gc_analyses(tmp_path):
    """Three unpunctuated lines were one row; a 40-line CJK/emoji file was one
    sentence; freq split a table's rows into sentences while gc analysed them whole."""
    from ntkscope.app import commands
    from ntkscope.text.inputs import as_source

    (tmp_path / "lines.txt").write_text("the court held the contract void\nthe patient had a fever\n"
                                        "a cat sat on the mat\n")
    assert [t for t, _ in as_source(tmp_path / "lines.txt").rows()] == [
        "the court held the contract void", "the patient had a fever", "a cat sat on the mat"]
    (tmp_path / "cjk.txt").write_text("".join(f"法院认为合同无效 第{i}行 🙂\n" for i in range(40)))
    assert len(as_source(tmp_path / "cjk.txt").rows()) == 40
    rows = [{"text": "The court held the contract void. The appeal was dismissed with costs.", "label": "legal"},
            {"text": "The patient had a high fever and a cough. She recovered within a week.", "label": "bio"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = commands.freq_command(tmp_path / "rows.jsonl", tokenizer=TOKENIZER)["sentences"]
    assert sorted(table["text"]) == sorted(r["text"] for r in rows)  # whole rows, as gc sees them


def test_a_symlink_loop_is_named_as_one(tmp_path):
    """A symlink loop was reported as 'does not exist'."""
    import os

    from ntkscope.runs.checkpoints import load_checkpoint
    from ntkscope.text.inputs import as_source

    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    with pytest.raises(FileNotFoundError, match="is a symbolic link to nothing, or a loop of links"):
        as_source(tmp_path / "a")
    with pytest.raises(FileNotFoundError, match="is a symbolic link to nothing, or a loop of links"):
        load_checkpoint(tmp_path / "a")
