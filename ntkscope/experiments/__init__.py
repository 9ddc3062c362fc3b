"""Experiments as specs: arms x seeds x steps as units, run through an existing executor
(concurrent.futures, submitit, Slurm), resumable, with status and tables as they finish."""

from ntkscope.experiments.runner import Outcome, run_experiment, status, summarise_experiment
from ntkscope.experiments.spec import Spec, SpecError, load_spec, parse_spec, shipped
from ntkscope.experiments.units import Unit, units

__all__ = ["Outcome", "Spec", "SpecError", "Unit", "load_spec", "parse_spec", "run_experiment", "shipped", "status",
           "summarise_experiment", "units"]
