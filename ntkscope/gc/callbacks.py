"""A GC tracker inside a Hugging Face ``Trainer``: a fixed probe set (:class:`~ntkscope.GCTracker`)
or the training batch's own subsets (:class:`~ntkscope.InRunTracker`, in-run GC). ``transformers``
stays an optional dependency: this module is imported only when :class:`GCCallback` is asked for."""

from __future__ import annotations

import torch

from ntkscope.core.checks import MissingPackage, fail
from ntkscope.core.columns import batch_columns
from ntkscope.gc.inrun import InRunTracker
from ntkscope.gc.tracker import GCTracker, check_model, check_step

try:
    from transformers import TrainerCallback
except ImportError as err:  # pragma: no cover - the hf extra is part of dev
    raise MissingPackage("GCCallback needs transformers: pip install 'ntkscope[hf]'") from err


class GCCallback(TrainerCallback):
    """A GC tracker in a ``transformers.Trainer``, on the main process.

    With a :class:`~ntkscope.GCTracker`, it probes after every optimizer step whose
    ``state.global_step`` is a multiple of the tracker's ``every``, with the model as it is then
    (the weights a checkpoint saved at that step holds)::

        tracker = GCTracker(Probes.load(data, tokenizer, n=128), every=100, out="run/track")
        Trainer(model, args, train_dataset=..., callbacks=[GCCallback(tracker)]).train()

    With an :class:`~ntkscope.InRunTracker` (in-run GC: the batch's own subsets, from the step's
    own forward and backward), it reads each batch's group labels from the column
    ``label_column`` of the training data (integer labels, ``names`` to name them), which the
    model's call gives up before its forward; Trainer passes it with
    ``TrainingArguments(remove_unused_columns=False)``. Each sample's loss terms come from the
    batch's ``labels``, so the rows are those of the mean token loss (``output="loss"``). With
    gradient accumulation, the last micro-batch of each step is measured::

        tracker = InRunTracker(every=10, out="run/inrun")
        Trainer(model, args, train_dataset=rows_with_a_domains_column,
                callbacks=[GCCallback(tracker, label_column="domains")]).train()
    """

    def __init__(self, tracker: GCTracker | InRunTracker, *more: GCTracker | InRunTracker,
                 label_column: str = "domains", names=None):
        for each in (tracker, *more):
            if not isinstance(each, (GCTracker, InRunTracker)):
                raise fail("GCCallback", "tracker", "must be a GCTracker or an InRunTracker", type(each).__name__)
        if len({id(t) for t in (tracker, *more)}) != 1 + len(more):
            raise fail("GCCallback", "tracker", "must be given once each (a tracker twice would measure twice)",
                       f"{1 + len(more)} trackers")
        if not isinstance(label_column, str) or not label_column:
            raise fail("GCCallback", "label_column", "must name the training data's column of group labels",
                       label_column)
        if names is not None and (not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names)):
            raise fail("GCCallback", "names", "must be a list of label names (label j is names[j])", names)
        self.tracker, self.trackers = tracker, (tracker, *more)
        self.label_column, self.names = label_column, None if names is None else list(names)
        self._columns = None  # the model's BatchColumns (in-run GC)
        self._causal = True

    @property
    def in_run(self) -> bool:
        """Whether one of its trackers is an in-run one (it reads the batches' labels)."""
        return any(isinstance(t, InRunTracker) for t in self.trackers)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        world_size = getattr(args, "world_size", None)
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise fail("GCCallback.on_train_begin", "args", "must be the Trainer's TrainingArguments (with an integer "
                       "world_size)", type(args).__name__)
        if args.world_size > 1:  # every rank refuses before the first step, so none waits on another
            raise fail("GCCallback", "world_size", "must be 1: the tracker runs in single-process training "
                       "(measure a data-parallel run's checkpoints afterwards with ntkscope gc RUN_DIR)",
                       args.world_size)
        if self.in_run:
            check_model("GCCallback.on_train_begin", model)
            if getattr(args, "remove_unused_columns", False):
                raise fail("GCCallback", "args.remove_unused_columns", "must be False for in-run GC: Trainer would "
                           f"drop the {self.label_column!r} column the batch's groups come from", True)
            for tracker in self.trackers:
                if isinstance(tracker, InRunTracker):
                    tracker.begin(model)
            self._causal = "MaskedLM" not in type(model).__name__
            self._columns = batch_columns(model, self.label_column)
        return control

    def on_step_end(self, args, state, control, model=None, **kwargs):
        """Probe, or read the step's in-run GC, on the main process at ``state.global_step``; the
        Trainer passes ``model=``, the module it trains."""
        check_model("GCCallback.on_step_end", model)
        check_step("GCCallback.on_step_end", getattr(state, "global_step", None), "state.global_step")
        if not state.is_world_process_zero:
            return control
        if self.in_run:  # the step's own factors first, then the probes (eval mode: never recorded)
            self._in_run_step(model, state.global_step)
        for tracker in self.trackers:
            if not isinstance(tracker, InRunTracker):
                tracker.step(model, state.global_step)
        return control

    def _in_run_step(self, model, step: int) -> None:
        if self._columns.training.get(self.label_column) is None:
            raise fail("GCCallback.on_step_end", self.label_column, "must be a column of the training batches for "
                       "in-run GC (TrainingArguments(remove_unused_columns=False) keeps it; text labels do not "
                       "collate: give integer labels and their names with names=[...])",
                       f"a batch with the columns {sorted(self._columns.training)}")
        else:
            batch = self._columns.training
            labels = batch[self.label_column]
            labels = labels.tolist() if torch.is_tensor(labels) else list(labels)
            labels = labels if self.names is None else [self.names[int(i)] for i in labels]
            terms = None
            if torch.is_tensor(batch.get("labels")):  # each sample's loss terms (causal: the shifted targets)
                targets = batch["labels"][:, 1:] if self._causal else batch["labels"]
                terms = (targets != -100).sum(1).clamp(min=1).cpu()
            for tracker in self.trackers:
                if isinstance(tracker, InRunTracker):
                    tracker.step(model, step, labels, loss_terms=terms)

    def on_train_end(self, args, state, control, **kwargs):
        if self._columns is not None:
            self._columns.release(self.label_column)
            self._columns = None
        for tracker in self.trackers:
            tracker.close()
        return control
