"""Peak bytes of the tensors a computation creates, counted operator by operator (``looplm bench``'s
``peak_train_mem_bytes`` on CPU, where torch keeps no allocator statistics).

:class:`LiveBytes` is a ``TorchDispatchMode``: every aten operator run under it reports its outputs, a storage
that is new (it aliases no input and is not counted yet) adds its bytes, and the storage's release subtracts them
(a finalizer on its Python object, which torch keeps alive as long as the C++ storage). The count is exact for the
storages it sees and deterministic: the same operators on the same shapes give the same bytes on any machine and
thread count, since no allocator, page size or process history enters it. It does not see memory an operator
uses inside and frees before it returns (kernel workspaces), nor storages created before it began (parameters,
optimizer state), nor the growth of a storage that existed before.
"""

from __future__ import annotations

import functools
import gc
import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storage(t: Any) -> torch.UntypedStorage | None:
    """The storage of a dense tensor, else None (sparse and other layouts without one)."""
    if isinstance(t, torch.Tensor) and t.layout == torch.strided:
        return t.untyped_storage()
    return None


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@functools.cache
def _first_dispatch() -> None:
    """The first operator under a dispatch mode imports lazily and leaves cyclic garbage that holds its arguments:
    run one beforehand, so that the first count does not keep a tensor the later ones release."""
    with _Passthrough():
        torch.zeros(1) + 1
    gc.collect()


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under it that are alive now (``live``) and at most so far (``peak``).

    The Python garbage collector is off while it is active, so that storages held only by reference cycles are
    released at the same point on every run (at the end, not whenever a collection happens to run).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._bytes: dict[int, int] = {}  # storage address (StorageImpl*) → bytes counted
        self._gc = False

    def __enter__(self) -> "LiveBytes":
        _first_dispatch()
        gc.collect()
        self._gc = gc.isenabled()
        gc.disable()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self._gc:
            gc.enable()

    def _release(self, key: int) -> None:
        self.live -= self._bytes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {s._cdata for s in map(_storage, tree_leaves((args, kwargs))) if s is not None}
        for st in map(_storage, tree_leaves(out)):
            if st is None:
                continue
            key, n = st._cdata, st.nbytes()
            if key in self._bytes:  # counted already (a view, an in-place op): a resize changes its bytes
                self.live += n - self._bytes[key]
                self._bytes[key] = n
            elif key in inputs:  # an input created before this mode began
                continue
            else:
                self._bytes[key] = n
                self.live += n
                weakref.finalize(st, self._release, key)
            self.peak = max(self.peak, self.live)
        return out


def peak_live_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes of the tensor storages alive at once among those ``fn()`` creates (:class:`LiveBytes`)."""
    with LiveBytes() as tally:
        fn()
    return tally.peak
