"""Request validation: every value a caller hands the runtime (token ids, sampling parameters, a cache slot) is
checked here before anything runs, and a bad one is a ``UserError`` naming the parameter and the value.

    token_ids(value, vocab, name)   ints only (Python ints, integer numpy / torch arrays, nested at most 2 deep
                                    with one row): bool, float, str, None, dict, ragged or deeper nesting rejected;
                                    every id in [0, vocab)  -> int64 tensor [1, n]
    sampling(...)                   temperature finite >= 0, 0 < top_p <= 1, max_new_tokens int >= 0,
                                    seed int in [0, 2**63)
    slot(value, slots)              an int in [0, slots)
    batch(requests, max_batch, ...) a list or tuple of at most max_batch requests

``name`` is what the message calls the value: the Python parameter (``input_ids``) or, from the CLI, the option
(``--input-ids``); ``cli=True`` names the sampling options the same way (``--top-p``).
"""

from __future__ import annotations

import math
from numbers import Integral, Real

import numpy as np
import torch

from dayzero import UserError

INT64_LIMIT = 1 << 63
SEED_LIMIT = 1 << 63
_SHOWN = 40  # characters of a bad value quoted in a message


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN - 3] + "..."


def is_int(x) -> bool:
    return isinstance(x, Integral) and not isinstance(x, (bool, np.bool_))


def _option(param: str, cli: bool) -> str:
    return "--" + param.replace("_", "-") if cli else param


def _flatten(value, name: str) -> tuple[list[int], int]:
    """Python ints nested in lists/tuples -> (flat ids, rank), rejecting anything else by name."""
    if is_int(value):
        return [int(value)], 0
    if not isinstance(value, (list, tuple)):
        raise UserError(f"{name}: expected token ids (ints), got {type(value).__name__} {_show(value)}")
    if any(isinstance(x, (list, tuple, np.ndarray, torch.Tensor)) for x in value):
        if len(value) != 1:
            raise UserError(f"{name}: one request's token ids are a flat list (or one row), got {len(value)} rows; "
                            f"use generate_batch for several requests")
        row = value[0]
        row = row.tolist() if isinstance(row, (np.ndarray, torch.Tensor)) else row
        if not isinstance(row, (list, tuple)) or any(isinstance(x, (list, tuple)) for x in row):
            raise UserError(f"{name}: token ids nested more than two deep: {_show(value)}")
        value = row
    for x in value:
        if not is_int(x):
            raise UserError(f"{name}: token ids must be integers, got {type(x).__name__} {_show(x)}")
    return [int(x) for x in value], 1


def token_ids(value, vocab: int | None = None, name: str = "input_ids", allow_empty: bool = False) -> torch.Tensor:
    """``value`` as an int64 tensor [1, n] of ids in [0, vocab) (``vocab`` None: no upper bound but int64)."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        dt = value.dtype
        is_int = (not dt.is_floating_point and not dt.is_complex and dt != torch.bool) \
            if isinstance(value, torch.Tensor) else dt.kind in "iu"
        if not is_int:
            raise UserError(f"{name}: token ids must have an integer dtype, got {dt}")
        if value.ndim > 2 or (value.ndim == 2 and value.shape[0] != 1):
            raise UserError(f"{name}: one request's token ids are [n] or [1, n], got shape {tuple(value.shape)}")
        flat = [int(x) for x in value.reshape(-1).tolist()]
    else:
        flat, _ = _flatten(value, name)
    if not flat and not allow_empty:
        raise UserError(f"{name} is empty: give at least one token id")
    hi = INT64_LIMIT if vocab is None else int(vocab)
    for x in flat:
        if not 0 <= x < hi:
            where = f"the vocabulary [0, {hi})" if vocab is not None else "[0, 2**63)"
            raise UserError(f"{name}: token id {x} is outside {where}")
    return torch.tensor([flat], dtype=torch.int64).reshape(1, len(flat))


def sampling(max_new_tokens=0, temperature=0.0, top_p=1.0, seed=0, cli: bool = False) -> None:
    """Raise a UserError naming the first bad sampling parameter."""
    if not is_int(max_new_tokens) or max_new_tokens < 0:
        raise UserError(f"{_option('max_new_tokens', cli)} must be an integer >= 0, got {_show(max_new_tokens)}")
    if not isinstance(temperature, Real) or isinstance(temperature, bool) or not math.isfinite(temperature) \
            or temperature < 0:
        raise UserError(f"{_option('temperature', cli)} must be a finite number >= 0 (0: greedy), "
                        f"got {_show(temperature)}")
    if not isinstance(top_p, Real) or isinstance(top_p, bool) or not (0 < top_p <= 1):
        raise UserError(f"{_option('top_p', cli)} must be in (0, 1] (the probability mass kept), got {_show(top_p)}")
    if not is_int(seed) or not 0 <= seed < SEED_LIMIT:
        raise UserError(f"{_option('seed', cli)} must be an integer in [0, 2**63), got {_show(seed)}")


def slot(value, slots: int) -> int:
    """A request's cache slot: an int in [0, slots)."""
    if not is_int(value) or not 0 <= value < slots:
        raise UserError(f"slot {_show(value)} is not a request slot: the artifact serves {slots} request(s) at "
                        f"once, slots 0..{slots - 1} (--max-batch)")
    return int(value)


def batch(requests, max_batch: int, name: str, expected: str) -> None:
    """A batch of requests: a list or tuple (``expected`` says of what) of at most ``max_batch`` requests."""
    if not isinstance(requests, (list, tuple)):
        raise UserError(f"{name}: expected {expected}, got {type(requests).__name__}")
    if len(requests) > max_batch:
        raise UserError(f"{len(requests)} requests but the artifact serves {max_batch} at once (--max-batch)")
