"""Checks of the rendezvous' request fields: each raises
`RendezvousInvalidArgumentError` naming the field, the value and what it
must be."""

import math

from keras_ps.elastic import api
from keras_ps.elastic._ps_registry import MAX_PS


def invalid(message):
    return api.RendezvousInvalidArgumentError(message)


def address(value: str) -> str:
    try:
        api.parse_address(value)
    except ValueError as error:
        raise invalid(str(error)) from None
    return value


def timeout(value: float, field: str = "timeout") -> float:
    if not math.isfinite(value) or value < 0:
        raise invalid(f"{field} must be a finite number of seconds >= 0, "
                      f"got {value!r}")
    return value


def tag(value: str) -> str:
    if not value:
        raise invalid(f"tag must be a non-empty string, got {value!r}")
    if len(value) > api.MAX_TAG_LENGTH:
        raise invalid(f"tag must be at most {api.MAX_TAG_LENGTH} characters, "
                      f"got {len(value)} ({value[:32]!r}...)")
    return value


def generation(value: int) -> int:
    if value < 0:
        raise invalid(f"generation must be >= 0, got {value}")
    return value


def ps_index(index: int) -> int:
    if not 0 <= index < MAX_PS:
        raise invalid(f"index must be a ps index from 0 to {MAX_PS - 1}, "
                      f"got {index}")
    return index


def incarnation(value: str) -> str:
    if not value or len(value) > 128:
        raise invalid(f"incarnation must be a string of 1 to 128 "
                      f"characters naming the ps process, got {value!r}")
    return value
