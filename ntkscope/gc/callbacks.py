"""A :class:`~ntkscope.GCTracker` inside a Hugging Face ``Trainer`` (``transformers`` stays an
optional dependency: this module is imported only when :class:`GCCallback` is asked for)."""

from __future__ import annotations

from ntkscope.core.checks import MissingPackage, fail
from ntkscope.gc.tracker import GCTracker, _check_model, _check_step

try:
    from transformers import TrainerCallback
except ImportError as err:  # pragma: no cover - the hf extra is part of dev
    raise MissingPackage("GCCallback needs transformers: pip install 'ntkscope[hf]'") from err


class GCCallback(TrainerCallback):
    """Calls ``tracker`` after every optimizer step of a ``transformers.Trainer``, on the main
    process, with the model as it is at ``state.global_step`` (the weights a checkpoint saved at
    that step holds)::

        tracker = GCTracker(Probes.load(data, tokenizer, n=128), every=100, out="run/track")
        Trainer(model, args, train_dataset=..., callbacks=[GCCallback(tracker)]).train()
    """

    def __init__(self, tracker: GCTracker):
        if not isinstance(tracker, GCTracker):
            raise fail("GCCallback", "tracker", "must be a GCTracker", type(tracker).__name__)
        self.tracker = tracker

    def on_train_begin(self, args, state, control, **kwargs):
        world_size = getattr(args, "world_size", None)
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise fail("GCCallback.on_train_begin", "args", "must be the Trainer's TrainingArguments (with an integer "
                       "world_size)", type(args).__name__)
        if args.world_size > 1:  # every rank refuses before the first step, so none waits on another
            raise fail("GCCallback", "world_size", "must be 1: the tracker runs in single-process training "
                       "(measure a data-parallel run's checkpoints afterwards with ntkscope gc RUN_DIR)",
                       args.world_size)
        return control

    def on_step_end(self, args, state, control, model=None, **kwargs):
        """Probe (on the main process) when the Trainer's ``state.global_step`` is a multiple of the
        tracker's ``every``; the Trainer passes ``model=``, the module it trains."""
        _check_model("GCCallback.on_step_end", model)
        _check_step("GCCallback.on_step_end", getattr(state, "global_step", None), "state.global_step")
        if state.is_world_process_zero:
            self.tracker.step(model, state.global_step)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.tracker.close()
        return control
