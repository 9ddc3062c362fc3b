"""Gradient consistency of subsets of analysis sentences: frequency bins, labels and the long
tail with their nulls, at one checkpoint (:mod:`ntkscope.gc.groups`), and inside a training loop
(:mod:`ntkscope.gc.tracker`, :mod:`ntkscope.gc.callbacks`: fixed probes every k steps;
:mod:`ntkscope.gc.inrun`: the training batch's own subsets, from the step's backward). It sits below ``cse_models``, whose
trainer runs the tracker, and above the kernel."""
