"""Bad input gets a ValueError naming the function, the argument and the value."""

import pytest
import torch
import torch.nn as nn

import ntkscope as ns


def test_empty_batch(gpt):
    empty = {"input_ids": torch.zeros(0, 5, dtype=torch.long), "attention_mask": torch.zeros(0, 5, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"empirical_ntk: batch must hold at least one sample \(got 0\)"):
        ns.empirical_ntk(gpt, empty)


def test_subset_of_fewer_than_two_samples(gpt, lm_batch):
    with pytest.raises(ValueError, match=r"gradient_consistency: subset must hold at least 2 samples.*\(got 1\)"):
        ns.gradient_consistency(gpt, lm_batch, [3])
    with pytest.raises(ValueError, match=r"subset must hold indices in \[0, 8\)"):
        ns.gradient_consistency(gpt, lm_batch, [3, 9])
    with pytest.raises(ValueError, match="subset must be a label present in labels"):
        ns.gradient_consistency(gpt, lm_batch, "z", labels=list("abababab"))


def test_glob_that_matches_nothing(gpt, lm_batch):
    with pytest.raises(ValueError, match=r"per_sample_grads: params has a pattern that matches no parameter .*'*.nope'"):
        ns.per_sample_grads(gpt, lm_batch, params="*.nope")


def test_nan_in_the_loss_names_the_samples(gpt, lm_batch):
    with torch.no_grad():
        gpt.transformer.wte.weight[lm_batch["input_ids"][4, 0]] = float("nan")
    bad = {k: v[3:6] for k, v in lm_batch.items()}  # the NaN row is sample 1 here
    for call in (lambda: ns.empirical_ntk(gpt, bad),
                 lambda: ns.ntk_top_eigenpair(gpt, bad, method="matrix-free")):
        with pytest.raises(ValueError, match=r"batch must give a finite output for every sample; NaN/inf at samples.*1"):
            call()


def test_exact_that_cannot_fit_one_chunk(gpt, lm_batch):
    with pytest.raises(ValueError, match=r"empirical_ntk: max_memory is too small for method='exact' here: it needs "
                       r"at least \d+\.\d KiB .*\(got '1000 B'\)"):
        ns.empirical_ntk(gpt, lm_batch, method="exact", chunk_size=1, max_memory=1000)


def test_per_sample_grads_that_do_not_fit(gpt, lm_batch):
    with pytest.raises(ValueError, match=r"per_sample_grads: batch needs .* more than the .* that max_memory=.* leaves"):
        ns.per_sample_grads(gpt, lm_batch, max_memory=1000)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(method="fast"), r"empirical_ntk: method must be one of \['auto', 'exact', 'projected', 'structured'\] \(got 'fast'\)"),
    (dict(chunk_size=0), r"empirical_ntk: chunk_size must be a positive integer or None \(got 0\)"),
    (dict(reduction="mean"), r"empirical_ntk: reduction must be one of"),
    (dict(dtype="float8"), r"empirical_ntk: dtype must be None, a floating torch.dtype"),
    (dict(output="perplexity"), r"empirical_ntk: output must be one of \['loss', 'true-logit'"),
    (dict(blocks="row"), r"empirical_ntk: blocks must be one of"),
    (dict(confidence=1.5), r"empirical_ntk: confidence must be a number strictly between 0 and 1"),
])
def test_bad_options(gpt, lm_batch, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ns.empirical_ntk(gpt, lm_batch, **kwargs)


def test_gc_needs_a_scalar_output():
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="gradient_consistency: output must be a scalar output"):
        ns.gradient_consistency(model, torch.randn(4, 3), [0, 1], output="logits")


def test_causal_loss_needs_two_real_tokens(gpt, lm_batch):
    lm_batch["attention_mask"][6, 1:] = 0
    with pytest.raises(ValueError, match=r"at least 2 real tokens.*\(got \[6\]\)"):
        ns.empirical_ntk(gpt, lm_batch)


def test_batch_entries_of_different_lengths(gpt, lm_batch):
    lm_batch["attention_mask"] = lm_batch["attention_mask"][:5]
    with pytest.raises(ValueError, match="batch must have the same leading dimension in every entry"):
        ns.empirical_ntk(gpt, lm_batch)


def test_callable_with_the_wrong_shape():
    with pytest.raises(ValueError, match=r"output must be a callable returning a tensor of shape \(n,\)"):
        ns.empirical_ntk(nn.Linear(3, 2), torch.randn(4, 3), output=lambda m, b: m(b))


def test_a_model_that_is_not_a_module(lm_batch):
    with pytest.raises(ValueError, match=r"empirical_ntk: model must be a torch.nn.Module \(got 'function'\)"):
        ns.empirical_ntk(lambda x: x, lm_batch)


def test_groups_without_a_big_enough_group(gpt, lm_batch):
    with pytest.raises(ValueError, match="gradient_consistency_groups: labels has no group with at least min_count=3"):
        ns.gradient_consistency_groups(gpt, lm_batch, [0, 0, 1, 1, 2, 2, 3, 3], min_count=3)


def test_token_ids_outside_the_vocabulary_or_not_integers_are_one_line():
    """The library raised raw embedding errors for these."""
    import ntkscope as ns
    from cse_models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    cases = ((torch.tensor([[1, 2, 70, 3]]), r"token ids in \[0, 64\)"),
             (torch.tensor([[1, -2, 3, 4]]), r"token ids in \[0, 64\)"),
             (torch.tensor([[1.0, 2.0, 3.0, 4.0]]), "an integer tensor of token ids"))
    for ids, rule in cases:
        with pytest.raises(ValueError, match=rf"empirical_ntk: batch input_ids must be {rule}"):
            ns.empirical_ntk(model, {"input_ids": ids})


def test_the_default_loss_on_a_model_that_takes_no_token_ids_is_one_line():
    """A non-LM model with the default output raised a raw TypeError."""
    import ntkscope as ns

    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    with pytest.raises(ValueError, match=r"empirical_ntk: output 'loss' is a language model's loss, and this model "
                                         r"does not take token ids"):
        ns.empirical_ntk(model, torch.randn(6, 4))
    assert ns.empirical_ntk(model, torch.randn(6, 4), output="logits").matrix.shape == (6, 6)
