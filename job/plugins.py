"""Resolve ``--model`` / ``--data``: a built-in name or user code as ``pkg.module:function``."""
from __future__ import annotations

import importlib
from typing import Any, Callable

from job.exceptions import ConfigError

BUILTIN_MODELS = {"mlp": "job.builtin:mlp", "mlp-large": "job.builtin:mlp_large"}
BUILTIN_DATA = {"spirals": "job.builtin:spirals"}


def resolve(spec: str, builtins: dict[str, str], flag: str) -> Callable[..., Any]:
    target = builtins.get(spec, spec)
    module_name, sep, attr = target.partition(":")
    hint = f"use a built-in ({', '.join(builtins)}) or pkg.module:function"
    if not sep or not module_name or not attr:
        raise ConfigError(f"{flag} {spec!r} is neither a built-in nor pkg.module:function; {hint}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{flag} {spec!r}: cannot import {module_name!r} ({e}); {hint}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{flag} {spec!r}: {module_name} has no callable {attr!r}; {hint}")
    return fn


def model_factory(spec: str) -> Callable[[], Any]:
    return resolve(spec, BUILTIN_MODELS, "--model")


def data_factory(spec: str) -> Callable[[str], Any]:
    return resolve(spec, BUILTIN_DATA, "--data")
