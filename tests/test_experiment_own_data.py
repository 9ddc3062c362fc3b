"""Experiments over the researcher's own data: a spec whose [data] names their JSONL table, and
one whose trunk is their Hugging Face model; each section checked whole."""

import json
import shutil
from pathlib import Path

import pytest

from experiment_toy import TOY, toy_file
from ntkscope.core.checks import UserError
from ntkscope.experiments import load_spec, run_experiment, units
from ntkscope.experiments.spec import SpecError


# ---- a spec over the researcher's own table -----------------------------------------------------

def _own_rows(path: Path, extra: int = 0) -> None:
    """A JSONL of two labels (prose, and licences as its long tail) from the shipped pack's text."""
    from ntkscope.text.corpus.pack import load_pack

    records = load_pack().records("train")
    rows = [{"text": r.text, "domain": "prose"} for r in records if r.domain == "general"][:400 + extra]
    rows += [{"text": r.text, "domain": "licence"} for r in records if r.domain == "legal"][:120]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_spec_over_the_researchers_own_table_runs_and_follows_its_changes(tmp_path):
    """[data] names a JSONL (relative to the spec): the runner builds RUN/pack from it, every unit
    evaluates the table's own domains, the tables judge its tail; the pack is not built again for
    the same table, and a changed table is another pack, whose units have other keys (they run
    again)."""
    import tomli_w

    from ntkscope.experiments.runner import spec_pack
    from ntkscope.text.corpus.pack import load_pack

    _own_rows(tmp_path / "rows.jsonl")
    data = {**TOY, "seeds": [0], "settings": {**TOY["settings"], "steps": 30, "eval_max_blocks": 8},
            "arms": [{"name": "dense", "kind": "dense"}, {"name": "cse", "kind": "cse", "convert_at": [20]}],
            "criteria": {"arms": ["cse"]},
            "data": {"table": "rows.jsonl", "label_column": "domain", "tail": ["licence"], "vocab_size": 1000}}
    path = tmp_path / "own.toml"
    path.write_text(tomli_w.dumps(data))
    spec = load_spec(path)
    assert spec.settings.finetune_domains == ("licence",) and spec.criteria.tail == ("licence",)
    run = tmp_path / "run"
    outcome = run_experiment(spec, run, executor="inline", threads=0, poll=0.01)
    assert not outcome.failed, outcome.failed
    manifest = load_pack(run / "pack").manifest
    assert manifest["tail"] == ["licence"] and set(manifest["domains"]) == {"licence", "prose"}
    result = json.loads((run / "results" / "cse-seed0.json").read_text())
    assert {"ppl licence", "ppl prose"} <= set(result)
    verdict = json.loads((run / "tables" / "verdict.json").read_text())
    assert any(k.startswith("licence:") for k in verdict["cse"]["checks"]), verdict
    keys = {u["name"]: u["key"] for u in json.loads((run / "experiment.json").read_text())["units"]}
    assert spec_pack(spec, run) == run / "pack" and load_pack(run / "pack").manifest == manifest  # not rebuilt
    _own_rows(tmp_path / "rows.jsonl", extra=40)  # the table changed: another pack, so other unit keys
    version = load_pack(spec_pack(spec, run)).manifest["version"]
    assert version != manifest["version"] and all(u.key != keys[u.name] for u in units(spec, version))
    with pytest.raises(UserError, match="must not be given for a spec that names its own table"):
        run_experiment(spec, run, executor="inline", pack="default")


@pytest.mark.parametrize("change, message", [
    ({"table": "missing.jsonl"}, "data.table must name a table file"),
    ({"tail": []}, "data.tail must list the long tail's labels"),
    ({"colour": "blue"}, "data."),
    ({"validation": 0.6, "test": 0.5}, "data.validation and data.test must be above 0, together below 1"),
])
def test_a_data_section_is_checked_whole(tmp_path, change, message):
    _own_rows(tmp_path / "rows.jsonl")
    data = {"table": "rows.jsonl", "label_column": "domain", "tail": ["licence"], **change}
    with pytest.raises(SpecError, match=message):
        load_spec(toy_file(tmp_path, data=data))


# ---- a spec over the researcher's own model and table ------------------------------------------

def _own_model(path: Path) -> Path:
    """A tiny GPT-NeoX saved the HF way (safetensors, config.json naming its architecture) with a
    BPE of its own: what a researcher's model directory holds."""
    import torch
    import transformers

    from ntkscope.text.tokenization import train_bpe

    tok = train_bpe([json.loads(line)["text"] for line in (path.parent / "rows.jsonl").read_text().splitlines()],
                    vocab_size=600)
    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=3, num_attention_heads=2, max_position_embeddings=128,
                                        rotary_pct=0.25, bos_token_id=0, eos_token_id=0)
    transformers.GPTNeoXForCausalLM(config).save_pretrained(path)
    (path / "tokenizer.json").write_text(tok.backend.to_str())
    return path


def test_a_spec_over_the_researchers_own_hf_model_and_table_runs(tmp_path):
    """[trunk] model names an HF model directory and [data] a JSONL: the pack is the table
    tokenized by the model's own tokenizer, every trunk trains that model (its architecture, not the
    preset's GPT), CSE converts its FFNs and the tables judge the table's tail; another model is
    another trunk key."""
    import tomli_w
    import transformers

    from cse_models import SparseHF, load_any_model
    from ntkscope.text.corpus.pack import load_pack

    _own_rows(tmp_path / "rows.jsonl")
    _own_model(tmp_path / "my-model")
    data = {**TOY, "seeds": [0], "settings": {**TOY["settings"], "steps": 30, "eval_max_blocks": 8},
            "trunk": {"layers": [1, 2], "gc_peak_step": 10, "model": "my-model"},
            "arms": [{"name": "dense", "kind": "dense"}, {"name": "cse", "kind": "cse", "convert_at": [20]},
                     {"name": "switch", "kind": "switch", "convert_at": [20], "fair": True}],
            "criteria": {"arms": ["cse"]},
            "data": {"table": "rows.jsonl", "label_column": "domain", "tail": ["licence"]}}
    path = tmp_path / "own.toml"
    path.write_text(tomli_w.dumps(data))
    spec = load_spec(path)
    assert spec.trunk.model == str((tmp_path / "my-model").resolve()) and spec.trunk.n_layer == 3
    run = tmp_path / "run"
    outcome = run_experiment(spec, run, executor="inline", threads=0, poll=0.01)
    assert not outcome.failed, outcome.failed
    pack = load_pack(run / "pack")
    assert (run / "pack" / "tokenizer.json").read_bytes() == (tmp_path / "my-model" / "tokenizer.json").read_bytes()
    assert pack.manifest["tokenizer"]["kind"].startswith("given")
    trunk = load_any_model(run / "models" / "dense-seed0" / "checkpoints" / "step-000030")
    assert isinstance(trunk, SparseHF) and isinstance(trunk.hf, transformers.GPTNeoXForCausalLM)
    cse = load_any_model(run / "models" / "cse-seed0" / "checkpoints" / "step-000030")
    assert cse.config.sparse.kind == "cse" and list(cse.config.sparse.layers) == [1, 2]
    result = json.loads((run / "results" / "cse-seed0.json").read_text())
    assert {"ppl licence", "ppl prose"} <= set(result) and set(result["routing"]) == {"1", "2"}
    verdict = json.loads((run / "tables" / "verdict.json").read_text())
    assert any(k.startswith("licence:") for k in verdict["cse"]["checks"]), verdict
    trunk_key = next(u.key for u in units(spec, pack.manifest["version"]) if u.name == "dense-seed0")
    other = tmp_path / "other"
    shutil.copytree(tmp_path / "my-model", other)
    (other / "config.json").write_text((other / "config.json").read_text().replace('"hidden_act"', '"hidden_dropout": 0.0, "hidden_act"'))
    changed = load_spec(path, trunk={**data["trunk"], "model": "other"})
    assert next(u.key for u in units(changed, pack.manifest["version"]) if u.name == "dense-seed0") != trunk_key


@pytest.mark.parametrize("change, message", [
    ({"trunk": {"model": "missing"}}, "trunk.model must name an HF causal LM directory"),
    ({"trunk": {"model": "my-model", "layers": [3]}}, r"trunk.layers must be in \[0, 2\]"),
    ({"trunk": {"model": "my-model"}, "data": None}, r"trunk.model needs a \[data\] table"),
    ({"trunk": {"model": "my-model"}, "data": {"vocab_size": 500}}, "trunk.model sets the architecture"),
])
def test_a_trunk_model_is_checked_with_the_spec(tmp_path, change, message):
    _own_rows(tmp_path / "rows.jsonl")
    _own_model(tmp_path / "my-model")
    data = {"table": "rows.jsonl", "label_column": "domain", "tail": ["licence"], **(change.get("data") or {})}
    spec = {**TOY, "trunk": {**TOY["trunk"], "layers": [0, 1], **change["trunk"]},
            **({} if change.get("data", {}) is None else {"data": data})}
    with pytest.raises(SpecError, match=message):
        load_spec(toy_file(tmp_path, **spec))


