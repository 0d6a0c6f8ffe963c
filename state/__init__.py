"""Training state: pure data and torch, no I/O policy (see README, "Architecture").

Everything a preempted job must carry into its next life: model and optimizer state, progress counters,
RNG streams, metric accumulators and the data position, in a checkpoint ``torch.load(weights_only=True)`` reads.
"""

from state.evaluator import Evaluator
from state.exceptions import PrecisionError, StateError
from state.precision import Precision, default_precision_context
from state.rng import SEED_LIMIT, capture_rng, restore_rng, seed_all
from state.sampler import GlobalBatchSampler, ResumableBatchSampler
from state.serializable import Serializable
from state.state import State
from state.time import TIMER_LIMIT, Time, Timer, TimeUnit

__all__ = [
    "SEED_LIMIT",
    "TIMER_LIMIT",
    "Evaluator",
    "Precision",
    "PrecisionError",
    "GlobalBatchSampler",
    "ResumableBatchSampler",
    "Serializable",
    "State",
    "StateError",
    "Time",
    "TimeUnit",
    "Timer",
    "capture_rng",
    "default_precision_context",
    "restore_rng",
    "seed_all",
]
