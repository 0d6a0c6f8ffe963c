"""The training state: everything a preempted job needs to continue as if it had never stopped.

Modelled on MosaicML Composer's ``State`` (v0.5/v0.6): the same attributes, the same checkpoint layout and
the same tolerance of older checkpoints (the ``state`` entry of a Composer v0.5/v0.6 checkpoint loads here),
plus the RNG streams and training-metric accumulators that a bit-exact resume also needs. Pure data and torch: where the checkpoint is written, and when, is the job's business.
"""

from __future__ import annotations

import logging
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import torch
import torch.distributed
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torchmetrics import Metric

from state.evaluator import Evaluator
from state.exceptions import StateError
from state.metrics import MetricsLike, as_metric_dict, load_metric_state, metric_state
from state.precision import Precision, check_precision_available, default_precision_context
from state.rng import capture_rng, restore_rng
from state.serializable import Serializable
from state.time import Time, Timer, TimeUnit

logger = logging.getLogger(__name__)

T = TypeVar("T")
PrecisionContext = Callable[[Precision], AbstractContextManager[Any]]

# Attributes holding objects with their own state_dict(); saved as {type qualname: state} so that a
# checkpoint stays loadable when the list is reordered or an entry is added.
_BY_TYPE_ATTRIBUTES = frozenset({"optimizers", "schedulers", "algorithms", "callbacks", "scaler", "timer"})

DEFAULT_SERIALIZED_ATTRIBUTES = (
    "model",
    "optimizers",
    "schedulers",
    "algorithms",
    "callbacks",
    "scaler",
    "timer",
    "rank_zero_seed",
    "current_metrics",
    "train_metrics",
    "rng",
)

_DDP_PREFIX = "module."


def _as_list(value: T | Sequence[T] | None) -> list[T]:
    """Accept one object or a sequence of them, as Composer's ``ensure_tuple`` does."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]  # type: ignore[list-item]


def _copy_tensors(value: Any, memo: dict[int, Any] | None = None) -> Any:
    """Clone every tensor in a nested container.

    ``Optimizer.load_state_dict`` keeps the given tensors when dtype and device already match, so without
    this a state loaded from another live state (or loaded twice) would share - and double-step - buffers.

    Each container is copied once, as ``copy.deepcopy`` does (``memo``: id of the original -> its copy): a
    checkpoint is untrusted, and a pickle's memo lets 1.4 KB hold a list shared 40 levels deep, which a copy
    per reference made 2**40 copies of (the start-up hung, gigabytes deep). A list that holds itself is copied
    as one that holds its copy.
    """
    if memo is None:
        memo = {}
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if not isinstance(value, (dict, list, tuple)):
        return value
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, dict):
        copied: Any = OrderedDict() if isinstance(value, OrderedDict) else {}
        memo[id(value)] = copied
        for key, item in value.items():
            copied[key] = _copy_tensors(item, memo)
        if isinstance(value, OrderedDict) and hasattr(value, "_metadata"):
            setattr(copied, "_metadata", value._metadata)  # noqa: B010 - torch's private attribute, not typed
    elif isinstance(value, list):
        copied = memo[id(value)] = []
        copied.extend(_copy_tensors(item, memo) for item in value)
    else:
        copied = memo[id(value)] = tuple(_copy_tensors(item, memo) for item in value)
    return copied


def _backward_compatible(state: Mapping[str, Any]) -> dict[str, Any]:
    """Composer before v0.4.1 wrote private names ("_optimizers") and called the DDP flag ``_is_model_ddp_wrapped``."""
    result: dict[str, Any] = {}
    for key, value in state.items():
        if key == "_is_model_ddp_wrapped":
            key = "is_model_ddp"
        elif key.startswith("_"):
            key = key[1:]
        result[key] = value
    return result


def _global_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


class State(Serializable):
    """What the training loop reads and mutates, and what a checkpoint must bring back.

    List attributes (optimizers, schedulers, algorithms, callbacks, evaluators) are replaced in place by
    their setters, so code that kept a reference to the list (an algorithm, a callback) sees the change.

    ``state_dict()`` returns live tensors of the model and optimizers (no copy, to keep GPU memory flat):
    serialize it before the next training step.

    Setters refuse what cannot train, at construction as after it: ``grad_accum`` below 1 (0 micro-batches
    per step would never step), a ``max_duration`` of zero ("0ep") or in ``dur`` (it is the unit ``dur``
    is a fraction of), an AMP ``precision`` without a CUDA GPU. The last differs from Composer v0.6, which
    accepts AMP on a CPU machine and fails only when the precision context is first entered: a job that
    cannot train should fail in its first second, before it downloads a checkpoint and builds the model,
    not at the first forward pass. A custom ``precision_context`` factory opts out of that check (the
    factory then decides what the precision means).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        max_duration: str | Time[int],
        rank_zero_seed: int,
        train_dataloader: Iterable[Any],
        evaluators: Evaluator | Sequence[Evaluator] | None = None,
        grad_accum: int = 1,
        precision: str | Precision = Precision.FP32,
        precision_context: PrecisionContext | None = None,
        optimizers: Optimizer | Sequence[Optimizer] | None = None,
        scaler: Any | None = None,
        algorithms: Any | Sequence[Any] | None = None,
        callbacks: Any | Sequence[Any] | None = None,
        steps_per_epoch: int | None = None,
        train_metrics: MetricsLike = None,
    ) -> None:
        if not isinstance(rank_zero_seed, int) or isinstance(rank_zero_seed, bool):
            raise TypeError(f"rank_zero_seed must be an int, got {type(rank_zero_seed).__name__}")
        self.model = model
        self.rank_zero_seed = rank_zero_seed
        self.grad_accum = grad_accum
        self.train_dataloader = train_dataloader
        self._evaluators: list[Evaluator] = []
        self.evaluators = evaluators
        self.max_duration = max_duration
        self.steps_per_epoch = steps_per_epoch
        self.timer = Timer()
        self._precision_context: PrecisionContext = precision_context or default_precision_context
        self.precision = precision
        self._optimizers: list[Optimizer] = _as_list(optimizers)
        self._schedulers: list[Any] = []
        self.scaler = scaler
        self._algorithms: list[Any] = _as_list(algorithms)
        self._callbacks: list[Any] = _as_list(callbacks)
        self._train_metrics: dict[str, Metric] = as_metric_dict(train_metrics)
        self.profiler: Any | None = None
        self.serialized_attributes: list[str] = list(DEFAULT_SERIALIZED_ATTRIBUTES)
        # {dataloader label: {metric name: computed value}}; the train dataloader is labelled "train".
        self.current_metrics: dict[str, dict[str, Any]] = {}
        self.batch: Any = None
        self.batch_num_samples = 0
        self.batch_num_tokens = 0
        self.loss: Any = None
        self.outputs: Any = None

    # --- identity and configuration -------------------------------------------------------------------------

    @property
    def seed(self) -> int:
        """This rank's seed: ranks must differ (or every rank would drop out the same units) yet be reproducible."""
        return self.rank_zero_seed + _global_rank()

    @property
    def grad_accum(self) -> int:
        return self._grad_accum

    @grad_accum.setter
    def grad_accum(self, grad_accum: int) -> None:
        if not isinstance(grad_accum, int) or isinstance(grad_accum, bool) or grad_accum < 1:
            raise ValueError(f"grad_accum must be an int >= 1, got {grad_accum!r}")
        self._grad_accum = grad_accum

    @property
    def max_duration(self) -> Time[int]:
        return self._max_duration

    @max_duration.setter
    def max_duration(self, max_duration: str | Time[int]) -> None:
        if isinstance(max_duration, str):
            max_duration = Time.from_timestring(max_duration)
        if not isinstance(max_duration, Time):
            raise TypeError(f"max_duration must be a Time or a time string, got {type(max_duration).__name__}")
        if max_duration.unit is TimeUnit.DURATION:
            raise ValueError(f"max_duration cannot be given in 'dur' ({max_duration}): it is the unit it defines")
        if max_duration.value <= 0:
            raise ValueError(f"max_duration must be positive, got {max_duration}")
        self._max_duration = max_duration

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch: the dataloader's length unless capped (e.g. to make epochs of a stream)."""
        if self._steps_per_epoch is not None:
            return self._steps_per_epoch
        try:
            return len(self.train_dataloader)  # type: ignore[arg-type]
        except TypeError as error:
            raise TypeError("the train dataloader has no len(); set steps_per_epoch explicitly") from error

    @steps_per_epoch.setter
    def steps_per_epoch(self, steps_per_epoch: int | None) -> None:
        if steps_per_epoch is not None:
            if not isinstance(steps_per_epoch, int) or isinstance(steps_per_epoch, bool) or steps_per_epoch < 1:
                raise ValueError(f"steps_per_epoch must be an int >= 1 or None, got {steps_per_epoch!r}")
            try:
                dataloader_len: int | None = len(self.train_dataloader)  # type: ignore[arg-type]
            except (TypeError, NotImplementedError):
                dataloader_len = None
            if dataloader_len is not None and steps_per_epoch > dataloader_len:
                warnings.warn(
                    f"steps_per_epoch ({steps_per_epoch}) is greater than the number of batches in the training "
                    f"dataloader ({dataloader_len}); epochs will end when the dataloader runs out",
                    UserWarning,
                    stacklevel=2,
                )
        self._steps_per_epoch = steps_per_epoch

    @property
    def precision(self) -> Precision:
        return self._precision

    @precision.setter
    def precision(self, precision: str | Precision) -> None:
        precision = Precision(precision)
        if self._precision_context is default_precision_context:
            # Fail at construction, not at the first forward pass minutes into the job.
            check_precision_available(precision)
        self._precision = precision

    @property
    def precision_context(self) -> AbstractContextManager[Any]:
        """A fresh context manager for the current precision; wrap each forward pass in it."""
        return self._precision_context(self.precision)

    # --- lists replaced in place ----------------------------------------------------------------------------

    @property
    def evaluators(self) -> list[Evaluator]:
        return self._evaluators

    @evaluators.setter
    def evaluators(self, evaluators: Evaluator | Sequence[Evaluator] | None) -> None:
        self._evaluators[:] = _as_list(evaluators)

    @property
    def optimizers(self) -> list[Optimizer]:
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers: Optimizer | Sequence[Optimizer] | None) -> None:
        self._optimizers[:] = _as_list(optimizers)

    @property
    def schedulers(self) -> list[Any]:
        return self._schedulers

    @schedulers.setter
    def schedulers(self, schedulers: Any | Sequence[Any] | None) -> None:
        self._schedulers[:] = _as_list(schedulers)

    @property
    def algorithms(self) -> list[Any]:
        return self._algorithms

    @algorithms.setter
    def algorithms(self, algorithms: Any | Sequence[Any] | None) -> None:
        self._algorithms[:] = _as_list(algorithms)

    @property
    def callbacks(self) -> list[Any]:
        return self._callbacks

    @callbacks.setter
    def callbacks(self, callbacks: Any | Sequence[Any] | None) -> None:
        self._callbacks[:] = _as_list(callbacks)

    @property
    def train_metrics(self) -> dict[str, Metric]:
        """Training metrics by name; a Metric or MetricCollection is unpacked into this dict."""
        return self._train_metrics

    @train_metrics.setter
    def train_metrics(self, train_metrics: MetricsLike) -> None:
        self._train_metrics = as_metric_dict(train_metrics)

    # --- the current batch ----------------------------------------------------------------------------------

    @property
    def batch_pair(self) -> tuple[Any, Any] | list[Any]:
        """The batch as (inputs, targets); a TypeError says so when the batch has another shape."""
        if isinstance(self.batch, (tuple, list)) and len(self.batch) == 2:
            return self.batch
        raise TypeError(f"the batch is not an (inputs, targets) pair: got {_describe(self.batch)}")

    @property
    def batch_dict(self) -> dict[Any, Any]:
        if isinstance(self.batch, dict):
            return self.batch
        raise TypeError(f"the batch is not a dict: got {_describe(self.batch)}")

    # --- progress ---------------------------------------------------------------------------------------------

    def get_elapsed_duration(self) -> Time[float]:
        """Progress as a fraction of max_duration: 0.0 at the start, 1.0 when training is complete."""
        return self.timer.get(self.max_duration.unit) / self.max_duration

    @property
    def data_position(self) -> tuple[int, int]:
        """(epoch, batch_in_epoch): where ``ResumableBatchSampler.set_epoch`` must resume."""
        return self.timer.epoch.value, self.timer.batch_in_epoch.value

    # --- model wrappers ---------------------------------------------------------------------------------------

    @property
    def is_model_ddp(self) -> bool:
        return isinstance(self.model, DistributedDataParallel)

    @property
    def is_model_deepspeed(self) -> bool:
        try:
            import deepspeed  # type: ignore[import-not-found]
        except ImportError:
            return False
        return isinstance(self.model, deepspeed.DeepSpeedEngine)

    @property
    def deepspeed_model(self) -> Any:
        if self.is_model_deepspeed:
            return self.model
        raise TypeError(f"state.model is not a DeepSpeed engine (it is a {type(self.model).__name__})")

    # --- checkpointing --------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything in ``serialized_attributes``; loadable with ``torch.load(weights_only=True)``."""
        result: dict[str, Any] = {}
        for name in self.serialized_attributes:
            if name == "model":
                result[name] = self._model_state_dict()
            elif name in _BY_TYPE_ATTRIBUTES:
                result[name] = self._by_type_state_dict(name)
            elif name == "rng":
                result[name] = capture_rng()
            elif name == "train_metrics":
                result[name] = {label: metric_state(metric) for label, metric in self.train_metrics.items()}
            else:
                result[name] = getattr(self, name)
        return result

    def _model_state_dict(self) -> dict[str, Any]:
        model_state = self.model.state_dict()
        if self.is_model_ddp:
            # The wrapper is how this run was launched, not part of the model: a checkpoint must load either way.
            consume_prefix_in_state_dict_if_present(model_state, _DDP_PREFIX)
        return model_state

    def _by_type_state_dict(self, name: str) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for obj in _as_list(getattr(self, name)):
            key = type(obj).__qualname__
            if key in result:
                raise StateError(
                    f"two {name} of type {key}: checkpoints key {name} by type, so one would overwrite the other"
                )
            result[key] = obj.state_dict()
        return result

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = False) -> None:
        """Restore from :meth:`state_dict` (also of Composer-era checkpoints); ``strict`` applies to the model.

        What the checkpoint lacks keeps its current value with a UserWarning; what this state lacks is
        ignored. The RNG is restored last so that nothing done while loading shifts it.
        """
        state = _backward_compatible(state)
        restore_rng_last = False
        for name in self.serialized_attributes:
            if name not in state:
                warnings.warn(f"the checkpoint has no {name!r}; it keeps its current value", UserWarning, stacklevel=2)
                continue
            value = state[name]
            if name == "model":
                self._load_model(value, saved_with_prefix=bool(state.get("is_model_ddp", False)), strict=strict)
            elif name in _BY_TYPE_ATTRIBUTES:
                self._load_by_type(name, value)
            elif name == "rng":
                restore_rng_last = True
            elif name == "train_metrics":
                self._load_train_metrics(value)
            else:
                try:
                    setattr(self, name, _copy_tensors(value))
                except AttributeError:
                    logger.debug("not restoring %r: it is read-only on State", name)
        ignored = sorted(set(state) - set(self.serialized_attributes) - {"is_model_ddp"})
        if ignored:
            logger.debug("ignoring checkpoint entries not in serialized_attributes: %s", ", ".join(ignored))
        if restore_rng_last:
            restore_rng(state["rng"])

    def _load_model(self, model_state: Mapping[str, Any], saved_with_prefix: bool, strict: bool) -> None:
        if saved_with_prefix:
            # Checkpoints from before prefix stripping carry DDP's "module." on every key; copy before
            # stripping so the caller's dict is left as it was.
            stripped: Any = OrderedDict(model_state)
            metadata = getattr(model_state, "_metadata", None)
            if metadata is not None:
                stripped._metadata = OrderedDict(metadata)
            consume_prefix_in_state_dict_if_present(stripped, _DDP_PREFIX)
            model_state = stripped
        # Keys are saved without the DDP prefix, so load into the wrapped module when this run is DDP.
        target: torch.nn.Module = self.model.module if isinstance(self.model, DistributedDataParallel) else self.model
        missing, unexpected = target.load_state_dict(model_state, strict=strict)
        if missing:
            logger.warning("the checkpoint lacks these model keys (left as initialized): %s", ", ".join(missing))
        if unexpected:
            logger.warning("the checkpoint has model keys this model lacks (ignored): %s", ", ".join(unexpected))

    def _load_by_type(self, name: str, saved: Any) -> None:
        if not isinstance(saved, Mapping):
            raise StateError(f"checkpoint entry {name!r} must map type names to states, got {type(saved).__name__}")
        for obj in _as_list(getattr(self, name)):
            key = type(obj).__qualname__
            if key not in saved:
                warnings.warn(
                    f"{key} (in {name}) is not in the checkpoint; its state is not restored", UserWarning, stacklevel=3
                )
                continue
            obj.load_state_dict(_copy_tensors(saved[key]))

    def _load_train_metrics(self, saved: Any) -> None:
        if not isinstance(saved, Mapping):
            raise StateError(f"checkpoint entry 'train_metrics' must map names to states, got {type(saved).__name__}")
        for label, metric in self.train_metrics.items():
            if label not in saved:
                warnings.warn(
                    f"train metric {label!r} is not in the checkpoint; it keeps what it has accumulated",
                    UserWarning,
                    stacklevel=3,
                )
                continue
            load_metric_state(metric, saved[label])


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of length {len(value)}"
    return f"a {type(value).__name__}"
