"""Property test of the Python API's entry points (the library at the command line's
standard). Each function a user calls is given a wrong type or value for one of its main
arguments (None, a string where a tensor, a model or a table is expected, a float where an int
is, a negative count, NaN, a path that does not exist, a transformers tokenizer object where a
path is, a model where data is, ...). The outcome is a result, or a ValueError / TypeError in one
line that starts with the function's name (an InputError's names the argument and the value by
construction): never an AttributeError, KeyError, IndexError or any other exception from inside.
10 examples per function in CI; ``NTKSCOPE_PROPERTY_EXAMPLES=200`` locally."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ntkscope as ns
from cse_models import GPT, GPTConfig, load_any_model, load_model
from ntkscope.text.corpus.pack import DEFAULT_PACK, load_pack

transformers = pytest.importorskip("transformers")
EXAMPLES = int(os.environ.get("NTKSCOPE_PROPERTY_EXAMPLES", 10))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
TOKENIZER = DEFAULT_PACK / "tokenizer.json"


class World:
    """What the valid arguments are made of: a tiny GPT, the pack's tokenizer (ours and as a
    transformers object), 16 analysis sentences, their probes, a kernel, a missing path."""

    def __init__(self, root: Path):
        torch.manual_seed(0)
        self.model = GPT(GPTConfig(vocab_size=8192, block_size=16, n_layer=1, n_head=2, n_embd=8)).eval()
        self.tok = load_pack().tokenizer()
        self.hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER))
        self.data = ns.load_analysis_data("default", self.tok, n=16, seq_len=8, seed=0)
        self.batch = self.data.batch
        self.probes = ns.Probes.from_data(self.data, by="tail", min_count=2)
        self.kernel = np.eye(8) + 0.5
        self.counts = ns.count_tokens(["a few words of text", "and some more"], self.tok)
        self.missing = root / "no" / "such" / "path"
        self.resampling = ns.Resampling(resamples=4, null_draws=4)

    def bad(self) -> dict:
        """The wrong values, by name (one drawn per example)."""
        return {"None": None, "str": "text", "float": 2.5, "negative": -3, "zero": 0, "bool": True,
                "nan": float("nan"), "empty list": [], "dict": {}, "missing path": self.missing,
                "missing path str": str(self.missing), "hf tokenizer": self.hf_tok, "model": self.model,
                "float tensor": torch.rand(4, 5), "int list": [3, 1]}


def _calls(w: World) -> dict:
    """name -> (the names its message may start with, {argument: call with that argument replaced}).
    Besides the function itself, a message may name the function behind a thin wrapper (load_model
    is TransformerLM.from_pretrained), the reader of a data source ("analysis data", the prefix of
    every data-source message) or, for a tokenizer given as a path, load_tokenizer and its spec."""
    R, m, b, d = w.resampling, w.model, w.batch, w.data

    def gc(model=m, batch=b, subset=(0, 1, 2, 3), **kw):
        return ns.gradient_consistency(model, batch, subset, resampling=R, **kw)

    def groups(model=m, batch=b, labels=("a",) * 8 + ("b",) * 8, **kw):
        return ns.gradient_consistency_groups(model, batch, labels, resampling=R, **kw)

    def by_bins(model=m, data=d, **kw):
        kw.setdefault("gc", ns.GCOptions(bins=2, min_count=2))
        return ns.gc_by_group(model, data, resampling=R, controls=None, **kw)

    def data(data="default", tokenizer=w.tok, n=8, seq_len=8, **kw):
        return ns.load_analysis_data(data, tokenizer, n=n, seq_len=seq_len, **kw)

    def probes(data="default", tokenizer=w.tok, n=8, seq_len=8, **kw):
        return ns.Probes.load(data, tokenizer, n=n, seq_len=seq_len, **kw)

    def scores(texts=("a b", "c"), tokenizer=w.tok, frequency=None):
        return ns.sentence_scores(texts, tokenizer, ns.token_frequency(w.counts) if frequency is None else frequency)

    one = lambda call: lambda arg: lambda value: call(**{arg: value})  # noqa: E731
    table = {
        "gradient_consistency": (gc, ["model", "batch", "subset", "labels", "controls", "options", "method",
                                      "chunk_size", "dtype", "params"]),
        "gradient_consistency_groups": (groups, ["model", "batch", "labels", "min_count", "controls"]),
        "empirical_ntk": (lambda model=m, batch=b, **kw: ns.empirical_ntk(model, batch, **kw),
                          ["model", "batch", "batch2", "reduction", "options", "output", "projection_dim", "device",
                           "sample_loss"]),
        "per_sample_grads": (lambda model=m, batch=b, **kw: ns.per_sample_grads(model, batch, **kw),
                             ["model", "batch", "train", "max_memory"]),
        "kernel_gc": (lambda kernel=w.kernel, subsets=([0, 1, 2],), **kw: ns.kernel_gc(kernel, subsets, **kw),
                      ["kernel", "subsets", "resampling", "controls"]),
        "gc_by_group": (by_bins, ["model", "data", "gc", "homogeneous", "method"]),
        "gc_sensitivity": (lambda model=m, data=d, outputs=("loss",): ns.gc_sensitivity(
            model, data, outputs=outputs, gc=ns.GCOptions(bins=2, min_count=2), resampling=R, controls=None),
            ["model", "data", "outputs"]),
        "Probes.from_data": (lambda data=d, **kw: ns.Probes.from_data(data, **kw),
                             ["by", "tail_fraction", "bins", "binning", "min_count", "homogeneous"]),
        "Probes.load": (probes, ["data", "tokenizer", "n", "seq_len", "seed", "text_column", "label_column", "by"]),
        "GCTracker": (lambda probes=w.probes, **kw: ns.GCTracker(probes, **kw),
                      ["probes", "every", "options", "resampling", "controls"]),
        "DataSource": (lambda **kw: ns.DataSource(**kw), ["path", "text_column", "label_column", "frequency_from",
                                                          "format"]),
        "as_source": (lambda data="default", **kw: ns.as_source(data, **kw), ["data", "columns"]),
        "load_tokenizer": (lambda spec=TOKENIZER: ns.load_tokenizer(spec), ["spec"]),
        "count_tokens": (lambda texts=("a b",), tokenizer=w.tok, **kw: ns.count_tokens(texts, tokenizer, **kw),
                         ["texts", "tokenizer", "max_unknown"]),
        "token_frequency": (lambda counts=w.counts, normalisation="max": ns.token_frequency(counts, normalisation),
                            ["counts", "normalisation"]),
        "sentence_scores": (scores, ["texts", "tokenizer", "frequency"]),
        "load_analysis_data": (data, ["data", "tokenizer", "n", "seq_len", "seed", "split"]),
        "encode_texts": (lambda tokenizer=w.tok, texts=("a b",), max_length=8: ns.encode_texts(tokenizer, texts,
                                                                                               max_length),
                         ["tokenizer", "texts", "max_length"]),
        "score_histogram": (lambda scores=(0.1, 0.5, 0.9), **kw: ns.score_histogram(scores, **kw),
                            ["scores", "bins", "range", "kind"]),
        "long_tail_subset": (lambda scores=(0.1, 0.5, 0.9), fraction=0.3: ns.long_tail_subset(scores, fraction),
                             ["scores", "fraction"]),
        "sample_outputs": (lambda model=m, batch=b, **kw: ns.sample_outputs(model, batch, **kw),
                           ["model", "batch", "chunk_size"]),
        "load_checkpoint": (lambda path=w.missing: ns.load_checkpoint(path), ["path"]),
        "list_checkpoints": (lambda run_dir=w.missing: ns.list_checkpoints(run_dir), ["run_dir"]),
        "load_pack": (lambda path=None: ns.load_pack(path), ["path"]),
        "load_model": (lambda directory=w.missing: load_model(directory), ["directory"]),
        "load_any_model": (lambda directory=w.missing: load_any_model(directory), ["directory"]),
    }
    aliases = {"DataSource": ("analysis data",), "as_source": ("analysis data",),
               "Probes.load": ("analysis data", "load_tokenizer"),
               "load_analysis_data": ("analysis data", "load_tokenizer"),
               "encode_texts": ("load_tokenizer",), "count_tokens": ("load_tokenizer",),
               "sentence_scores": ("load_tokenizer",),
               "load_model": ("TransformerLM.from_pretrained",),
               "load_any_model": ("TransformerLM.from_pretrained", "load_hf")}
    return {name: ((name, *aliases.get(name, ())), {arg: one(call)(arg) for arg in args})
            for name, (call, args) in table.items()}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    yield World(tmp_path_factory.mktemp("api"))
    torch.set_default_dtype(previous)


@pytest.fixture(scope="module")
def calls(world):
    return _calls(world)


FUNCTIONS = ["gradient_consistency", "gradient_consistency_groups", "empirical_ntk", "per_sample_grads", "kernel_gc",
             "gc_by_group", "gc_sensitivity", "Probes.from_data", "Probes.load", "GCTracker", "DataSource",
             "as_source", "load_tokenizer", "count_tokens", "token_frequency", "sentence_scores",
             "load_analysis_data", "encode_texts", "score_histogram", "long_tail_subset", "sample_outputs",
             "load_checkpoint", "list_checkpoints", "load_pack", "load_model", "load_any_model"]


@pytest.mark.parametrize("name", FUNCTIONS)
@SETTINGS
@given(data=st.data())
def test_a_wrong_argument_is_a_result_or_one_line_naming_the_function(world, calls, tmp_path, monkeypatch, name,
                                                                     data):
    monkeypatch.chdir(tmp_path)  # a path-like string a function writes to lands here
    names, by_arg = calls[name]
    arg = data.draw(st.sampled_from(sorted(by_arg)), label="argument")
    label = data.draw(st.sampled_from(sorted(world.bad())), label="value")
    value = world.bad()[label]
    try:
        by_arg[arg](value)
    except (ValueError, TypeError) as err:
        text = str(err)
        assert "\n" not in text, f"{name}({arg}={label}): {text}"
        assert text.split(":")[0] in names, f"{name}({arg}={label}) does not name the function: {text}"
    # anything else (AttributeError, KeyError, IndexError, RuntimeError, ...) fails the test as it is


#: entry points in ntkscope/gc/tracker.py that once let these through (an AttributeError or a bare
#: TypeError from inside)
TRACKER_CASES = {
    "Probes.from_data(data=None)": lambda w: ns.Probes.from_data(None),
    "Probes.from_data(data=a path)": lambda w: ns.Probes.from_data(w.missing),
    "Probes.from_data(data=a batch)": lambda w: ns.Probes.from_data(w.batch),
    "GCTracker(out=2.5)": lambda w: ns.GCTracker(w.probes, out=2.5),
    "GCTracker(per_layer=a tensor)": lambda w: ns.GCTracker(w.probes, per_layer=torch.ones(3)),
    "GCTracker(controls=an array)": lambda w: ns.GCTracker(w.probes, controls=np.ones(3)),
    "Probes.from_data(gc=a dict)": lambda w: ns.Probes.from_data(w.data, gc={"bins": 3}),
    "Probes.from_data(bins= beside gc=)": lambda w: ns.Probes.from_data(w.data, gc=ns.GCOptions(bins=3), bins=4),
}


@pytest.mark.parametrize("case", sorted(TRACKER_CASES))
def test_the_tracker_refuses_a_wrong_argument_in_one_line(world, case):
    with pytest.raises(ValueError, match=r"^(Probes\.from_data|GCTracker): [^\n]*$"):
        TRACKER_CASES[case](world)
