"""Every option of ``ntkscope gc``, ``plan`` and ``clusters``, and of cse-train's ``track:``
section, walked from the command line (or the config) to the object that uses it: each is set
to a value other than its default, the command's function is stopped where it would start work,
and the value is found in the options object it was handed. A new option without a row here
fails the coverage check."""

import pytest
import torch

from ntkscope.app import cli, commands

#: options that configure the command line itself, not the analysis
FRONT = {"-h", "--help", "--quiet", "-q"}


class Stop(BaseException):
    """Raised by the stand-in for the command's function: nothing runs past the hand-over."""


def _capture(monkeypatch, name: str) -> dict:
    seen = {}

    def stand_in(*args, **kwargs):
        seen.update(kwargs, args=args)
        raise Stop

    monkeypatch.setattr(commands, name, stand_in)
    return seen


def _options(command: str) -> set:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
    return {s for a in sub.choices[command]._actions for s in a.option_strings if s.startswith("--")} - FRONT


def _walk(monkeypatch, tmp_path, name: str, target, rows: dict) -> None:
    """``rows``: option -> (its argv values, a function of the captured hand-over giving the value, expected)."""
    for option, (values, found, expected) in rows.items():
        seen = _capture(monkeypatch, name)
        out = ["--out", str(tmp_path / ("o.json" if name == "plan_command" else "o.csv" if name == "clusters_command"
                                        else "o"))] if option != "--out" else []
        with pytest.raises(Stop):
            cli.main([*target, option, *values, *out])
        assert found(seen) == expected, option


def _sentences(field):
    return lambda seen: getattr(seen["sentences"], field)


def _kernel(field):
    return lambda seen: getattr(seen["kernel"], field)


def _checkpoint(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text("{}")
    return folder


def _run(tmp_path):
    folder = tmp_path / "run"
    (folder / "checkpoints" / "step-000010").mkdir(parents=True, exist_ok=True)
    return folder


COMMON = {  # the data and sentence options every analysis command shares
    "--data": (["rows.jsonl"], lambda s: str(s["args"][1].path.name), "rows.jsonl"),
    "--pack": (["rows.jsonl"], lambda s: str(s["args"][1].path.name), "rows.jsonl"),
    "--text-column": (["body"], lambda s: s["args"][1].text_column, "body"),
    "--label-column": (["topic"], lambda s: s["args"][1].label_column, "topic"),
    "--format": (["jsonl"], lambda s: s["args"][1].format, "jsonl"),
    "--frequency-from": (["rows.jsonl"], lambda s: str(s["args"][1].frequency_from), "rows.jsonl"),
    "--tokenizer": (["tok.json"], _sentences("tokenizer"), "tok.json"),
    "--n": (["17"], _sentences("n"), 17),
    "--seq-len": (["19"], _sentences("seq_len"), 19),
    "--seed": (["5"], _sentences("seed"), 5),
}


def _table(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "a b c", "label": "x", "body": "a", "topic": "y"}\n'
                    '{"text": "d e f", "label": "z", "body": "b", "topic": "w"}\n')
    return path


def test_every_gc_option_reaches_its_object(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    _table(tmp_path)
    kernel = {
        "--params": (["transformer.h.1.*"], lambda s: list(s["kernel"].params), ["transformer.h.1.*"]),
        "--output": (["true-logit"], _kernel("output"), "true-logit"),
        "--method": (["exact"], _kernel("method"), "exact"),
        "--dtype": (["float64"], lambda s: str(s["kernel"].dtype).removeprefix("torch."), "float64"),
        "--device": (["cpu"], lambda s: str(s["kernel"].device), "cpu"),
        "--max-memory": (["2"], _kernel("max_memory"), 2 * 2**30),
        "--out": (["out-dir"], lambda s: str(s["out"]), "out-dir"),
        "--resamples": (["31"], lambda s: s["resampling"].resamples, 31),
        "--null-draws": (["37"], lambda s: s["resampling"].null_draws, 37),
        "--confidence": (["0.8"], lambda s: s["resampling"].confidence, 0.8),
        "--interval": (["basic"], lambda s: s["resampling"].interval, "basic"),
        "--homogeneous-label": (["x"], lambda s: s["gc"].homogeneous_label, "x"),
    }
    one = {
        "--by": (["label"], lambda s: s["gc"].by, "label"),
        "--bins": (["3"], lambda s: s["gc"].bins, 3),
        "--binning": (["width"], lambda s: s["gc"].binning, "width"),
        "--min-count": (["2"], lambda s: s["gc"].min_count, 2),
        "--outputs": (["loss,true-logit"], lambda s: s["gc"].outputs, ("loss", "true-logit")),
        "--tokens": (["3"], lambda s: s["tokens"], 3),
    }
    run = {
        "--tail-fraction": (["0.2"], lambda s: s["gc"].tail_fraction, 0.2),
        "--cache-dir": (["cache"], lambda s: str(s["cache_dir"]), "cache"),
    }
    _walk(monkeypatch, tmp_path, "gc_command", ["gc", str(_checkpoint(tmp_path))], {**COMMON, **kernel, **one})
    _walk(monkeypatch, tmp_path, "gc_run_command", ["gc", str(_run(tmp_path))], {**COMMON, **kernel, **run})
    # the seed reaches the kernel (its projections) and the statistics too
    seen = _capture(monkeypatch, "gc_command")
    with pytest.raises(Stop):
        cli.main(["gc", str(_checkpoint(tmp_path)), "--seed", "9"])
    assert seen["kernel"].seed == seen["resampling"].seed == seen["sentences"].seed == 9
    assert _options("gc") == set(COMMON) | set(kernel) | set(one) | set(run)


ANALYSIS = {
    "--point": (["ffn_input"], lambda s: s["point"], "ffn_input"),
    "--k-max": (["5"], lambda s: s["k_max"], 5),
    "--projection-dim": (["12"], lambda s: s["projection_dim"], 12),
    "--top-k": (["3"], lambda s: s["top_k"], 3),
    "--cache-dir": (["cache"], lambda s: str(s["cache_dir"]), "cache"),
}


def test_every_plan_option_reaches_its_object(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    _table(tmp_path)
    own = {
        "--module": (["attn"], lambda s: s["module"], "attn"),
        "--tail-fraction": (["0.2"], lambda s: s["tail_fraction"], 0.2),
        "--output": (["true-logit"], _kernel("output"), "true-logit"),
        "--method": (["exact"], _kernel("method"), "exact"),
        "--overlap": (["0.7"], lambda s: s["overlap"], 0.7),
        "--choose-by": (["labels"], lambda s: s["choose_by"], "labels"),
        "--tail-labels": (["a,b"], lambda s: s["tail_labels"], ["a", "b"]),
        "--warmup-by": (["schedule-fraction"], lambda s: s["warmup_by"], "schedule-fraction"),
        "--schedule-steps": (["900"], lambda s: s["schedule_steps"], 900),
        "--out": (["p.json"], lambda s: str(s["out"]), "p.json"),
    }
    _walk(monkeypatch, tmp_path, "plan_command", ["plan", str(_run(tmp_path))], {**COMMON, **ANALYSIS, **own})
    seen = _capture(monkeypatch, "plan_command")
    with pytest.raises(Stop):
        cli.main(["plan", str(_run(tmp_path)), "--seed", "9"])
    assert seen["kernel"].seed == seen["sentences"].seed == 9  # --seed reaches the kernel of every GC call
    assert _options("plan") == set(COMMON) | set(ANALYSIS) | set(own)


def test_every_clusters_option_reaches_its_object(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    _table(tmp_path)
    own = {"--out": (["c.csv"], lambda s: str(s["out"]), "c.csv")}
    _walk(monkeypatch, tmp_path, "clusters_command", ["clusters", str(_checkpoint(tmp_path))],
          {**COMMON, **ANALYSIS, **own})
    assert _options("clusters") == set(COMMON) | set(ANALYSIS) | set(own)


def test_every_track_field_reaches_the_tracker(monkeypatch, tmp_path):
    """cse-train's ``track:`` section: each field, set away from its default, is what the
    GCTracker it builds holds (its probes, kernel options and statistics)."""
    import dataclasses

    import cse_models.train as train
    from cse_models.train_config import TrackConfig
    from ntkscope.gc.options import GCOptions
    from ntkscope.text.corpus.pack import load_pack

    defaults = TrackConfig()
    assert (defaults.tail_fraction, defaults.bins) == (GCOptions().tail_fraction, GCOptions().bins)  # declared once
    import json

    pack = load_pack()
    table = tmp_path / "probes.jsonl"  # track.data: the user's table, not the training pack
    rows = [r for r in pack.records("validation")]
    table.write_text("".join(json.dumps({"text": r.text, "label": r.domain}) + "\n"
                             for r in rows[:300] + [r for r in rows if r.domain == "legal"][:60]))
    given = dict(every=7, n=40, data=str(table), seq_len=24, seed=3, by="frequency-bins", tail_fraction=0.2,
                 bins=3, homogeneous="general", output="true-logit", method="exact", resamples=30, null_draws=40,
                 per_layer=True)
    assert set(given) == {f.name for f in dataclasses.fields(TrackConfig)}
    assert all(given[k] != getattr(defaults, k) for k in given)
    cfg = train.TrainConfig.from_dict({"out_dir": str(tmp_path / "run"), "data": {"seq_len": 32},
                                       "track": given})
    tracker = train._tracker(cfg, pack.tokenizer(), 1)
    probes = tracker.probes
    assert (tracker.every, tracker.per_layer) == (7, True)
    assert (tracker.options.output, tracker.options.method) == ("true-logit", "exact")
    assert (tracker.resampling.resamples, tracker.resampling.null_draws, tracker.resampling.seed) == (30, 40, 3)
    assert probes.n == 40 and probes.batch["input_ids"].shape[1] <= 24
    assert sorted(probes.groups) == ["bin 0", "bin 1", "bin 2"]
    assert probes.pools is not None  # the homogeneous label's sentences
    assert str(table) in probes.source
    other = train.TrainConfig.from_dict({"out_dir": str(tmp_path / "run1"), "data": {"seq_len": 32},
                                         "track": {**given, "seed": 4}})
    assert not torch.equal(train._tracker(other, pack.tokenizer(), 1).probes.batch["input_ids"],
                           probes.batch["input_ids"])  # the seed draws the probe sentences
    cfg_tail = train.TrainConfig.from_dict({"out_dir": str(tmp_path / "run2"), "data": {"seq_len": 32},
                                            "track": {**given, "by": "tail"}})
    tail = train._tracker(cfg_tail, pack.tokenizer(), 1).probes
    assert len(tail.groups["tail"]) == round(0.2 * 40)
