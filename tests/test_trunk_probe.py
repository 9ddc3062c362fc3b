"""The trunk probe (ntkscope.runs.trunk_probe) against obviously correct slow references: each
block's loss from a per-block cross-entropy, each group's GC from the explicit J J^T of a
per-sample autograd loop, and the groups' bookkeeping (experts partition the probe)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from cse_models import GPT, GPTConfig
from ntkscope.kernel.uncertainty import kernel_gc
from ntkscope.runs.trunk_probe import COLUMNS, block_losses, probe_step, probe_trunk
from tests.reference import jacobian_loop

ROUTER = {"min_cluster_size": 5, "min_samples": 2, "proj_dim": 8, "max_experts": 4}


def probe_data():
    g = torch.Generator().manual_seed(3)
    fitting = torch.randint(0, 50, (40, 12), generator=g)
    probe = torch.randint(0, 50, (12, 12), generator=g)
    domains = ["general"] * 6 + ["legal"] * 3 + ["biomedical"] * 3
    return fitting, probe, domains


def centred_true_logit(model, x):  # the mean over predicted positions of the true logit less the mean logit
    logits = model(input_ids=x[None])[0, :-1]
    return (logits.gather(1, x[1:, None]).squeeze(1) - logits.mean(-1)).mean()


def test_the_probe_equals_its_slow_references(gpt):
    fitting, probe, domains = probe_data()
    rows = pd.DataFrame(probe_step(gpt, fitting, probe, domains, layers=[0, 1], tail=("legal", "biomedical"),
                                   router=ROUTER, seed=0, resampling=None))
    want = np.array([F.cross_entropy(gpt(input_ids=x[None])[0, :-1], x[1:]).item() for x in probe])
    np.testing.assert_allclose(block_losses(gpt, probe), want, rtol=1e-12)
    J = jacobian_loop(gpt, len(probe), lambda i: centred_true_logit(gpt, probe[i]))
    names = np.asarray(domains)
    for domain in ("general", "legal", "biomedical"):
        row = rows[(rows.kind == "domain") & (rows.group == domain)].iloc[0]
        idx = np.flatnonzero(names == domain)
        assert row.n == len(idx) and row.loss == pytest.approx(want[idx].mean(), rel=1e-12)
        assert row.gc == pytest.approx(kernel_gc((J @ J.T).numpy(), [idx], resampling=None)[0].score, rel=1e-8)
        assert row.tail_share == (0.0 if domain == "general" else 1.0)
    for layer in (0, 1):
        experts = rows[(rows.layer == layer) & (rows.kind == "expert")]
        small = rows[(rows.layer == layer) & (rows.kind == "small")].iloc[0]
        assert experts.n.sum() == len(probe) and len(experts) == experts.n_experts.iloc[0]
        assert small.n == len(probe) - experts[experts.group == "0"].n.iloc[0]
        assert 0 <= experts.noise_share.iloc[0] <= 1 and set(experts.group) == {str(j) for j in range(len(experts))}
        measured = experts[experts.n >= 2]
        assert measured.gc.notna().all() and experts[experts.n < 2].gc.isna().all()


def test_a_trunk_is_probed_at_every_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=16))
    checkpoints = []
    for step in (10, 20):
        model.save_pretrained(tmp_path / f"step-{step:06d}")
        checkpoints.append((step, tmp_path / f"step-{step:06d}"))
        torch.nn.init.normal_(model.lm_head.weight if hasattr(model, "lm_head") else next(model.parameters()))
    fitting, probe, domains = probe_data()
    table = probe_trunk(checkpoints, fitting, probe, domains, lrs={10: 1e-3}, layers=[1], tail=("legal",),
                        router=ROUTER, seed=0, resampling=None)
    assert list(table.columns) == list(COLUMNS) and sorted(set(table.step)) == [10, 20]
    assert table[table.step == 10].lr.eq(1e-3).all() and table[table.step == 20].lr.isna().all()
    a, b = (table[(table.step == s) & (table.kind == "domain")].set_index("group") for s in (10, 20))
    assert (a.n == b.n).all() and not np.allclose(a.loss, b.loss)  # the same probe, another model


def test_the_probe_command_refuses_a_directory_without_trunks(tmp_path):
    from commandline import in_process

    proc = in_process("experiment", "probe", tmp_path, "--spec", "warmup-fresh-half", "--out", tmp_path / "probe")
    assert proc.returncode == 1
    assert "ntkscope experiment probe: RUN must be a sweep's run directory with models/" in proc.stderr
    (tmp_path / "models").mkdir()
    proc = in_process("experiment", "probe", tmp_path, "--spec", "warmup-fresh-half", "--out", tmp_path / "probe",
                      "--seeds", "5")
    assert proc.returncode == 1 and "holds no checkpoints (the trunk of seed 5 has not trained" in proc.stderr
    assert not (tmp_path / "probe" / "trunk-seed5.csv").exists()


def test_the_tail_expert_step_is_the_first_with_a_pure_tail_expert_at_every_layer():
    from ntkscope.runs.trunk_probe import tail_expert_step

    def rows(step, layer, group, n, tail_share):
        return {"step": step, "layer": layer, "kind": "expert", "group": group, "n": n, "tail_share": tail_share}

    table = pd.DataFrame([
        rows(50, 2, "1", 9, 1.0), rows(50, 3, "1", 9, 1.0),  # before from_step
        rows(100, 2, "0", 90, 0.95), rows(100, 3, "0", 90, 0.95),  # the bulk never counts
        rows(200, 2, "1", 9, 0.95), rows(200, 3, "2", 4, 1.0),  # layer 3's is too small
        rows(300, 2, "1", 9, 0.95), rows(300, 3, "2", 6, 0.85),  # layer 3's is not pure
        rows(400, 2, "3", 5, 0.9), rows(400, 3, "1", 8, 1.0),
        rows(500, 2, "1", 9, 1.0), rows(500, 3, "1", 9, 1.0),
        {"step": 400, "layer": None, "kind": "domain", "group": "legal", "n": 64, "tail_share": 1.0}])
    assert tail_expert_step(table, [2, 3]) == 400
    assert tail_expert_step(table, [2]) == 200 and tail_expert_step(table, [2, 3], from_step=0) == 50
    assert tail_expert_step(table, [2, 3], purity=0.99) == 500 and tail_expert_step(table, [4]) is None
