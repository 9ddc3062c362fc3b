"""What ``f(x; theta)`` is: the per-sample output that the Jacobian differentiates.

An objective turns a user's batch into *prepared data* (a dict of tensors whose
leading dimension is the sample index) once, outside any gradient transform, and
then evaluates ``f`` on any slice of it::

    data = objective.prepare(batch)                  # {"inputs": ..., "aux": {...}}
    y = objective.evaluate(run, take(data, rows))    # (m,) scalar outputs, or (m, K)

``run(inputs)`` is the model's forward with the parameters being differentiated.
Evaluating on a slice of one sample gives that sample's output, so the same
definition serves ``vmap(grad(...))`` per-sample gradients and the batched
VJP/JVP of the matrix-free path.

Outputs (docs/design.md §1):

- ``"loss"`` / :class:`LMLoss`: the sequence's mean token cross-entropy. Causal
  LM: next-token loss over pairs of real tokens. Masked LM: loss on a masked set
  chosen by a seeded RNG keyed on the sample's tokens, so ``f`` is a function of
  the sample. Padding never counts. Shape ``(n,)``.
- ``"true-logit"`` / ``"centred-true-logit"``: the same positions and mean, of the true
  token's logit (minus the mean logit over the vocabulary, for the centred one). Every
  per-token value registered in :data:`ntkscope.core.lm.TOKEN_VALUES`
  (:func:`~ntkscope.core.lm.register_token_value`) is such an output. Shape ``(n,)``.
- ``"logits"``: the model's output; ``(n, K)`` as is, ``(n, T, V)`` averaged over
  real tokens to ``(n, V)``. ``"hidden-mean"``: the last hidden state averaged
  over real tokens, ``(n, d)`` (encoders without a head).
- a callable ``fn(model, batch) -> Tensor (n,)``, applied per sample.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from ntkscope.core.checks import InputError, check_choice, check_fraction, check_positive_int, entry
from ntkscope.core.lm import TOKEN_VALUES, causal_targets, masked_mean, token_values

_NON_MODEL_KEYS = ("labels", "label")
SCALAR_OUTPUTS = TOKEN_VALUES  # the registry itself: a value registered later is an output too
VECTOR_OUTPUTS = ("logits", "hidden-mean")


class _Outputs(Mapping):
    """The outputs by name, read when asked (so a token value registered after import is one):
    True for scalar (one value per sample: :data:`SCALAR_OUTPUTS`), False for vector."""

    def __getitem__(self, name):
        if name in SCALAR_OUTPUTS:
            return True
        if name in VECTOR_OUTPUTS:
            return False
        raise KeyError(name)

    def __iter__(self):
        return iter([*SCALAR_OUTPUTS, *VECTOR_OUTPUTS])

    def __len__(self):
        return len(SCALAR_OUTPUTS) + len(VECTOR_OUTPUTS)


#: the outputs by name: True for scalar (one value per sample), False for vector
OUTPUTS = _Outputs()


@dataclass(frozen=True)
class LMLoss:
    """A language model's per-sequence scalar: by default the mean token cross-entropy
    (``output="loss"``); ``value`` picks the true token's logit instead.

    Parameters
    ----------
    value : {"loss", "true-logit", "centred-true-logit"} or another registered token value
        The per-token value averaged over the sequence's predicted positions
        (``output="true-logit"`` is ``LMLoss(value="true-logit")``).
    objective : {"auto", "causal", "masked"}
        ``"auto"`` tells a causal model from a bidirectional one by whether the
        first position's output changes when a later token does.
    mask_token_id : int, optional
        Masked LM only: the id written at masked positions (BERT: 103). Read from
        ``model.config.mask_token_id`` when present.
    mask_prob : float
        Masked LM only: fraction of each sequence's real tokens masked (at least one).
    seed : int
        Masked LM only: the mask of a sample is a function of (seed, its tokens).
    """

    objective: str = "auto"
    mask_token_id: int | None = None
    mask_prob: float = 0.15
    seed: int = 0
    value: str = "loss"

    @entry("LMLoss")
    def __post_init__(self):
        check_choice("objective", self.objective, {"auto", "causal", "masked"})
        check_choice("value", self.value, TOKEN_VALUES)
        check_fraction("mask_prob", self.mask_prob)


def primary_output(out, *, want: str = "logits") -> torch.Tensor:
    """The tensor of a model's return value: itself, ``.logits``, ``.last_hidden_state`` or ``[0]``."""
    if torch.is_tensor(out):
        return out
    if want == "hidden" and getattr(out, "last_hidden_state", None) is not None:
        return out.last_hidden_state
    for attr in ("logits", "last_hidden_state"):
        value = getattr(out, attr, None)
        if value is not None:
            return value
    if isinstance(out, Mapping):
        for key in ("logits", "last_hidden_state"):
            if key in out:
                return out[key]
    if isinstance(out, (tuple, list)) and out and torch.is_tensor(out[0]):
        return out[0]
    raise TypeError(f"cannot find a tensor in the model's output of type {type(out).__name__}")


def call_model(model: nn.Module, inputs):
    """``model(inputs)`` for a tensor, ``model(**inputs)`` for a dict."""
    return model(**inputs) if isinstance(inputs, Mapping) else model(inputs)


def is_huggingface(model: nn.Module) -> bool:
    return any(c.__module__.startswith("transformers.") for c in type(model).__mro__)


@torch.no_grad()
def is_causal(model: nn.Module) -> bool:
    """Whether the first positions' outputs ignore a later token (probed on two 4-token inputs that
    differ in the last). Equal to float rounding: a mixture's experts gather the tokens routed to
    them, and a matrix product over another number of rows may round differently."""
    device = next(model.parameters()).device
    a = torch.tensor([[1, 2, 3, 4]], device=device)
    b = torch.tensor([[1, 2, 3, 1]], device=device)
    ya = primary_output(call_model(model, {"input_ids": a}))
    yb = primary_output(call_model(model, {"input_ids": b}))
    tol = 64 * torch.finfo(ya.dtype).eps * max(1.0, float(ya.abs().max())) if ya.is_floating_point() else 0
    return bool(torch.allclose(ya[:, :3], yb[:, :3], rtol=0, atol=tol, equal_nan=True))


def hf_mask_4d(mask: torch.Tensor, causal: bool) -> torch.Tensor:
    """(n, T) 0/1 padding mask -> (n, 1, T, T) bool "may attend" mask.

    HF models branch on the values of a 2-D mask (``.item()``), which ``vmap``
    cannot trace; a 4-D mask is used as given. Real queries attend to real keys (earlier
    ones, when causal); a pad query attends to itself only, so that no softmax row is empty
    and the padding stays readable from the mask (a sparse layer routes each sequence by its
    real tokens: :func:`cse_models.hf.key_padding_mask`). Equal to HF's own masking at every
    real position.
    """
    n, T = mask.shape
    real = mask.bool()
    allowed = real[:, None, :, None] & real[:, None, None, :]
    if causal:
        allowed = allowed & torch.ones(T, T, dtype=torch.bool, device=mask.device).tril()
    return allowed | torch.eye(T, dtype=torch.bool, device=mask.device)


class LossRecorder:
    """Each sample's loss as a language-model objective evaluates it, kept by row: the covariate
    of the loss-matched null, read from a kernel's own forward instead of a forward of its own.

    While attached (``objective.recorder = LossRecorder(n)``), :class:`CausalLMLoss` and
    :class:`MaskedLMLoss` keep the loss of the rows of each evaluation (under the same
    objective and mask, the value ``"loss"``, no graph); whoever ran the evaluation on rows
    ``first:first + c`` files it with :meth:`put` (the structured kernel's capture does)."""

    def __init__(self, n: int):
        self.loss = np.full(n, np.nan)
        self.pending: torch.Tensor | None = None

    def keep(self, loss: torch.Tensor) -> None:
        self.pending = loss.detach()

    def put(self, first: int, c: int) -> None:
        """File the last evaluation's losses as rows ``first:first + c`` (nothing if it had none or other rows)."""
        if self.pending is not None and self.pending.shape == (c,):
            self.loss[first : first + c] = self.pending.double().cpu().numpy()
        self.pending = None

    def values(self) -> np.ndarray | None:
        """The (n,) losses, or None while a row has none."""
        return self.loss.copy() if np.isfinite(self.loss).all() else None


class Objective(ABC):
    """Base: ``prepare(batch) -> data`` once, then ``evaluate(run, data) -> (m,) or (m, K)``."""

    name = "objective"
    scalar = True
    recorder: LossRecorder | None = None  # language-model objectives keep each evaluation's loss there

    @abstractmethod
    def prepare(self, model: nn.Module, batch) -> dict:
        """Validate ``batch`` and return ``{"inputs": ..., "aux": {...}}`` with leading dim n."""

    @abstractmethod
    def evaluate(self, run: Callable, data: dict) -> torch.Tensor:
        """``f`` on prepared rows: (m,) for scalar outputs, (m, K) for vector outputs."""


def _check_ids(model: nn.Module, ids: torch.Tensor) -> None:
    """Token ids must be integers in the model's vocabulary (else an embedding lookup fails deep inside)."""
    if not torch.is_tensor(ids) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise InputError("batch", "input_ids must be an integer tensor of token ids",
                         getattr(ids, "dtype", type(ids).__name__))
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embedding is None:
        embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
        embedding = embeddings[0] if embeddings else None
    if ids.numel() and embedding is not None and (int(ids.min()) < 0 or int(ids.max()) >= embedding.num_embeddings):
        raise InputError("batch", f"input_ids must be token ids in [0, {embedding.num_embeddings}) (the model's "
                         "vocabulary)", f"ids from {int(ids.min())} to {int(ids.max())}")


def _token_inputs(model: nn.Module, batch, *, need_ids: bool) -> tuple:
    """Split a batch into model inputs and the (n, T) bool mask of real tokens."""
    if torch.is_tensor(batch):
        if need_ids and (batch.dim() != 2 or batch.is_floating_point()):
            raise InputError("batch", "must be integer token ids of shape (n, T) for a language-model output", tuple(batch.shape))
        mask = torch.ones(batch.shape[:2], dtype=torch.bool, device=batch.device) if batch.dim() >= 2 else None
        if need_ids:
            _check_ids(model, batch)
        return batch, mask
    inputs = {k: v for k, v in batch.items() if k not in _NON_MODEL_KEYS}
    if need_ids and "input_ids" not in inputs:
        raise InputError("batch", "must have an 'input_ids' entry for a language-model output", sorted(batch))
    ids = inputs.get("input_ids")
    if ids is not None:
        _check_ids(model, ids)
    mask = inputs.get("attention_mask")
    if mask is not None:
        mask = mask.bool()
    elif ids is not None:
        mask = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    if is_huggingface(model) and inputs.get("attention_mask") is not None and inputs["attention_mask"].dim() == 2:
        inputs["attention_mask"] = hf_mask_4d(inputs["attention_mask"], is_causal(model))
    return inputs, mask


class CausalLMLoss(Objective):
    def __init__(self, value: str = "loss"):
        self.name = value

    def prepare(self, model, batch):
        inputs, mask = _token_inputs(model, batch, need_ids=True)
        ids = inputs if torch.is_tensor(inputs) else inputs["input_ids"]
        pairs = (mask[:, 1:] & mask[:, :-1]).sum(1)
        if bool((pairs == 0).any()):
            bad = torch.nonzero(pairs == 0).flatten().tolist()[:5]
            raise InputError("batch", "must give every sample at least 2 real tokens for a causal LM loss; samples without", bad)
        return {"inputs": inputs, "aux": {"targets": ids, "mask": mask}}

    def evaluate(self, run, data):
        logits = primary_output(run(data["inputs"]))  # (m, T, V)
        targets, keep = causal_targets(data["aux"]["targets"], data["aux"]["mask"])
        values = token_values(logits, targets, keep, value=self.name)  # (m,)
        if self.recorder is not None:
            with torch.no_grad():
                self.recorder.keep(values if self.name == "loss" else token_values(logits, targets, keep, value="loss"))
        return values


class MaskedLMLoss(Objective):
    def __init__(self, spec: LMLoss, mask_token_id: int):
        self.spec = spec
        self.name = spec.value
        self.mask_token_id = mask_token_id

    def prepare(self, model, batch):
        inputs, mask = _token_inputs(model, batch, need_ids=True)
        ids = inputs if torch.is_tensor(inputs) else inputs["input_ids"]
        masked = torch.zeros_like(mask)
        ids_np, mask_np = ids.cpu().numpy(), mask.cpu().numpy()
        for i in range(ids_np.shape[0]):
            real = np.flatnonzero(mask_np[i])
            if real.size == 0:
                raise InputError("batch", "must give every sample at least 1 real token for a masked LM loss; sample", i)
            key = zlib.crc32(np.ascontiguousarray(ids_np[i, real], dtype=np.int64).tobytes())
            rng = np.random.default_rng([self.spec.seed, key])
            k = max(1, int(round(self.spec.mask_prob * real.size)))
            masked[i, torch.as_tensor(rng.choice(real, size=k, replace=False))] = True
        corrupted = torch.where(masked, torch.full_like(ids, self.mask_token_id), ids)
        if torch.is_tensor(inputs):
            inputs = corrupted
        else:
            inputs = dict(inputs, input_ids=corrupted)
        return {"inputs": inputs, "aux": {"targets": ids, "mask": masked}}

    def evaluate(self, run, data):
        logits = primary_output(run(data["inputs"]))  # (m, T, V)
        targets, keep = data["aux"]["targets"], data["aux"]["mask"]
        values = token_values(logits, targets, keep, value=self.name)  # (m,)
        if self.recorder is not None:
            with torch.no_grad():
                self.recorder.keep(values if self.name == "loss" else token_values(logits, targets, keep, value="loss"))
        return values


class VectorOutput(Objective):
    """``"logits"`` or ``"hidden-mean"``: a vector per sample, K = its length."""

    scalar = False

    def __init__(self, kind: str):
        self.name = kind

    def prepare(self, model, batch):
        inputs, mask = _token_inputs(model, batch, need_ids=False)
        return {"inputs": inputs, "aux": {} if mask is None else {"mask": mask}}

    def evaluate(self, run, data):
        out = primary_output(run(data["inputs"]), want="hidden" if self.name == "hidden-mean" else "logits")
        if out.dim() == 1:
            return out[:, None]
        if out.dim() == 2:
            return out
        flat = out.reshape(out.shape[0], out.shape[1], -1)  # (m, T, K)
        return masked_mean(flat, data["aux"].get("mask"))  # (m, K)


class CallableOutput(Objective):
    """A user's ``fn(model, batch) -> Tensor (n,)``; the engine wraps the model to differentiate it."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.name = getattr(fn, "__name__", "callable")

    def prepare(self, model, batch):
        n = batch_size(batch)
        probe_rows = min(n, 2)
        if isinstance(self.fn, nn.Module) or hasattr(self.fn, "encode"):  # a model or a tokenizer given as output=
            raise InputError("output", "must be a callable fn(model, batch) -> tensor of shape (n,) or an output name, "
                             "not a model or a tokenizer", type(self.fn).__name__)
        try:  # the first call of the user's function: one that does not take (model, batch) fails here
            with torch.no_grad():
                y = self.fn(model, take(batch, slice(0, probe_rows)))
        except TypeError as err:  # anything else it raises is the user's function's own error, as it is
            said = str(err).splitlines()[0][:120] if str(err) else ""
            raise InputError("output", f"must be a callable fn(model, batch) -> tensor of shape (n,); on {probe_rows} "
                             f"samples it raised TypeError: {said}", type(self.fn).__name__) from err
        if not torch.is_tensor(y) or tuple(y.shape) != (probe_rows,):
            raise InputError("output", f"must be a callable returning a tensor of shape (n,) (for {probe_rows} samples)",
                       tuple(y.shape) if torch.is_tensor(y) else type(y).__name__)
        return {"inputs": batch, "aux": {}}

    def evaluate(self, run, data):
        return run(data["inputs"])


class CallableModule(nn.Module):
    """``forward(batch) = fn(model, batch)``: lets ``functional_call`` swap the model's parameters."""

    def __init__(self, model: nn.Module, fn: Callable):
        super().__init__()
        self.model = model
        self.fn = fn

    def forward(self, batch):
        return self.fn(self.model, batch)


def resolve_output(output, model: nn.Module) -> Objective:
    """Turn the user's ``output=`` into an :class:`Objective`."""
    if isinstance(output, str):
        if output in SCALAR_OUTPUTS:
            output = LMLoss(value=output)
        elif output in VECTOR_OUTPUTS:
            return VectorOutput(output)
        else:
            raise InputError("output", f"must be one of {list(OUTPUTS)}, an LMLoss or a callable", output)
    if isinstance(output, LMLoss):
        objective = output.objective
        if objective == "auto":
            try:
                objective = "causal" if is_causal(model) else "masked"
            except (TypeError, RuntimeError, IndexError, ValueError) as err:  # it does not take token ids
                raise InputError("output", f"{output.value!r} is a language model's loss, and this model does not "
                                 "take token ids (input_ids); give output='logits' (a vector output) or a callable "
                                 f"({type(err).__name__}: {str(err).splitlines()[0][:80]})",
                                 type(model).__name__) from None
        if objective == "causal":
            return CausalLMLoss(output.value)
        token = output.mask_token_id
        if token is None:
            token = getattr(getattr(model, "config", None), "mask_token_id", None)
        if token is None:
            raise InputError("output", "needs mask_token_id for a masked (bidirectional) model: pass "
                       "output=LMLoss(objective='masked', mask_token_id=...)", output)
        return MaskedLMLoss(output, int(token))
    if callable(output):
        return CallableOutput(output)
    raise InputError("output", f"must be one of {list(OUTPUTS)}, an LMLoss or a callable", type(output).__name__)


# ---- batches: a tensor or a dict of tensors, all with leading dimension n ----------------------


def batch_size(batch, arg: str = "batch") -> int:
    """n, after checking that every tensor of the batch has the same leading dimension."""
    if torch.is_tensor(batch):
        if batch.dim() == 0:
            raise InputError(arg, "must have a leading sample dimension", tuple(batch.shape))
        n = batch.shape[0]
    elif isinstance(batch, Mapping):
        sizes = {k: v.shape[0] for k, v in batch.items() if torch.is_tensor(v) and v.dim() > 0}
        if not sizes:
            raise InputError(arg, "must be a tensor or a dict of tensors", sorted(batch))
        if len(set(sizes.values())) > 1:
            raise InputError(arg, "must have the same leading dimension in every entry", sizes)
        n = next(iter(sizes.values()))
    else:
        raise InputError(arg, "must be a tensor or a dict of tensors", type(batch).__name__)
    if n == 0:
        raise InputError(arg, "must hold at least one sample", 0)
    return int(n)


def take(tree, rows):
    """Rows ``rows`` (a slice or index tensor) of every tensor in a nested dict."""
    if torch.is_tensor(tree):
        return tree[rows]
    if isinstance(tree, Mapping):
        return {k: take(v, rows) for k, v in tree.items()}
    return tree


def to_device_dtype(tree, device, dtype):
    """Move tensors to ``device``; cast floating tensors to ``dtype``."""
    if torch.is_tensor(tree):
        tree = tree.to(device)
        return tree.to(dtype) if tree.is_floating_point() else tree
    if isinstance(tree, Mapping):
        return {k: to_device_dtype(v, device, dtype) for k, v in tree.items()}
    return tree


@entry("sample_outputs")
@torch.no_grad()
def sample_outputs(model: nn.Module, batch, *, output="loss", chunk_size: int = 64) -> torch.Tensor:
    """``f`` of every sample, evaluated without gradients (the loss GC differentiates, e.g. for
    per-sentence perplexity ``exp(f)``): (n,) for scalar outputs, (n, K) otherwise."""
    if not isinstance(model, nn.Module):
        raise InputError("model", "must be a torch.nn.Module", type(model).__name__)
    check_positive_int("chunk_size", chunk_size)
    n = batch_size(batch)
    objective = resolve_output(output, model)
    was_training = model.training
    model.eval()
    try:
        data = objective.prepare(model, batch)
        parts = [objective.evaluate(lambda inputs: call_model(model, inputs), take(data, slice(i, i + chunk_size)))
                 for i in range(0, n, chunk_size)]
    finally:
        model.train(was_training)
    return torch.cat(parts)
