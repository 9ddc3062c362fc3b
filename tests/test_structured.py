"""The structured NTK (per-layer factors) against the per-sample autograd loop, in float64."""

import logging
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ntkscope as ns
import ntkscope.kernel.factors as st
from cse_models import GPT, GPTConfig, SparseConfig
from ntkscope.kernel.objectives import resolve_output
from ntkscope.core.lm import token_values
from reference import causal_jacobian, jacobian_loop, masked_jacobian

RTOL = 1e-10


def close(a, b):
    """Relative error (max entry) of a against b."""
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(params=["auto", "ghost", "materialised"])
def form(request, monkeypatch):
    """Run each case with the cost model, and with every pair forced to one form where it has it."""
    if request.param != "auto":
        choose = st.pair_choice

        def forced(fa, fb, ca, cb, work):
            if request.param == "materialised" or st.ghost_cost(fa, fb) is None:
                return "materialised", choose(fa, fb, ca, cb, work)[1]
            return "ghost", 0.0

        monkeypatch.setattr(st, "pair_choice", forced)
    return request.param


def test_mlp_with_layernorm_embedding_bias(form):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(12, 6, padding_idx=0), nn.LayerNorm(6), nn.Linear(6, 5), nn.Tanh(),
                          nn.Linear(5, 1))

    def f(m, ids):  # a scalar per sequence: the mean over tokens of the last layer's output
        return m(ids).mean(dim=(1, 2))

    ids = torch.randint(0, 12, (7, 4))
    ids[1, 2] = 0  # the padding row's gradient is zero
    J = jacobian_loop(model, 7, lambda i: f(model, ids[i : i + 1])[0])
    res = ns.empirical_ntk(model, ids, output=f, method="structured", blocks="param")
    assert close(res.matrix, J @ J.T) < RTOL
    torch.testing.assert_close(sum(res.blocks.values()), res.matrix, rtol=1e-12, atol=1e-14)


def test_cse_models_gpt_with_tied_embeddings_blocks_and_cross(gpt, lm_batch, form):
    J = causal_jacobian(gpt, lm_batch)
    res = ns.empirical_ntk(gpt, lm_batch, method="structured", blocks="layer")
    assert res.method == "structured" and res.gradient_passes == 1
    assert close(res.matrix, J @ J.T) < RTOL
    torch.testing.assert_close(sum(res.blocks.values()), res.matrix, rtol=1e-12, atol=1e-14)
    names = [n for n, _ in gpt.named_parameters() if n.startswith("transformer.h.0.")]
    J0 = causal_jacobian(gpt, lm_batch, names)
    assert close(res.blocks["transformer.h.0"], J0 @ J0.T) < RTOL
    b1, b2 = ({k: v[:5] for k, v in lm_batch.items()}, {k: v[5:] for k, v in lm_batch.items()})
    cross = ns.empirical_ntk(gpt, b1, b2, method="structured")
    assert cross.matrix.shape == (5, 3) and close(cross.matrix, J[:5] @ J[5:].T) < RTOL


def test_panels_and_chunks_when_factors_do_not_fit(gpt, lm_batch):
    """A budget below the minimum is refused before anything runs, with the smallest that would
    do; a budget near it then runs, in panels, and gives the same kernel."""
    full = ns.empirical_ntk(gpt, lm_batch, method="structured")
    with pytest.raises(ValueError, match=r"max_memory is too small for method='structured' here: it needs at "
                                         r"least ([\d.]+) KiB") as refused:
        ns.empirical_ntk(gpt, lm_batch, method="structured", max_memory=1000)
    need = float(re.search(r"at least ([\d.]+) KiB", str(refused.value)).group(1)) * 1024
    # a third above it: each call measures its probe again, and a tiny model's peaks vary by pages
    small = ns.empirical_ntk(gpt, lm_batch, method="structured", max_memory=int(1.33 * need))
    assert small.gradient_passes > 1 and "panels" in small.reason
    assert close(small.matrix, full.matrix) < 1e-12


def test_hf_gpt2_with_padding(hf_gpt2, lm_batch, form):
    J = causal_jacobian(hf_gpt2, lm_batch)
    res = ns.empirical_ntk(hf_gpt2, lm_batch, method="structured")
    assert close(res.matrix, J @ J.T) < RTOL


def test_hf_bert_masked_lm(hf_bert, lm_batch, form):
    output = ns.LMLoss(objective="masked", mask_token_id=1, mask_prob=0.3, seed=7)
    J = masked_jacobian(hf_bert, lm_batch, resolve_output(output, hf_bert), F.cross_entropy)
    res = ns.empirical_ntk(hf_bert, lm_batch, output=output, method="structured")
    assert close(res.matrix, J @ J.T) < RTOL


class Scaled(nn.Module):
    """A raw parameter used functionally (no module owns it): the structured method has no form for it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.randn(3))
        self.head = nn.Linear(3, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(x) * self.scale)).squeeze(-1)


def test_a_parameter_without_a_structured_form_falls_back_and_stays_exact(caplog):
    torch.manual_seed(0)
    model = Scaled()
    X = torch.randn(6, 4)
    J = jacobian_loop(model, 6, lambda i: model(X[i : i + 1])[0])
    with caplog.at_level(logging.INFO, logger="ntkscope.kernel.structured"):
        res = ns.empirical_ntk(model, X, output=lambda m, x: m(x), method="structured", blocks="param")
    assert "scale" in caplog.text and "per-sample" in caplog.text
    assert close(res.matrix, J @ J.T) < RTOL
    J_scale = jacobian_loop(model, 6, lambda i: model(X[i : i + 1])[0], ["scale"])
    assert close(res.blocks["model.scale"] if "model.scale" in res.blocks else res.blocks["scale"],
                 J_scale @ J_scale.T) < RTOL


def _sparse(kind, n_experts=2):
    torch.manual_seed(0)
    extra = {"domains": [f"d{j}" for j in range(n_experts)]} if kind == "demix" else {"proj_dim": 4}
    sparse = SparseConfig(kind=kind, layers=[1], n_experts=[n_experts], **extra)
    return GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=16, sparse=sparse)).eval()


@pytest.mark.parametrize("kind", ["cse", "switch", "demix"])
def test_sparse_expert_models_through_the_batched_paths(kind, lm_batch, caplog):
    model = _sparse(kind)
    layer = model.transformer.h[1].mlp
    batch = dict(lm_batch)
    if kind == "cse":
        layer.projection.normal_()
        z = model.module_inputs(batch["input_ids"], batch["attention_mask"], [1])[1] @ layer.projection.T
        layer.centres.copy_(z[[0, 3]])  # two sequences seed two experts: both get traffic
    if kind == "switch":
        layer.capacity_factor = 0.7  # some tokens overflow their expert
        layer.router.weight.data.normal_()
    if kind == "demix":
        batch["domains"] = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])

    def one(i):
        sample = {k: v[i : i + 1] for k, v in batch.items()}
        n = int(sample["attention_mask"].sum())
        x = sample["input_ids"][:, :n]
        logits = model(x, None, sample.get("domains")) if kind == "demix" else model(x)
        return F.cross_entropy(logits[0, :-1], x[0, 1:])

    J = jacobian_loop(model, 8, one)  # gather dispatch, one sequence at a time: the reference
    with caplog.at_level(logging.WARNING):
        output = ns.LMLoss(objective="causal")  # DEMix cannot run without domains, so nothing probes it
        exact = ns.empirical_ntk(model, batch, method="exact", blocks="expert", output=output)
        structured = ns.empirical_ntk(model, batch, method="structured", blocks="expert", output=output)
    assert "one sample at a time" not in caplog.text  # vmap ran batched: no per-sample loop
    assert close(exact.matrix, J @ J.T) < 1e-9
    assert close(structured.matrix, J @ J.T) < RTOL
    experts = [k for k in structured.blocks if ".experts." in k]
    assert len(experts) == 2 and all(float(structured.blocks[k].diag().max()) > 0 for k in experts)
    assert not layer.per_sample_dispatch  # the user's model is left as it was


def test_switch_masked_dispatch_equals_gather_for_one_sequence(lm_batch):
    model = _sparse("switch", 3)
    layer = model.transformer.h[1].mlp
    layer.capacity_factor = 0.8
    layer.router.weight.data.normal_()
    x = torch.randn(1, 9, 16)
    mask = torch.ones(1, 9, dtype=torch.bool)
    mask[0, 7:] = False
    gathered = layer(x, mask)
    layer.per_sample_dispatch = True
    torch.testing.assert_close(layer(x, mask), gathered)


@pytest.mark.parametrize("how", ["pairs", "summed"])
def test_a_tied_weights_uses_summed_or_paired_give_the_same_kernel(gpt, lm_batch, how, monkeypatch):
    # the embedding and the tied head: one product of their summed per-sample gradients, or one per
    # pair of uses; both against the per-sample loop, in panels and streams too
    import ntkscope.kernel.structured as structured

    seen = []

    def forced(parts_a, parts_b, ca, cb, work, same):
        seen.append(len(parts_a))
        return (how if len(parts_a) > 1 else "pairs"), 0.0

    monkeypatch.setattr(structured, "use_products", forced)
    J = causal_jacobian(gpt, lm_batch)
    res = ns.empirical_ntk(gpt, lm_batch, method="structured")
    assert close(res.matrix, J @ J.T) < RTOL and 2 in seen
    cross = ns.empirical_ntk(gpt, {k: v[:5] for k, v in lm_batch.items()}, {k: v[5:] for k, v in lm_batch.items()},
                             method="structured")
    assert close(cross.matrix, J[:5] @ J[5:].T) < RTOL
    panels = ns.empirical_ntk(gpt, lm_batch, method="structured", chunk_size=2)
    assert close(panels.matrix, J @ J.T) < RTOL


def test_a_sum_of_uses_of_every_kind_is_the_sum_of_their_gradients():
    # a Linear head, two Embeddings and a Dense (a transposed, non-contiguous one) in every order
    g = torch.Generator().manual_seed(0)
    V, d, c, T = 7, 3, 4, 5
    head = st.Linear(torch.randn(c, T, d, generator=g), torch.randn(c, T, V, generator=g))
    embeds = [st.Embed(torch.randint(0, V, (c, T), generator=g), torch.randn(c, T, d, generator=g), V)
              for _ in range(2)]
    dense = st.Dense(torch.randn(V * d, c, generator=g).T)
    for parts in ([head, *embeds], embeds, [dense, embeds[0]], [embeds[1], dense, head]):
        want = sum(f.materialise() for f in parts)
        torch.testing.assert_close(st.Summed(parts).materialise(), want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(st.rows_of(st.Summed(parts), slice(1, 3)).materialise(), want[1:3])
    before = dense.grads.clone()
    st.Summed([dense, embeds[0]]).materialise()
    torch.testing.assert_close(dense.grads, before, rtol=0, atol=0)


@pytest.mark.parametrize("elements", [1, 40, 10**9])  # a unit a block, uneven blocks, one block
def test_gradients_formed_a_block_of_units_at_a_time_give_the_materialised_products(elements, monkeypatch):
    # every blockable kind (Linear in both layouts and with a non-contiguous cotangent, Embed, sums
    # of a head and embeddings, of embeddings, of two Linear uses in either layout), against itself
    # and against another run of samples, in float64; and with a work share that binds
    monkeypatch.setattr(st, "BLOCK_ELEMENTS", elements)
    g = torch.Generator().manual_seed(0)
    V, d = 11, 3

    def kinds(c, T):
        def rand(*shape):
            return torch.randn(*shape, generator=g, dtype=torch.float64)

        head = st.Linear(rand(c, T, d), rand(c, T, V))
        conv = st.Linear(head.a, head.delta, io=True)
        strided = st.Linear(rand(T, c, d).transpose(0, 1), rand(c, V, T).transpose(1, 2))
        embeds = [st.Embed(torch.randint(0, V, (c, T), generator=g), rand(c, T, d), V) for _ in range(2)]
        twin = st.Linear(head.a.flip(1), rand(c, T, V))
        return [head, conv, strided, embeds[0], st.Summed([embeds[0], head, embeds[1]]), st.Summed(embeds),
                st.Summed([head, twin]), st.Summed([conv, st.Linear(twin.a, twin.delta, io=True)])]

    for fa, fb in zip(kinds(5, 4), kinds(3, 6)):
        assert st.blockable(fa)
        for other, same in ((fa, True), (fb, False)):
            want = fa.materialise() @ other.materialise().T
            for work in (None, 2 * 5 * d):  # a work share of one unit a block
                torch.testing.assert_close(st.blocked_product(fa, other, same, work), want, rtol=1e-12, atol=1e-12)
            got, form = st.pair_kernel(fa, other, 10**6, symmetric=same)
            assert form == "materialised"
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    head, conv, _, embed = kinds(2, 2)[:4]
    dense = st.Dense(torch.randn(2, V * d, generator=g, dtype=torch.float64))
    assert not any(st.blockable(st.Summed(p)) for p in ([head, dense], [conv, embed], [conv, head]))
    torch.testing.assert_close(st.pair_kernel(st.Summed([head, dense]), st.Summed([head, dense]), 10**6)[0],
                               (head.materialise() + dense.grads) @ (head.materialise() + dense.grads).T)


def test_half_precision_blocks_are_added_up_in_float32(monkeypatch):
    # a thousand one-unit blocks of ones in bfloat16: added in bfloat16 the sum stalls at 256
    monkeypatch.setattr(st, "BLOCK_ELEMENTS", 1)
    ones = st.Linear(torch.ones(1, 1, 1, dtype=torch.bfloat16), torch.ones(1, 1, 1000, dtype=torch.bfloat16))
    got = st.blocked_product(ones, ones, True)
    assert got.dtype == torch.bfloat16 and float(got) == 1000.0


def test_the_cost_model_sums_a_tied_heads_uses_where_that_is_cheaper(gpt, lm_batch, caplog):
    with caplog.at_level(logging.INFO, logger="ntkscope.kernel.structured"):
        ns.empirical_ntk(gpt, lm_batch, method="structured")
    assert "'summed': 1" in caplog.text


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("value", ["centred-true-logit", "true-logit"])
def test_a_wide_head_merges_its_background_columns_and_stays_exact(lm_batch, value, tied, monkeypatch):
    # a vocabulary of 1,048 of which the batch uses under 50: the head's cotangent (e_y - 1/V, or
    # e_y) is one value per row outside the targets' columns, which are merged into one (tied: the
    # head's and the embedding's summed uses, the embedded tokens' rows kept)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=st.WIDE + 24, block_size=16, n_layer=1, n_head=2, n_embd=8,
                          tie_weights=tied)).eval()
    widths, real = [], st.merge_constant_columns

    def spy(fa, fb, work=None):
        out = real(fa, fb, work)
        widths.append((type(fa).__name__, st._units(fa)[0], st._units(out[0])[0]))
        return out

    monkeypatch.setattr(st, "merge_constant_columns", spy)
    ids, mask = lm_batch["input_ids"], lm_batch["attention_mask"]

    def f(i):
        x = ids[i : i + 1, : int(mask[i].sum())]
        return token_values(model(input_ids=x)[:, :-1], x[:, 1:], value=value)[0]

    J = jacobian_loop(model, 8, f)
    res = ns.empirical_ntk(model, lm_batch, method="structured", output=value)
    assert close(res.matrix, J @ J.T) < RTOL
    assert widths and all(before == st.WIDE + 24 and after <= 51 for _, before, after in widths)
    assert {kind for kind, _, _ in widths} == ({"Summed"} if tied else {"Linear"})


@pytest.mark.parametrize("io", [False, True])
def test_merged_columns_give_the_materialised_products(io):
    # a background value per row outside 5 columns, in two uses of different lengths; and a dense
    # cotangent (a softmax's), which is left as it is
    g = torch.Generator().manual_seed(0)
    V = st.WIDE + 8

    def use(c, T):
        delta = torch.randn(c, T, 1, generator=g).expand(c, T, V).clone()
        cols = torch.tensor([3, 17, 40, 41, V - 1])
        delta[..., cols] += torch.randn(c, T, 5, generator=g)
        return st.Linear(torch.randn(c, T, 6, generator=g), delta, io)

    fa, fb = use(4, 7), use(3, 5)
    for a, b in ((fa, fb), (fa, fa)):
        ma, mb = st.merge_constant_columns(a, b)
        assert ma.delta.shape[-1] == 6 and (mb is ma) == (b is a)
        want = a.materialise() @ b.materialise().T
        torch.testing.assert_close(ma.materialise() @ mb.materialise().T, want, rtol=1e-12, atol=1e-12)
        got, form = st.pair_kernel(a, b, 1 << 20, symmetric=b is a)
        assert form == "materialised"
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    dense = st.Linear(fa.a, torch.randn(fa.delta.shape, generator=g).softmax(-1), io)
    assert st.merge_constant_columns(dense, dense) == (dense, dense)


def test_a_tied_heads_summed_uses_merge_columns_outside_the_embeddings_rows():
    # the head's cotangent is a background value per row outside 3 target columns; the embedding
    # touches other rows of the same weight, which must be kept. In the second case the sampled
    # rows' reference (column 0) differs from the background in a row the sample skips.
    g = torch.Generator().manual_seed(0)
    V, d = st.WIDE + 8, 3

    def summed(c, T, odd_row):
        delta = torch.randn(c, T, 1, generator=g, dtype=torch.float64).expand(c, T, V).clone()
        delta[..., [5, 17, V - 1]] += torch.randn(c, T, 3, generator=g, dtype=torch.float64)
        if odd_row:
            delta.view(-1, V)[1, 0] += 1.0
        tokens = torch.randint(20, 60, (c, T), generator=g)
        embed = st.Embed(tokens, torch.randn(c, T, d, generator=g, dtype=torch.float64), V)
        return st.Summed([embed, st.Linear(torch.randn(c, T, d, generator=g, dtype=torch.float64), delta)])

    for fa, fb in ((summed(4, 7, False), summed(3, 5, False)), (summed(8, 64, True), summed(2, 3, False))):
        for a, b in ((fa, fb), (fa, fa)):
            ma, mb = st.merge_constant_columns(a, b)
            width = ma.parts[1].delta.shape[-1]
            assert width < 70 and ma.parts[0].vocab == width and (mb is ma) == (b is a)
            want = a.materialise() @ b.materialise().T
            torch.testing.assert_close(ma.materialise() @ mb.materialise().T, want, rtol=1e-12, atol=1e-12)
            got, form = st.pair_kernel(a, b, 1 << 20, symmetric=b is a)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    small = summed(4, 7, False)
    copies = 4 * 7 * st.merge_constant_columns(small, small)[0].parts[1].delta.shape[-1]
    assert st.merge_constant_columns(small, small, copies)[0] is not small  # the merged copies fit the work share
    assert all(f is small for f in st.merge_constant_columns(small, small, copies - 1))  # they would not
    every = summed(2, 3, False)
    every.parts[0].tokens = torch.arange(V).repeat(2, 1)[:, : V // 2 + 1]  # more than half the rows embedded
    every.parts[0].delta = torch.randn(2, V // 2 + 1, d, generator=g, dtype=torch.float64)
    assert all(f is every for f in st.merge_constant_columns(every, every))


def test_float32_structured_agrees_with_float64(gpt, lm_batch):
    ref = ns.empirical_ntk(gpt, lm_batch, method="structured").matrix
    res = ns.empirical_ntk(gpt.float(), lm_batch, method="structured")
    assert res.matrix.dtype == torch.float32 and close(res.matrix.double(), ref) < 1e-4
    as64 = ns.empirical_ntk(gpt, lm_batch, method="structured", dtype="float64")
    assert as64.matrix.dtype == torch.float64 and close(as64.matrix, ref) < 1e-5


def test_structured_refuses_a_vector_output(gpt, lm_batch):
    with pytest.raises(ValueError, match="empirical_ntk: method must support vector outputs"):
        ns.empirical_ntk(gpt, lm_batch, method="structured", output="logits")


def test_device_option_is_checked_and_cpu_runs_on_a_copy(gpt, lm_batch):
    ref = ns.empirical_ntk(gpt, lm_batch, method="structured").matrix
    res = ns.empirical_ntk(gpt, lm_batch, method="structured", device="cpu")
    assert close(res.matrix, ref) < 1e-12
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device must be a device this machine has; CUDA is not available"):
            ns.empirical_ntk(gpt, lm_batch, device="cuda")
    with pytest.raises(ValueError, match="device must be"):
        ns.empirical_ntk(gpt, lm_batch, device="tpu:0")


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["structured", "exact"])
def test_cuda_kernel_equals_the_cpu_one(gpt, lm_batch, method):
    ref = ns.empirical_ntk(gpt, lm_batch, method=method).matrix
    res = ns.empirical_ntk(gpt, lm_batch, method=method, device="cuda")
    assert res.matrix.device.type == "cuda" and close(res.matrix.cpu(), ref) < 1e-10
    assert next(gpt.parameters()).device.type == "cpu"  # the user's model stays where it was
    gc = ns.gradient_consistency(gpt, lm_batch, [0, 1, 2, 3], method=method, device="cuda")
    assert -1 <= gc.score <= 1


def test_layout_is_near_the_cheapest_that_fits(gpt, lm_batch):
    """Against a brute force over every (panel, stream, chunk) that fits the memory model of
    :func:`~ntkscope.kernel.structured.layout` (panel and stream held, with the larger of a
    chunk's transient, plus a stream being filled, and the stream's pair-product tiles), the
    layout found costs at most 10 % more, never more than the old rule (panel = stream = half
    of what fits), and at a tight budget streams fewer samples than it holds."""
    from ntkscope.kernel.grads import functional_model
    from ntkscope.kernel.options import KernelOptions
    from ntkscope.kernel.structured import probe
    from ntkscope.kernel.structured_layout import WORK_SHARE, layout, layout_cost, minimum_budget

    batch = {k: v.repeat(3, 1) for k, v in lm_batch.items()}  # n = 24
    opts = KernelOptions.build(None, method="structured", dtype="float64")
    with functional_model(gpt, opts) as fm:
        data = fm.prepare(batch)
        pr = probe(fm, data, 24)
    n, s = 24, pr.sample_bytes
    least = minimum_budget(pr, n, n, True)
    saw_small_stream = False
    for budget in [int(least * f) for f in (1.0, 1.5, 2.5, 4.0, 8.0)]:
        work = int(WORK_SHARE * budget)
        fixed = s  # the probe's kept sample (no kernel bytes passed)

        def fits(p, stream, c):
            loading = pr.transient.bytes(c) + (stream * s if stream > c else 0)
            return fixed + p * s + max(loading, work + stream * s) <= budget

        panel, stream, chunk = layout(pr, n, n, budget)
        if panel == n:
            continue  # everything at once
        assert fits(panel, stream, chunk), (budget, panel, stream, chunk)
        cost = layout_cost(pr, n, n, panel, stream, True, work)
        best = min(layout_cost(pr, n, n, p, st_, True, work) for c in range(1, n + 1) for st_ in range(c, n)
                   for p in range(1, n) if fits(p, st_, c))
        assert cost <= 1.1 * best, (budget, cost / best)
        half = max(1, max(p for p in range(1, n) if fits(p, p, 1)))  # the old rule, at its best chunk
        assert cost <= layout_cost(pr, n, n, half, half, True, work) * (1 + 1e-9)
        saw_small_stream |= stream < panel
    assert saw_small_stream


def test_an_accelerator_layout_takes_the_largest_chunk_that_fits(gpt, lm_batch):
    """On an accelerator the layout keeps to one chunk, the largest of the candidates that keeps
    at least half the panel the smallest would, and still fits the budget (the kernel does not depend on the chunk:
    tests/test_properties.py draws chunk sizes)."""
    import dataclasses

    from ntkscope.kernel.grads import functional_model
    from ntkscope.kernel.options import KernelOptions
    from ntkscope.kernel.structured import probe
    from ntkscope.kernel.structured_layout import MAX_CHUNK, WORK_SHARE, layout, minimum_budget

    batch = {k: v.repeat(3, 1) for k, v in lm_batch.items()}  # n = 24
    opts = KernelOptions.build(None, method="structured", dtype="float64")
    with functional_model(gpt, opts) as fm:
        pr = probe(fm, fm.prepare(batch), 24)
    fast = dataclasses.replace(pr, accelerator=True)
    n, s = 24, pr.sample_bytes
    least = minimum_budget(pr, n, n, True)
    chunks_seen = set()
    for budget in [int(least * f) for f in (1.5, 2.5, 4.0, 8.0)]:
        work = int(WORK_SHARE * budget)
        panel, stream, chunk = layout(fast, n, n, budget)
        if panel == n:
            continue
        first = max(1, min(MAX_CHUNK, work // max(1, pr.transient.per_sample)))
        def room(c):  # the panel a chunk (streamed as itself) leaves
            return (budget - s - max(pr.transient.bytes(c), work + c * s)) // s

        candidates = sorted({max(1, first >> k) for k in range(7)}, reverse=True)
        largest = next(c for c in candidates if room(c) >= max(1, room(candidates[-1]) // 2))
        assert chunk == largest >= layout(pr, n, n, budget)[2], (budget, chunk, largest)
        loading = pr.transient.bytes(chunk) + (stream * s if stream > chunk else 0)
        assert s + panel * s + max(loading, work + stream * s) <= budget
        chunks_seen.add(chunk)
    assert chunks_seen  # at least one budget needed panels


def test_the_probe_is_kept_across_calls_on_one_model_and_redone_when_it_changes(gpt, lm_batch, monkeypatch):
    """A tracker's probes reuse the plan and the chunk's measured memory: the same model and data
    shapes plan once, new weights still give the exact kernel; new content in the planned samples
    or a replaced layer plans again."""
    import copy

    import ntkscope.kernel.structured as S

    plans = []
    plan_factors = S.plan_factors
    monkeypatch.setattr(S, "plan_factors", lambda *a: plans.append(1) or plan_factors(*a))

    def both(batch):
        return (ns.empirical_ntk(gpt, batch, method="structured").matrix,
                ns.empirical_ntk(gpt, batch, method="exact").matrix)

    both(lm_batch)
    with torch.no_grad():
        for p in gpt.parameters():
            p.mul_(1.1)
    structured, exact = both(lm_batch)
    assert len(plans) == 1 and close(structured, exact) < RTOL
    other = {k: v.clone() for k, v in lm_batch.items()}
    other["input_ids"][0, 0] = (other["input_ids"][0, 0] + 1) % 50
    structured, exact = both(other)
    assert len(plans) == 2 and close(structured, exact) < RTOL
    gpt.transformer.h[0].mlp = copy.deepcopy(gpt.transformer.h[0].mlp)
    structured, exact = both(lm_batch)
    assert len(plans) == 3 and close(structured, exact) < RTOL


@pytest.mark.parametrize("which", ["gpt", "hf_gpt2"])
def test_padding_trimmed_per_chunk_gives_the_untrimmed_kernel(which, request, monkeypatch):
    """Samples ordered by length, each chunk cut at its longest: the forward and backward run on
    shorter sequences, and the kernel (blocks, order, the kept losses) is the untrimmed one."""
    import ntkscope.kernel.structured as structured

    model = request.getfixturevalue(which)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, 50, (8, 10), generator=g)
    lengths = torch.tensor([4, 10, 2, 7, 9, 3, 10, 5])  # out of order: the kernel comes back in the batch's order
    mask = (torch.arange(10)[None, :] < lengths[:, None]).long()
    batch = {"input_ids": ids * mask, "attention_mask": mask}
    seen, capture = [], structured.capture

    def spy(fm, plan, data, c, first_row=0, **kw):
        seen.append(data["aux"]["mask"].shape[1])
        return capture(fm, plan, data, c, first_row, **kw)

    monkeypatch.setattr(structured, "capture", spy)
    cut = ns.empirical_ntk(model, batch, method="structured", chunk_size=3, blocks="layer", sample_loss=True)
    assert min(seen) < 10  # some chunk ran trimmed
    monkeypatch.setattr(structured, "length_order", lambda *args: None)
    monkeypatch.setattr(structured, "trimmed", lambda objective, data: (data, -1, -1))
    whole = ns.empirical_ntk(model, batch, method="structured", chunk_size=3, blocks="layer", sample_loss=True)
    assert close(cut.matrix, whole.matrix) < 1e-12
    assert all(close(cut.blocks[b], whole.blocks[b]) < 1e-12 for b in whole.blocks)
    torch.testing.assert_close(torch.as_tensor(cut.sample_loss), torch.as_tensor(whole.sample_loss), rtol=1e-12,
                               atol=1e-12)
    J = causal_jacobian(model, batch)
    assert close(cut.matrix, J @ J.T) < RTOL


def test_a_left_padded_batch_is_not_trimmed(gpt, lm_batch):
    from ntkscope.kernel.padding import length_order

    objective = resolve_output("loss", gpt)
    left = {"input_ids": lm_batch["input_ids"], "attention_mask": lm_batch["attention_mask"].flip(1)}
    assert length_order(objective, objective.prepare(gpt, left)) is None
    assert length_order(objective, objective.prepare(gpt, lm_batch)) is not None
    assert length_order(resolve_output("hidden-mean", gpt), objective.prepare(gpt, lm_batch)) is None


def test_a_non_finite_sample_is_named_by_its_place_in_the_batch_when_the_rows_run_by_length(gpt):
    """The kernel runs the samples longest first; an error still names the sample as the batch holds it."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, 40, (6, 10), generator=g)
    lengths = torch.tensor([10, 3, 9, 4, 10, 8])
    mask = (torch.arange(10)[None, :] < lengths[:, None]).long()
    ids[3, 1] = 45  # sample 3 alone reads token 45, whose embedding comes out NaN (the tied head stays finite)
    hook = gpt.transformer.wte.register_forward_hook(
        lambda module, args, out: out.masked_fill((args[0] == 45)[..., None], float("nan")))
    try:
        with pytest.raises(ValueError, match=r"NaN/inf at samples \(got \[3\]\)"):
            ns.empirical_ntk(gpt, {"input_ids": ids * mask, "attention_mask": mask}, method="structured",
                             chunk_size=2)
    finally:
        hook.remove()
