"""Act on what was measured: model transforms, :func:`optimize`, :class:`TrainStep` and
DataLoader tuning.

Each transform is a plain function, ``apply_<x>(model, ...) -> model``, that changes the model in
place (``state_dict`` keys stay the same) and warns with :class:`perfsdk.NoEffectWarning`, leaving
the model unchanged, where it cannot help. :func:`optimize` applies a chosen set, or with
``auto=True`` measures the candidates and keeps the fastest one that still computes the same
thing, and reports what each bought.
"""

from perfsdk.optimize._marks import applied, fallbacks, region_attributes
from perfsdk.optimize.amp import apply_amp
from perfsdk.optimize.backends import backend_flags, restore_backends, set_backends
from perfsdk.optimize.channels_last import apply_channels_last
from perfsdk.optimize.checkpoint import apply_checkpointing
from perfsdk.optimize.compile import apply_compile
from perfsdk.optimize.cuda_graphs import apply_cuda_graphs
from perfsdk.optimize.dataloader import DataLoaderTuning, tune_dataloader
from perfsdk.optimize.report import OptimizationReport, StepResult
from perfsdk.optimize.search import optimize
from perfsdk.optimize.train_step import TrainStep

__all__ = (
    "DataLoaderTuning",
    "OptimizationReport",
    "StepResult",
    "TrainStep",
    "applied",
    "apply_amp",
    "apply_channels_last",
    "apply_checkpointing",
    "apply_compile",
    "apply_cuda_graphs",
    "backend_flags",
    "fallbacks",
    "optimize",
    "region_attributes",
    "restore_backends",
    "set_backends",
    "tune_dataloader",
)
