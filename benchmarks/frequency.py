"""Token counting and sentence scoring, against what a user would otherwise write.

Side by side in one process, over a corpus pack's train split (the full pack when it is
built, else the shipped small pack):

- ``ntkscope``        count_tokens: HF tokenizers' parallel batch encode + numpy.bincount;
                      sentence_table over every sentence of the pack
- ``python loop``     anchor: tokenizer.encode(text) per text into a collections.Counter,
                      then a per-sentence Python mean of phi
- ``gpt2 tiktoken``   count_tokens with GPT-2's BPE through tiktoken (when its ranks are fetched)

Target (issue 3): the full pack counts in well under a minute on 2 cores.

Run: python benchmarks/frequency.py [--pack DIR] [--out benchmarks/frequency.csv]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections import Counter

import numpy as np
import pandas as pd

from ntkscope.text.corpus.pack import load_pack
from ntkscope.text.corpus.sources import default_data_dir
from ntkscope.text.corpus.text import split_sentences
from ntkscope.text.frequency import count_tokens, sentence_table, token_frequency
from ntkscope.text.tokenization import load_tokenizer


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack", help="pack directory (default: packs/full if built, else the shipped pack)")
    parser.add_argument("--out", help="CSV for the results")
    args = parser.parse_args()
    pack = load_pack(args.pack)
    tokenizer = pack.tokenizer()
    texts = [r.text for r in pack.records("train")]
    n_chars = sum(map(len, texts))
    rows = []

    counts, t_fast = timed(lambda: count_tokens(texts, tokenizer))

    def loop():
        counter = Counter()
        for text in texts:
            counter.update(i for i in tokenizer.backend.encode(text, add_special_tokens=False).ids
                           if i not in tokenizer.special_ids)
        return counter

    counter, t_loop = timed(loop)
    assert {i: int(c) for i, c in enumerate(counts.counts) if c} == dict(counter)
    rows.append(("count tokens", "ntkscope", t_fast, counts.total))
    rows.append(("count tokens", "python loop", t_loop, sum(counter.values())))

    records = pack.records("all")
    table, t_table = timed(lambda: sentence_table(records, tokenizer, counts=counts))
    phi = token_frequency(counts)

    def loop_scores():
        out = []
        for r in records:
            for s in split_sentences(r.text):
                ids = [i for i in tokenizer.backend.encode(s, add_special_tokens=False).ids if i not in tokenizer.special_ids]
                if len(ids) >= 4:
                    out.append(float(np.mean(phi[ids])))
        return out

    scores, t_loop_scores = timed(loop_scores)
    np.testing.assert_allclose(table["score"].to_numpy(), scores, rtol=1e-12)
    rows.append(("score sentences", "ntkscope", t_table, len(table)))
    rows.append(("score sentences", "python loop", t_loop_scores, len(scores)))

    ranks = default_data_dir() / "gpt2.tiktoken"
    if ranks.is_file():
        gpt2 = load_tokenizer("gpt2")
        c2, t_gpt2 = timed(lambda: count_tokens(texts, gpt2))
        rows.append(("count tokens", "gpt2 tiktoken", t_gpt2, c2.total))

    frame = pd.DataFrame(rows, columns=["task", "how", "seconds", "items"])
    frame["× ntkscope"] = frame["seconds"] / frame.groupby("task")["seconds"].transform("first")
    print(f"pack {pack.path} ({len(texts)} train texts, {n_chars / 1e6:.1f} M characters); "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(frame.to_string(index=False, float_format=lambda x: f"{x:.2f}"))
    if args.out:
        frame.to_csv(args.out, index=False)


if __name__ == "__main__":
    main()
