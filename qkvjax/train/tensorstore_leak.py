"""A reference leak in TensorStore's JSON-to-Python conversion, and its exact undoing.

TensorStore's Python bindings turn its C++ JSON values into Python objects in ``JsonToPyObject``
(``python/tensorstore/json_type_caster.cc``; releases 0.1.72 to 0.1.86 tried, all leak). Objects are filled with
``PyDict_SetItem(obj, key.release(), value.release())``: ``PyDict_SetItem`` takes new references of its own and
does not steal the caller's, so every key and every value of every dict it returns keeps one reference too many
and is never freed. orbax calls two such functions on each save: ``ts.KvStore.Spec(...).to_json()`` to resolve
the checkpoint's kvstore (``tensorstore_utils._build_ocdbt_kvstore_tspec``) and
``ts.experimental_collect_matching_metrics`` before and after each batch of arrays, only to log a throughput.
A run checkpointing every few steps grew by tens of KiB per save (``tests/faults/save_probe.py``).

:func:`install` wraps ``KvStore.Spec.to_json``, ``Spec.to_json`` and ``experimental_collect_matching_metrics``
so that, after the call, each dict key and value loses the one reference the C++ should have dropped: the
result is then owned exactly as a Python-built one. Each function is probed first on a fresh object, and wrapped
only when the probe shows exactly one extra reference, so a TensorStore release with the leak fixed is left alone.
``QKVJAX_TENSORSTORE_LEAK_FIX=0`` turns it off (to measure the leak, or to rule this out).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import uuid

import tensorstore as ts

_decref = ctypes.pythonapi.Py_DecRef
_decref.argtypes = [ctypes.py_object]
_decref.restype = None


def release_leaked(obj) -> None:
    """Drops the one extra reference held on each key and value of every dict inside ``obj`` (dicts and lists)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            release_leaked(value)
            _decref(key)  # the dict still holds its own reference to both
            _decref(value)
    elif isinstance(obj, list):
        for value in obj:
            release_leaked(value)


def _extra_references(make) -> int:
    """How many references too many a fresh string carries, read out of ``make(unique)``'s result.

    ``make`` returns (result, the fresh string found in it); with the result dropped, a correctly owned string is
    held only by the local name and ``getrefcount``'s argument."""
    result, value = make(f"/qkvjax-probe-{uuid.uuid4().hex}")
    del result
    return sys.getrefcount(value) - 2


def _probe_kvstore_spec(unique):
    out = ts.KvStore.Spec({"driver": "memory", "path": unique}).to_json()
    return out, out["path"]


def _probe_spec(unique):
    kvstore = {"driver": "memory", "path": unique}
    spec = {"driver": "zarr", "kvstore": kvstore, "metadata": {"shape": [3], "dtype": "<f4"}}
    out = ts.Spec(spec).to_json()
    return out, out["dtype"]  # top level (a nested one is also held by its leaked parent); made by this call


def _probe_metrics(unique):
    out = ts.experimental_collect_matching_metrics("/tensorstore/", include_zero_metrics=True)
    return out, out[0]["name"]  # a str made by this call: the metric names are std::strings in C++


def _wrap(fn):
    @functools.wraps(fn)
    def undo_leak(*args, **kwargs):
        out = fn(*args, **kwargs)
        release_leaked(out)
        return out

    undo_leak.__qkvjax_leak_fix__ = True
    return undo_leak


_TARGETS = (
    (ts.KvStore.Spec, "to_json", _probe_kvstore_spec),
    (ts.Spec, "to_json", _probe_spec),
    (ts, "experimental_collect_matching_metrics", _probe_metrics),
)


def install() -> list[str]:
    """Wraps each leaking function once (idempotent); returns the names wrapped by this call."""
    if os.environ.get("QKVJAX_TENSORSTORE_LEAK_FIX", "1") == "0":
        return []
    wrapped = []
    for owner, name, probe in _TARGETS:
        fn = getattr(owner, name, None)
        if fn is None or getattr(fn, "__qkvjax_leak_fix__", False):
            continue
        try:
            extra = _extra_references(probe)
        except Exception:  # an API that changed shape: leave it alone
            continue
        if extra == 1:
            setattr(owner, name, _wrap(fn))
            wrapped.append(f"{getattr(owner, '__qualname__', owner.__name__)}.{name}")
    return wrapped
