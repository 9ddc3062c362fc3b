"""The conversion step has one name, ``convert_at``, in every config a user writes: the spec's
arms and settings, TrainConfig's ``cse`` and ``upcycle``, the Trainer callback and the plan.
The old names are read with one warning line; a record written before the rename is read
silently; a unit keyed before the rename keeps its key."""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import re
from pathlib import Path

import pytest
import tomli_w

from cse_models.hf_trainer import SparseCallback
from cse_models.train_config import CSEConfig, TrainConfig, UpcycleConfig
from ntkscope.core.checks import UserError
from ntkscope.experiments import load_spec, units
from ntkscope.representation.plan import Plan
from ntkscope.reproduction.settings import ReproduceSettings
from ntkscope.reproduction.sweep import Arm

ROOT = Path(__file__).resolve().parents[1]
TOY = {"name": "toy", "kind": "sweep", "preset": "smoke", "seeds": [0],
       "settings": {"steps": 60, "checkpoint_every": 10},
       "trunk": {"layers": [0, 1], "gc_peak_step": 10},
       "arms": [{"name": "dense", "kind": "dense"}, {"name": "cse", "kind": "cse", "convert_at": [20, 40]}],
       "criteria": {"arms": ["cse-at20"]}}


def fields(cls) -> set:
    return {f.name for f in dataclasses.fields(cls)}


def test_the_schema_names_the_conversion_step_convert_at_and_nothing_else():
    """Each place a conversion step is set has a field ``convert_at`` (the settings' table rows:
    ``table_convert_at``); no field is named ``at``; ``warmup_steps`` is left to the learning rate."""
    assert {"convert_at"} <= fields(CSEConfig) and {"convert_at"} <= fields(UpcycleConfig)
    assert "convert_at" in fields(Arm) and "convert_at" in fields(Plan)
    assert "table_convert_at" in fields(ReproduceSettings)
    assert "convert_at" in inspect.signature(SparseCallback).parameters
    schema = {"TrainConfig": fields(TrainConfig), "cse": fields(CSEConfig), "upcycle": fields(UpcycleConfig),
              "Arm": fields(Arm), "Plan": fields(Plan), "ReproduceSettings": fields(ReproduceSettings)}
    for name, names in schema.items():
        assert "at" not in names and not any(n.endswith("_warmup") for n in names), name
    assert [n for n, names in schema.items() if "warmup_steps" in names] == ["TrainConfig", "ReproduceSettings"]
    assert "learning rate" in inspect.getsource(TrainConfig).split("warmup_steps: int", 1)[1].splitlines()[0]


def test_the_shipped_specs_and_configs_use_the_one_name():
    for spec in sorted((ROOT / "ntkscope" / "experiments" / "specs").glob("*.toml")):
        assert not re.search(r"^\s*at\s*=", spec.read_text(), re.M), spec.name
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        text = config.read_text()
        assert "cse: {warmup_steps" not in text and not re.search(r"upcycle:.*\bat:", text), config.name


def test_train_config_reads_the_old_names_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = TrainConfig.from_dict({"cse": {"warmup_steps": 5}, "upcycle": {"at": 7}})
    assert cfg.cse.convert_at == 5 and cfg.upcycle.convert_at == 7
    said = [r.getMessage() for r in caplog.records]
    assert said == ["TrainConfig: cse: warmup_steps is deprecated, read as convert_at; write convert_at",
                    "TrainConfig: upcycle: at is deprecated, read as convert_at; write convert_at"]
    with pytest.raises(UserError, match=r"TrainConfig: cse: warmup_steps and convert_at are the same setting"):
        TrainConfig.from_dict({"cse": {"warmup_steps": 5, "convert_at": 5}})
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # a run's train_config.json written before the rename
        old = TrainConfig.from_record({"cse": {"warmup_steps": 5}, "upcycle": {"at": 7, "n_experts": 2}})
    assert old.cse.convert_at == 5 and old.upcycle.convert_at == 7 and old.upcycle.preserving is False
    assert not caplog.records
    assert dataclasses.asdict(cfg)["cse"]["convert_at"] == 5 and "warmup_steps" not in dataclasses.asdict(cfg)["cse"]


def test_a_spec_reads_the_old_names_with_one_warning_and_keeps_the_keys(tmp_path, caplog):
    new = tmp_path / "new" / "toy.toml"
    new.parent.mkdir()
    new.write_text(tomli_w.dumps(TOY))
    old = tmp_path / "old" / "toy.toml"
    old.parent.mkdir()
    old.write_text(tomli_w.dumps({**TOY, "arms": [TOY["arms"][0], {"name": "cse", "kind": "cse", "at": [20, 40]}]}))
    with caplog.at_level(logging.WARNING):
        a, b = load_spec(new), load_spec(old)
    assert [r.getMessage() for r in caplog.records] == [
        f"{old}: arms[1]: at is deprecated, read as convert_at; write convert_at"]
    assert a.arms == b.arms and [u.key for u in units(a, "v")] == [u.key for u in units(b, "v")]
    cse = next(u for u in units(a, "v") if u.name == "cse-at20-seed0")
    assert cse.what["at"] == 20 and "convert_at" not in cse.what  # keyed under the name units were first keyed


def test_the_tables_setting_reads_its_old_name_and_keeps_the_keys(tmp_path, caplog):
    text = (ROOT / "ntkscope" / "experiments" / "specs" / "tables.toml").read_text()
    keys = {}
    for name, key in (("new", "table_convert_at"), ("old", "table_warmup")):
        path = tmp_path / name / "tables.toml"
        path.parent.mkdir()
        path.write_text(text.replace("[tables]", f"[settings]\n{key} = 100\n\n[tables]"))
        with caplog.at_level(logging.WARNING):
            spec = load_spec(path)
        assert spec.settings.table_convert_at == 100
        keys[name] = [u.key for u in units(spec, "v")]
    assert keys["new"] == keys["old"]
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'old' / 'tables.toml'}: settings: table_warmup is deprecated, read as table_convert_at; write "
        "table_convert_at"]


def test_the_callback_and_the_plan_read_the_old_names(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        callback = SparseCallback(at=4, kind="switch", layers=[1], n_experts=2)
    assert callback.convert_at == 4
    assert [r.getMessage() for r in caplog.records] == [
        "SparseCallback: at is deprecated, read as convert_at; write convert_at"]
    plan = Plan([1, 2], "ffn", 300, "top-2", {}, "gc-peak")
    written = json.loads(plan.save(tmp_path / "plan.json").read_text())
    assert written["format"] == 3 and written["convert_at"] == 300 and "warmup_steps" not in written
    older = {**{k: v for k, v in written.items() if k != "convert_at"}, "format": 2, "warmup_steps": 300}
    (tmp_path / "older.json").write_text(json.dumps(older))
    assert Plan.load(tmp_path / "older.json") == plan
    assert SparseCallback(plan=tmp_path / "older.json", kind="switch", n_experts=2).convert_at == 300
