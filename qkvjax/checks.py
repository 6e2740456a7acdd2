"""One check per kind of config field, shared by every frozen config dataclass's ``__post_init__``.

Each check reads ``config.<name>``, refuses a value of the wrong kind or out of range with one line naming the
field, the value and what is allowed (a ``ValueError``, never a ``TypeError`` from a comparison further in), and
stores it back normalised: numpy scalars become Python ones and paths become strings, so a config built in
Python (a sweep's ``np.int64`` head count, a ``pathlib.Path`` corpus, a learning rate read from YAML) is refused
or kept exactly as one parsed from ``--config.*`` flags, stays hashable and writes to ``config.json``.

A field is labelled ``<LABEL>.<name>``: ``LABEL`` is a class attribute of the config (``"train"`` for
``TrainConfig``, as its ``--config.train.*`` flags), else the class's name; an empty ``LABEL`` gives the name
alone.
"""

from __future__ import annotations

import errno
import math
import numbers
import os
from collections.abc import Collection

import numpy as np


def label(config, name: str) -> str:
    prefix = getattr(type(config), "LABEL", type(config).__name__)
    return f"{prefix}.{name}" if prefix else name


def refuse(config, name: str, allowed: str) -> None:
    """Raises the one-line error for ``config.<name>``, for a check the functions below do not make."""
    raise ValueError(f"{label(config, name)}={getattr(config, name)!r}; allowed: {allowed}")


def _none_or(none: str | None, allowed: str) -> str:
    return allowed if none is None else f"None{f' ({none})' if none else ''} or {allowed}"


def _keep(config, name: str, value) -> None:
    object.__setattr__(config, name, value)  # the dataclasses are frozen; this is their own __post_init__


def instance(where: str, value, kind: type) -> None:
    """``value`` (a module's config) is a ``kind``; else one line naming both types (a dict, or the attention
    layer's config handed to a whole model, was an AttributeError deep inside)."""
    if not isinstance(value, kind):
        raise ValueError(f"{where} is of type {type(value).__name__}; allowed: a qkvjax {kind.__name__}")


def is_integer(value) -> bool:
    """An integer, numpy's included; a bool is not one here (``True`` heads is a mistake, not 1)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def integer(
    config,
    name: str,
    *,
    minimum: int = 1,
    maximum: int | None = None,
    none: str | None = None,
    allowed: str | None = None,
) -> None:
    """``config.<name>`` is an integer in [minimum, maximum]; ``none``: None is allowed too, and means that;
    ``allowed``: the error's wording of the range, where the bounds alone would not say what the values mean."""
    value = integer_value(
        label(config, name), getattr(config, name), minimum=minimum, maximum=maximum, none=none, allowed=allowed
    )
    _keep(config, name, value)


def integer_value(
    where: str,
    value,
    *,
    minimum: int = 1,
    maximum: int | None = None,
    none: str | None = None,
    allowed: str | None = None,
) -> int | None:
    """:func:`integer` for a function's argument or an option: ``value`` as an int, or the error naming ``where``."""
    if value is None and none is not None:
        return None
    bound = f"an integer >= {minimum}" if maximum is None else f"an integer in [{minimum}, {maximum}]"
    if not is_integer(value) or value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"{where}={value!r}; allowed: {_none_or(none, allowed or bound)}")
    return int(value)


SEED_MAX = 2**32 - 1  # grain's shuffle takes 32-bit seeds; one range for every seed a user passes


def seed(where: str, value) -> int:
    """A seed (a run's, sampling's, an analysis's control's): an integer in [0, 2^32)."""
    return integer_value(where, value, minimum=0, maximum=SEED_MAX)


def number(
    config,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    open_low: bool = False,
    open_high: bool = False,
    none: str | None = None,
    allowed: str | None = None,
) -> None:
    """``config.<name>`` is a finite real number within the bounds given (each closed unless ``open_*``);
    ``none`` and ``allowed`` as for :func:`integer`."""
    value = getattr(config, name)
    if value is None and none is not None:
        return
    if low is not None and high is not None:
        bound = f"a number in {'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"
    elif low is not None:
        bound = f"a finite number {'>' if open_low else '>='} {low:g}"
    elif high is not None:
        bound = f"a finite number {'<' if open_high else '<='} {high:g}"
    else:
        bound = "a finite number"
    real = isinstance(value, numbers.Real) and not isinstance(value, bool) and _finite(value)
    if (
        not real
        or (low is not None and (value <= low if open_low else value < low))
        or (high is not None and (value >= high if open_high else value > high))
    ):
        refuse(config, name, _none_or(none, allowed or bound))
    _keep(config, name, float(value))


def _finite(value: numbers.Real) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past float's range (10**400)
        return False


def flag(config, name: str, *, none: str | None = None) -> None:
    """``config.<name>`` is True or False (numpy's bools too)."""
    value = getattr(config, name)
    if value is None and none is not None:
        return
    if not isinstance(value, bool | np.bool_):
        refuse(config, name, _none_or(none, "True or False"))
    _keep(config, name, bool(value))


def choice(config, name: str, allowed: Collection[str], *, none: str | None = None) -> None:
    """``config.<name>`` is one of the strings ``allowed`` (listed in the error in their order)."""
    value = getattr(config, name)
    if value is None and none is not None:
        return
    if not isinstance(value, str) or value not in allowed:
        shown = _none_or(none, str(list(allowed)))
        raise ValueError(f"{label(config, name)}={value!r} is unknown; allowed: {shown}")


def text(config, name: str, *, none: str | None = None) -> None:
    """``config.<name>`` is a string or a path (kept as its string)."""
    value = getattr(config, name)
    if value is None and none is not None:
        return
    if not isinstance(value, str | os.PathLike):
        refuse(config, name, _none_or(none, "a string or a path"))
    value = os.fspath(value)
    try:  # bytes that are not UTF-8 (Python keeps them as surrogates) fail later in TFDS, TensorStore or JSON
        value.encode("utf-8")
    except (UnicodeEncodeError, AttributeError):
        refuse(config, name, _none_or(none, "UTF-8 text (a path whose bytes are not UTF-8 cannot be read here)"))
    _keep(config, name, value)


def device_memory(device=None) -> int:
    """Bytes ``device`` (default: this process's first) can hold: the allocator's limit where jax reports one (a
    GPU's or TPU's memory), else this machine's memory (a CPU device allocates from it). For refusing, before
    anything is allocated, a request that cannot fit at all: on a CPU such a request is killed by the operating
    system, with no message, once its pages are touched."""
    import jax

    device = jax.local_devices()[0] if device is None else device
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def available_memory(device=None) -> int:
    """Bytes ``device`` can still allocate: an accelerator's limit less what is in use, else this machine's
    available memory (Linux's MemAvailable: free pages and those the kernel can reclaim), not its total, which
    other processes and this one's own arrays already share."""
    import jax

    device = jax.local_devices()[0] if device is None else device
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def is_disk_full(e: BaseException) -> bool:
    """Whether ``e`` or what caused it is ENOSPC (an OSError's errno, or the words in another library's error:
    orbax's thread errors, array_record's RuntimeError)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False
