"""CSE, Switch or DEMix conversion inside the researcher's own training: a plain
function for any loop, and a ``transformers.TrainerCallback`` that converts at the plan's
warm-up step inside ``Trainer.train()``.

- :func:`convert_in_training`: converts an HF causal LM in place (CSE: its router fitted on
  ``fitting`` sequences; Switch / DEMix: upcycled) and moves the optimizer onto the new
  parameters *in place*: each expert takes the AdamW state of the dense parameter it was copied
  from, in that parameter's group; a parameter with no source (a Switch gate) starts empty in
  the group its kind goes to. The optimizer object, its groups and any scheduler or wrapper
  (accelerate's) stay the same, so the loop and the schedule go on.
- :class:`SparseCallback` (``Trainer(callbacks=[SparseCallback(...)])``): at the step it
  converts, and at every save after that it writes ``cse_sparse.json`` (the layout and the
  :class:`~cse_models.SparseConfig`, the step it converted at and the plan it followed) into the
  checkpoint. To resume from such a checkpoint,
  :meth:`SparseCallback.restore` rebuilds the sparse layers on the fresh model before
  ``trainer.train(resume_from_checkpoint=...)``, so Trainer loads the weights and the optimizer
  as it saved them. Trainer loads a checkpoint's tensors by the names it saved them under, while
  ``save_pretrained`` renames some for older readers (GPT-NeoX's head, ``lm_head`` saved as
  ``embed_out``): those are left at their initialisation. At the start of a resumed run the
  callback loads such tensors by transformers' own renaming rules, so a resumed GPT-NeoX
  (dense or converted) has its trained head. :meth:`SparseCallback.save` writes the converted model in
  :meth:`~cse_models.SparseHF.save_pretrained`'s format (``AutoModelForCausalLM`` reads it).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from cse_models.cse import convert_to_cse, upcycle
from cse_models.checkpointing import expert_source
from cse_models.hf import LAYOUTS, SparseHF, child_module, layout_blocks, saved_layout
from cse_models.hf_weights import named_tensors
from cse_models.model import check_expert_copies
from ntkscope.core.checks import MissingInput, UserError, fail, renamed_keys
from ntkscope.core.files import read_json_object, write_json
from ntkscope.representation.plan import plan_step

log = logging.getLogger(__name__)

SIDECAR = "cse_sparse.json"


def _group_for(name: str, param: torch.Tensor, groups: list) -> int:
    """The group of a parameter with no source: a decaying group for a matrix, else one without
    weight decay (the first group when all are alike)."""
    wants = param.dim() >= 2 and "bias" not in name and "norm" not in name.lower()
    for i, g in enumerate(groups):
        if (g.get("weight_decay", 0.0) > 0) == wants:
            return i
    return 0


@torch.no_grad()
def convert_in_training(model, optimizer, sparse: dict, *, fitting_ids: torch.Tensor | None = None,
                        fitting_mask: torch.Tensor | None = None, seed: int = 0, router: dict | None = None,
                        n_experts: int = 2, preserving: bool = True) -> SparseHF:
    """Convert ``model`` (an HF causal LM, or a :class:`SparseHF`) in place at this point of a
    training loop and move ``optimizer`` (torch's, or a wrapper with ``.optimizer``) onto the new
    parameters (module docstring). ``sparse``: {"kind": "cse" | "switch" | "demix", "layers":
    [...], ...} (:class:`~cse_models.SparseConfig`'s fields); CSE needs ``fitting_ids`` (N, T) and
    takes ``router`` (:func:`~cse_models.cse.convert_to_cse`'s options). Returns the
    :class:`SparseHF` around the model (sharing its modules)."""
    hf = model.hf if isinstance(model, SparseHF) else model
    if isinstance(model, SparseHF):
        wrapper = model
    else:
        spec = {"n_experts": [0] * len(sparse.get("layers", [])), **sparse}
        wrapper = SparseHF(hf, spec)
    kind = wrapper.config.sparse.kind
    if kind == "cse" and fitting_ids is None:
        raise UserError("convert_in_training: fitting_ids must be given for a CSE conversion (the sequences its "
                        "router clusters, (N, T) token ids)")
    opt = getattr(optimizer, "optimizer", optimizer)
    names = {id(p): n for n, p in hf.named_parameters()}
    group_of = {names[id(p)]: i for i, g in enumerate(opt.param_groups) for p in g["params"] if id(p) in names}
    state = {names[id(p)]: s for p, s in opt.state.items() if id(p) in names}
    device = next(hf.parameters()).device
    was_training = hf.training
    if kind == "cse":
        ids = fitting_ids.to(device)
        mask = None if fitting_mask is None else fitting_mask.to(device)
        convert_to_cse(wrapper, ids, mask, seed=seed, **(router or {}))
    else:
        upcycle(wrapper, n_experts, preserving=preserving)
    hf.to(device).train(was_training)
    groups = [[] for _ in opt.param_groups]
    carried = {}
    for name, p in hf.named_parameters():
        if not p.requires_grad:
            continue
        source = name if name in group_of else expert_source(name)
        groups[group_of[source] if source in group_of else _group_for(name, p, opt.param_groups)].append(p)
        if source in state:
            carried[p] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state[source].items()}
    for group, params in zip(opt.param_groups, groups):
        group["params"] = params
    opt.state.clear()
    opt.state.update(carried)
    log.info("converted to %s at layers %s: %s experts; the optimizer carries %d parameters' state to the copies",
             kind, wrapper.config.sparse.layers, wrapper.config.sparse.n_experts, len(carried))
    return wrapper


def restore(model, checkpoint) -> SparseHF | None:
    """Rebuild the sparse layers that ``checkpoint/cse_sparse.json`` names on a fresh ``model``
    (empty, ready for the checkpoint's weights), or None when the checkpoint has none (it was
    saved before the conversion)."""
    path = Path(checkpoint) / SIDECAR
    if not path.is_file():
        return None
    section = read_json_object(path, "SparseCallback.restore")
    where = f"SparseCallback.restore: {path}"
    layout = saved_layout(section, getattr(getattr(model, "config", None), "model_type", None), where)
    if "sparse" not in section:
        raise UserError(f"{where} has no sparse section (a SparseConfig's fields)")
    return SparseHF(model, section["sparse"], layout)


@torch.no_grad()
def load_renamed(model, checkpoint) -> int:
    """Load the tensors of ``checkpoint/model.safetensors`` that Trainer's resume left out, since
    they were saved under a renamed key (:func:`~cse_models.hf_weights.renamed_key`); returns how many."""
    path = Path(checkpoint) / "model.safetensors"
    if not path.is_file():
        return 0
    saved, named = named_tensors(model, path)
    own = model.state_dict()
    renamed = {key: value for key, value in named.items() if key not in saved}  # read back by a renaming
    for key, value in renamed.items():
        own[key].copy_(value)
    loaded = len(renamed)
    if loaded:
        log.info("SparseCallback: %d tensors of %s loaded by their renamed keys (Trainer's resume leaves them out)",
                 loaded, checkpoint)
    return loaded


def _state_step(checkpoint: Path) -> int | None:
    """A Trainer checkpoint's ``global_step`` (trainer_state.json), or None where it has none."""
    try:
        step = read_json_object(checkpoint / "trainer_state.json", "SparseCallback").get("global_step")
    except (UserError, OSError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _callback_base():
    from transformers import TrainerCallback  # optional: the [trainer] extra

    return TrainerCallback


def _check_fitting(fitting) -> None:
    """SparseCallback's ``fitting`` checked when the callback is made (not at the conversion step,
    after training has run): input_ids an (N, T) integer tensor of ids >= 0, N >= 2, and an
    attention_mask, when given, of the same shape holding 0 and 1 with a real token in every row."""
    def bad(what, got):
        return UserError(f"SparseCallback: fitting {what} (got {got})")

    if not isinstance(fitting, dict) or set(fitting) - {"input_ids", "attention_mask"} or "input_ids" not in fitting:
        raise bad("must be {'input_ids': (N, T) token ids[, 'attention_mask': (N, T)]}",
                  sorted(fitting) if isinstance(fitting, dict) else type(fitting).__name__)
    ids, mask = fitting["input_ids"], fitting.get("attention_mask")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        shown = f" {tuple(ids.shape)} {ids.dtype}" if isinstance(ids, torch.Tensor) else ""
        raise bad("['input_ids'] must be a 2-D integer tensor (N, T)", f"{type(ids).__name__}{shown}")
    if ids.shape[0] < 2 or ids.shape[1] < 1:
        raise bad("['input_ids'] must hold two or more sequences of one or more tokens", tuple(ids.shape))
    if int(ids.min()) < 0:
        raise bad("['input_ids'] must be token ids >= 0", f"a smallest id of {int(ids.min())}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(ids.shape):
            raise bad("['attention_mask'] must be a tensor of input_ids' shape " f"{tuple(ids.shape)}",
                      tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__)
        if not bool(((mask == 0) | (mask == 1)).all()) or not bool((mask != 0).any(dim=1).all()):
            raise bad("['attention_mask'] must hold 0 and 1 with a real token in every row",
                      f"values {sorted(set(mask.flatten().tolist()))[:5]}")


class SparseCallback(_callback_base()):
    """Convert the model at step ``convert_at`` of ``Trainer.train()`` (``plan``: a plan JSON whose
    ``convert_at`` and ``layers`` give the step and the layers when they are not given), with
    :func:`convert_in_training`'s ``kind``, ``module`` ("ffn", or "attn": MoA, CSE or DEMix),
    ``fitting`` ({"input_ids": (N, T)[, "attention_mask"]}, CSE), ``router``, ``n_experts`` and
    ``seed``; record the sparse layers in every checkpoint saved after it (module docstring).
    DEMix (``kind="demix"``, ``domains``: the label names, one expert each) routes each sequence
    by its label: the batches must carry a ``domains`` column of label indices (and
    ``TrainingArguments(remove_unused_columns=False)``, so Trainer passes it), which the model
    takes off the call before the HF forward. ``at`` is the old name of ``convert_at``: read with
    a warning, and ``callback.at`` reads ``callback.convert_at``."""

    def __init__(self, *, convert_at: int | None = None, plan=None, kind: str = "cse", layers=None,
                 fitting: dict | None = None, router: dict | None = None, n_experts: int = 2, seed: int = 0,
                 module: str = "ffn", domains=None, at: int | None = None):
        given = {k: v for k, v in (("convert_at", convert_at), ("at", at)) if v is not None}
        at = renamed_keys(given, {"at": "convert_at"}, "SparseCallback").get("convert_at")  # at: the old name
        if plan is not None:
            if not Path(plan).is_file():
                raise MissingInput(f"SparseCallback: plan {plan} does not exist (a plan JSON: ntkscope plan RUN --out "
                                   "plan.json)")
            data = read_json_object(Path(plan), "SparseCallback")
            at = at if at is not None else plan_step(data)
            layers = layers if layers is not None else data.get("layers")
        if not isinstance(at, int) or at < 1:
            raise fail("SparseCallback", "convert_at", "must be the step to convert at, a positive integer, or come "
                       "from the plan's convert_at", at)
        if not layers:
            raise UserError("SparseCallback: layers must name the blocks to make sparse (or come from plan)")
        if kind not in ("cse", "switch", "demix"):
            raise UserError(f"SparseCallback: kind must be 'cse', 'switch' or 'demix' (got {kind!r})")
        if kind == "demix" and (not isinstance(domains, (list, tuple)) or len(domains) < 2
                                or not all(isinstance(d, str) for d in domains)):
            raise UserError(f"SparseCallback: DEMix needs domains, the names of its labels (two or more; batch "
                            f"label j goes to expert j) (got {domains!r})")
        if module not in ("ffn", "attn") or (module == "attn" and kind == "switch"):
            raise UserError(f"SparseCallback: module must be 'ffn', or 'attn' with kind 'cse' or 'demix' (got "
                            f"{module!r} with {kind!r}): a Switch layer routes tokens through FFN experts")
        if kind == "switch" and (isinstance(n_experts, bool) or not isinstance(n_experts, int) or n_experts < 1):
            raise UserError(f"SparseCallback: n_experts must be a positive integer, the experts of each Switch layer "
                            f"(got {n_experts!r})")
        if kind == "cse" and not fitting:
            raise UserError("SparseCallback: fitting must hold the sequences CSE's router clusters "
                            "({'input_ids': (N, T) token ids[, 'attention_mask']})")
        if fitting:
            _check_fitting(fitting)
        self.convert_at, self.kind, self.module, self.layers = at, kind, module, [int(i) for i in layers]
        self.domains = None if domains is None else list(domains)
        self.plan = None if plan is None else str(plan)
        self.fitting, self.router, self.n_experts, self.seed = fitting, router, n_experts, seed
        self.sparse: SparseHF | None = None
        self.converted_at: int | None = None
        self.resumed: Path | None = None

    @property
    def at(self) -> int:
        """The old name of :attr:`convert_at`."""
        return self.convert_at

    def restore(self, model, checkpoint) -> SparseHF | None:
        """Before ``trainer.train(resume_from_checkpoint=checkpoint)``: the sparse layers of the
        checkpoint rebuilt on ``model`` (see :func:`restore`), remembered as converted; the
        tensors Trainer's resume leaves out are loaded when training begins (module docstring)."""
        self.sparse = restore(model, checkpoint)
        self.resumed = Path(checkpoint)
        if self.sparse is not None:
            saved = read_json_object(self.resumed / SIDECAR, "SparseCallback.restore")
            self.converted_at = saved.get("converted_at", self.convert_at)
        return self.sparse

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        """Refuse layers the model does not have before training starts, not at the warm-up; on a
        resume (after :meth:`restore`, or from this output folder's checkpoint of the step), load
        what Trainer's resume left out."""
        step, folder = getattr(state, "global_step", 0) or 0, getattr(args, "output_dir", None)
        own = None if folder is None else Path(folder) / f"checkpoint-{step}"  # where a resume in this folder began
        if own is not None and _state_step(own) != step:  # not this step's checkpoint (renamed, or another run's)
            own = None
        resumed = self.resumed if self.resumed is not None else own if step > 0 and own else None
        if resumed is not None and self.sparse is None and (resumed / SIDECAR).is_file():
            raise UserError(f"SparseCallback: the run resumes from {resumed}, saved after the conversion, into a "
                            "dense model; call callback.restore(model, that checkpoint) before trainer.train("
                            "resume_from_checkpoint=...), so that its sparse layers are rebuilt first")
        if resumed is not None and model is not None:
            load_renamed(model, resumed)
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        ids = (self.fitting or {}).get("input_ids")
        if isinstance(vocab, int) and ids is not None and int(ids.max()) >= vocab:  # before training, not at `at`
            raise UserError(f"SparseCallback: fitting['input_ids'] must be token ids of this model's vocabulary "
                            f"[0, {vocab}) (got ids up to {int(ids.max())})")
        n_layer = getattr(getattr(model, "config", None), "num_hidden_layers", None)
        if n_layer is not None and any(not 0 <= i < n_layer for i in self.layers):
            raise UserError(f"SparseCallback: layers must be block indices in [0, {n_layer}) for this "
                            f"{n_layer}-layer model (got {self.layers})")
        layout = LAYOUTS.get(getattr(getattr(model, "config", None), "model_type", None))
        if self.kind == "switch" and self.sparse is None and layout is not None:  # copies sized now, not at step `at`
            blocks = layout_blocks(model, layout)
            check_expert_copies([(child_module(blocks[i], layout.ffn), self.n_experts) for i in self.layers],
                                f"SparseCallback: n_experts {self.n_experts} at layers {self.layers}")
        if self.convert_at > args.max_steps > 0:
            log.warning("SparseCallback: the run stops at step %d, before the conversion at step %d", args.max_steps,
                        self.convert_at)

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        """A run resumed at or after the step from a checkpoint saved before the conversion (a
        dense one): convert before its first step, so that it trains as the uninterrupted run
        would from the step on (later than planned when the checkpoint is later: logged)."""
        if self.sparse is None and state.global_step >= self.convert_at:
            if state.global_step > self.convert_at:
                log.warning("SparseCallback: the run resumed at step %d, after the conversion step %d, from a dense "
                            "checkpoint: converting now, at step %d", state.global_step, self.convert_at,
                            state.global_step)
            self._convert(model, optimizer, state.global_step)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.sparse is None and state.global_step == self.convert_at:
            self._convert(model, optimizer, state.global_step)

    def _convert(self, model, optimizer, step: int) -> None:
        fitting = self.fitting or {}
        self.sparse = convert_in_training(
            model, optimizer, {"kind": self.kind, "module": self.module, "layers": self.layers,
                               **({"domains": self.domains} if self.kind == "demix" else {})},
            fitting_ids=fitting.get("input_ids"),
            fitting_mask=fitting.get("attention_mask"), seed=self.seed, router=self.router,
            n_experts=self.n_experts)
        self.converted_at = step

    def on_save(self, args, state, control, **kwargs):
        """A checkpoint saved after the conversion: the sidecar for :meth:`restore`, and the sparse
        ``config.json`` (:meth:`~cse_models.SparseHF.config_json`), so that transformers' Auto
        classes load it as the sparse model (after ``import cse_models``) and a plain
        transformers class refuses it; its weights stay under Trainer's names, which
        :func:`~cse_models.load_hf` reads."""
        if self.sparse is not None:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if not folder.is_dir():
                return
            write_json(folder / SIDECAR, {**self.sparse.config.section(), "converted_at": self.converted_at,
                                          "planned_at": self.convert_at, "plan": self.plan})
            write_json(folder / "config.json", self.sparse.config_json())

    def save(self, directory) -> Path:
        """The converted model in :meth:`~cse_models.SparseHF.save_pretrained`'s format."""
        if self.sparse is None:
            raise UserError(f"SparseCallback.save: the model was not converted (the run did not reach step "
                            f"{self.convert_at})")
        return self.sparse.save_pretrained(directory)

