"""The kernel stage: which parameters -> per-sample gradients -> empirical NTK -> top eigenpair -> primary
gradient direction -> gradient consistency (docs/design.md §1). Works on any ``nn.Module``; how each quantity is
computed is a row of :mod:`ntkscope.kernel.methods`, and every option is a field of :class:`~ntkscope.KernelOptions`."""
