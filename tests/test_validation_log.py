"""The validation log during training (cse_models.validation): per-domain validation loss every
``eval_every`` steps, equal to scoring the saved checkpoint, without changing what is trained,
and resumed with the run."""

import json

import numpy as np
import pandas as pd
import pytest
import torch

from cse_models import load_model
from cse_models.evaluate import block_losses, domain_table
from cse_models.train import TrainConfig, load_data, train
from ntkscope.core.checks import UserError
from tests.test_training import Killed, config, weights

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_log_changes_nothing_trained_and_equals_scoring_the_checkpoint(tmp_path):
    torch.set_default_dtype(torch.float32)
    plain = train(config(tmp_path, "plain"))
    logged = train(config(tmp_path, "logged", eval_every=4))  # CSE converts at step 6, between two scorings
    for name, tensor in weights(plain).items():
        assert torch.equal(tensor, weights(logged)[name]), name
    assert _metrics(tmp_path / "plain") == [{**m} for m in _metrics(tmp_path / "logged")]  # losses and routing load
    assert not (tmp_path / "plain" / "validation.csv").exists()

    table = pd.read_csv(tmp_path / "logged" / "validation.csv")
    cfg = config(tmp_path, "logged")
    blocks = load_data(cfg, "validation")[0]
    assert sorted(table["step"].unique()) == [4, 8, 12, 14]  # every 4 steps and the last
    assert set(table["domain"]) == {*blocks.domain_names, "all"}
    lrs = {m["step"]: m["lr"] for m in _metrics(tmp_path / "logged")}
    assert all(row.lr == pytest.approx(lrs[row.step]) for row in table.itertuples())

    model = load_model(logged)  # the last step's rows are the saved model's validation loss per domain
    sums, counts = block_losses(model, blocks, special_ids=tuple(load_data(cfg)[1].special_ids))
    expected = domain_table(blocks, sums, counts).set_index("domain")
    last = table[table["step"] == 14].set_index("domain")
    for domain, row in expected.iterrows():
        assert last.loc[domain, "loss"] == pytest.approx(row["loss"], rel=1e-5), domain
        assert last.loc[domain, "tokens"] == row["tokens"]
        assert last.loc[domain, "ppl"] == pytest.approx(np.exp(row["loss"]), rel=1e-5)
    # the scorings differ over training: the log is not one number repeated
    assert table[table["domain"] == "all"]["loss"].nunique() == 4


def test_a_resumed_run_keeps_its_rows_and_redoes_the_later_ones(tmp_path):
    torch.set_default_dtype(torch.float32)
    train(config(tmp_path, "full", eval_every=2))

    def kill_at(step, _metrics, _model):
        if step == 11:  # after the scoring at 10; the last checkpoint is at 8
            raise Killed

    with pytest.raises(Killed):
        train(config(tmp_path, "killed", eval_every=2), callbacks=[kill_at])
    assert sorted(pd.read_csv(tmp_path / "killed" / "validation.csv")["step"].unique()) == [2, 4, 6, 8, 10]
    train(config(tmp_path, "killed", eval_every=4))  # resumed from step 8, scoring every 4 (a resumable change)
    resumed = pd.read_csv(tmp_path / "killed" / "validation.csv")
    assert sorted(resumed["step"].unique()) == [2, 4, 6, 8, 12, 14]  # step 10's row, after the checkpoint, is gone
    full = pd.read_csv(tmp_path / "full" / "validation.csv")
    full = full[full["step"].isin([2, 4, 6, 8, 12, 14])].reset_index(drop=True)
    np.testing.assert_allclose(resumed["loss"], full["loss"], rtol=1e-5)


@pytest.mark.parametrize("value", [-1, 1.5, True, "50"])
def test_eval_every_must_be_a_count(tmp_path, value):
    with pytest.raises(UserError, match=r"TrainConfig: eval_every must be an integer >= 0"):
        config(tmp_path, eval_every=value)


def test_eval_every_needs_a_validation_split(tmp_path):
    table = tmp_path / "rows.jsonl"
    table.write_text("".join(json.dumps({"text": f"line {i} of the user's own text"}) + "\n" for i in range(200)))
    cfg = TrainConfig.from_dict({"out_dir": str(tmp_path / "run"), "model": {"n_layer": 1, "n_embd": 16, "n_head": 2},
                                 "data": {"table": str(table), "tokenizer": "gpt2", "seq_len": 16}, "steps": 2,
                                 "batch_size": 2, "eval_every": 1})
    with pytest.raises(UserError, match=r"train: eval_every=1 needs a corpus pack's validation split"):
        train(cfg)
