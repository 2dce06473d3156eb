"""A live-storage tracker: every tensor storage that exists, when it appears and when it dies.

A ``TorchDispatchMode`` sees the output of every ATen op. Each output's ``untyped_storage()`` is
registered once (views share their storage, so they are counted once) and a ``weakref.finalize``
on the Python storage object records the free: PyTorch preserves that Python object for as long as
the C++ storage lives, so the finalizer fires exactly when the memory is released, even when the
only owner is C++ (a tensor saved for backward). Tensors that exist before the mode (parameters,
inputs) are registered with :meth:`LiveStorageTracker.track`.

The tracker keeps an ordered event log (alloc / resize / free / phase marks) with the current phase
label and op name, so peaks and their composition are computed *after* the run, once it is known
which storages turned out to be gradients or optimizer state.

``torch`` is imported lazily: importing this module does not import it.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any, Literal, Self

if TYPE_CHECKING:
    import torch

EventKind = Literal["alloc", "resize", "free", "begin", "end"]

#: What the tracker counts, as a number: raised whenever a change makes it count differently, so that traces kept on
#: disk from before (the fitted method's calibrations) are made anew. 2: meta-device tensors hold no memory. 3: FSDP2
#: places the routed experts as torchtitan does (``trace.ranks.experts_placement``).
COUNTING_REVISION = 3

#: Ops whose output, when cast from a parameter to a 16-bit dtype, is a "compute copy" of a weight.
CAST_OPS: frozenset[str] = frozenset(
    {"aten._to_copy.default", "aten.to.dtype", "aten._to_copy.out"}
)


@dataclass(slots=True)
class StorageRecord:
    """One storage seen by the tracker (mutable while tracking)."""

    sid: int
    nbytes: int
    op: str
    phase: str | None
    iteration: int
    micro: int
    dtype: str
    shape: tuple[int, ...]
    alloc_index: int
    free_index: int | None = None
    tags: set[str] = field(default_factory=set)
    #: For cast ops: the storage id of the tensor that was cast.
    source_sid: int | None = None
    #: The innermost module running when the storage was created (when module names are tracked).
    module: str | None = None


@dataclass(frozen=True, slots=True)
class Event:
    """One entry of the event log; ``delta`` is the change of live bytes it caused."""

    index: int
    kind: EventKind
    sid: int
    delta: int
    live_bytes: int
    phase: str | None
    iteration: int
    micro: int
    op: str
    time_ns: int


WindowKey = tuple[str, int, int]
"""(phase, iteration, micro-batch) of a phase window."""


@dataclass(frozen=True, slots=True)
class Peak:
    """The highest live-byte count inside a window and the first event reaching it."""

    index: int
    bytes: int


class LiveStorageTracker:
    """Track live tensor storages through a dispatch mode; use as a context manager."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.records: dict[int, StorageRecord] = {}
        self.events: list[Event] = []
        self.live_bytes = 0
        self.max_live_bytes = 0
        self._by_pyid: dict[int, int] = {}
        self._finalizers: dict[int, weakref.finalize[Any, Any]] = {}
        self._next_sid = 1
        self.phase_name: str | None = None
        #: Names of the modules whose forward is running, innermost last (see ``module_hooks``).
        self.module_stack: list[str] = []
        self.iteration = 0
        self.micro = 0
        self._mode: Any = None
        #: Host memory (activation offloading): copies made inside :meth:`host` are not device storages; their live
        #: bytes and peak are counted here instead.
        self.host_live_bytes = 0
        self.host_peak_bytes = 0
        self._host_depth = 0

    # ------------------------------------------------------------------ mode
    def __enter__(self) -> Self:
        self._mode = _mode_class()(self)
        self._mode.__enter__()
        _watch_resizes(self, True)
        return self

    def __exit__(self, *exc: object) -> None:
        mode, self._mode = self._mode, None
        _watch_resizes(self, False)
        mode.__exit__(*exc)

    def _on_storage_resize(self, storage: Any) -> None:
        """A tracked storage resized in place (FSDP2 frees an unsharded parameter with ``resize_(0)`` and
        allocates it again the same way): no op the dispatch mode sees, so ``UntypedStorage.resize_`` reports it."""
        with self._lock:
            sid = self._by_pyid.get(id(storage))
            if sid is None:
                return
            rec = self.records[sid]
            size = storage.nbytes()
            if size != rec.nbytes:
                delta = size - rec.nbytes
                rec.nbytes = size
                self._log("resize", sid, delta, "resize_")

    def close(self) -> None:
        """Detach every pending finalizer (frees after this are no longer logged)."""
        with self._lock:
            for fin in self._finalizers.values():
                fin.detach()
            self._finalizers.clear()
            self._by_pyid.clear()

    # ------------------------------------------------------------- phases
    def set_phase(
        self, name: str | None, iteration: int | None = None, micro: int = 0
    ) -> None:
        """Label the following events with ``name`` (no marks; see :meth:`phase`)."""
        self.phase_name = name
        if iteration is not None:
            self.iteration = iteration
        self.micro = micro

    @contextmanager
    def phase(self, name: str, iteration: int = 0, micro: int = 0) -> Iterator[None]:
        """Run a block as one phase window, bracketed by ``begin``/``end`` marks."""
        previous = (self.phase_name, self.iteration, self.micro)
        self.set_phase(name, iteration, micro)
        self._log("begin", 0, 0, "")
        try:
            yield
        finally:
            self._log("end", 0, 0, "")
            self.phase_name, self.iteration, self.micro = previous

    # ------------------------------------------------------------ host memory
    @contextmanager
    def host(self) -> Iterator[None]:
        """Ops inside this block make host copies (offloaded activations): not registered as device storages;
        add them with :meth:`add_host`."""
        self._host_depth += 1
        try:
            yield
        finally:
            self._host_depth -= 1

    def add_host(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage as host memory until it is freed."""
        size = tensor.untyped_storage().nbytes()
        with self._lock:
            self.host_live_bytes += size
            self.host_peak_bytes = max(self.host_peak_bytes, self.host_live_bytes)
        fin = weakref.finalize(tensor.untyped_storage(), self._on_host_free, size)
        fin.atexit = False

    def _on_host_free(self, size: int) -> None:
        with self._lock:
            self.host_live_bytes -= size

    # ------------------------------------------------------------ tracking
    def track(
        self, tensor: torch.Tensor, tag: str | None = None, op: str = "track"
    ) -> int:
        """Register ``tensor``'s storage (if new) and add ``tag``; return the storage id."""
        return self._register(_local(tensor), op, tag=tag)

    def sid_of(self, tensor: torch.Tensor) -> int | None:
        """The storage id of ``tensor`` if its storage is tracked and alive."""
        return self._by_pyid.get(id(_local(tensor).untyped_storage()))

    def _register(
        self,
        tensor: torch.Tensor,
        op: str,
        tag: str | None = None,
        source_sid: int | None = None,
    ) -> int:
        storage = tensor.untyped_storage()
        key = id(storage)
        with self._lock:
            sid = self._by_pyid.get(key)
            if sid is not None:
                rec = self.records[sid]
                size = storage.nbytes()
                if size != rec.nbytes:  # resize_ or an out= kernel grew the storage
                    delta = size - rec.nbytes
                    rec.nbytes = size
                    self._log("resize", sid, delta, op)
                if tag is not None:
                    rec.tags.add(tag)
                return sid
            sid = self._next_sid
            self._next_sid += 1
            size = storage.nbytes()
            rec = StorageRecord(
                sid=sid,
                nbytes=size,
                op=op,
                phase=self.phase_name,
                iteration=self.iteration,
                micro=self.micro,
                dtype=str(tensor.dtype).removeprefix("torch."),
                shape=tuple(int(s) for s in tensor.shape),
                alloc_index=len(self.events),
                source_sid=source_sid,
                module=self.module_stack[-1] if self.module_stack else None,
            )
            if tag is not None:
                rec.tags.add(tag)
            self.records[sid] = rec
            self._by_pyid[key] = sid
            fin = weakref.finalize(storage, self._on_free, key, sid)
            fin.atexit = False
            self._finalizers[sid] = fin
            self._log("alloc", sid, size, op)
            return sid

    def _on_free(self, key: int, sid: int) -> None:
        with self._lock:
            self._finalizers.pop(sid, None)
            if self._by_pyid.get(key) == sid:
                del self._by_pyid[key]
            rec = self.records[sid]
            rec.free_index = len(self.events)
            self._log("free", sid, -rec.nbytes, "")

    def _log(self, kind: EventKind, sid: int, delta: int, op: str) -> None:
        with self._lock:
            self.live_bytes += delta
            self.max_live_bytes = max(self.max_live_bytes, self.live_bytes)
            self.events.append(
                Event(
                    index=len(self.events),
                    kind=kind,
                    sid=sid,
                    delta=delta,
                    live_bytes=self.live_bytes,
                    phase=self.phase_name,
                    iteration=self.iteration,
                    micro=self.micro,
                    op=op,
                    time_ns=time.perf_counter_ns(),
                )
            )

    def _on_op(self, func: Any, args: tuple[Any, ...], out: Any) -> None:
        if self._host_depth:
            return
        refs = _torch_refs()
        name = _op_name(func)
        source: int | None = None
        if name in CAST_OPS and args and isinstance(args[0], refs.tensor):
            source = self.sid_of(args[0])
        for leaf in (out,) if type(out) is refs.fake else refs.tree_flatten(out)[0]:
            if type(leaf) is refs.fake:  # the common case on fake tensors, without the checks below
                if leaf.layout == refs.strided and leaf.fake_device.type != "meta":
                    self._register(leaf, name, source_sid=source)
            elif isinstance(leaf, refs.tensor) and leaf.layout == refs.strided and _holds_memory(leaf):
                self._register(_local(leaf), name, source_sid=source)

    # ------------------------------------------------------------ analysis
    def live_sids(self) -> list[int]:
        """Storage ids alive now."""
        return [sid for sid, rec in self.records.items() if rec.free_index is None]

    def windows(self) -> dict[WindowKey, tuple[int, int]]:
        """Event-index ranges (begin mark, end mark) of every phase window."""
        out: dict[WindowKey, tuple[int, int]] = {}
        opened: dict[WindowKey, int] = {}
        for ev in self.events:
            if ev.kind == "begin" and ev.phase is not None:
                opened[(ev.phase, ev.iteration, ev.micro)] = ev.index
            elif ev.kind == "end" and ev.phase is not None:
                key = (ev.phase, ev.iteration, ev.micro)
                if key in opened:
                    out[key] = (opened.pop(key), ev.index)
        return out

    def peak(self, start: int, end: int) -> Peak:
        """The first event in ``[start, end]`` with the highest live bytes."""
        best = self.events[start]
        for ev in self.events[start : end + 1]:
            if ev.live_bytes > best.live_bytes:
                best = ev
        return Peak(best.index, best.live_bytes)

    def peak_excluding(self, start: int, end: int, excluded: Callable[[int], bool]) -> Peak:
        """The first event in ``[start, end]`` where the live bytes of storages *not* ``excluded(sid)`` peak.

        Used to find a phase's peak of transient memory (activations and temporaries) when the model
        state is accounted separately (sharded multi-GPU ledgers).
        """
        held = 0
        best_index, best = start, -1
        for ev in self.events[: end + 1]:
            if ev.sid and excluded(ev.sid):
                held += ev.delta
            if ev.index >= start and ev.live_bytes - held > best:
                best_index, best = ev.index, ev.live_bytes - held
        return Peak(best_index, best)

    def live_at(self, index: int) -> dict[int, int]:
        """Live storages (sid → nbytes) just after event ``index``."""
        live: dict[int, int] = {}
        for ev in self.events[: index + 1]:
            if ev.kind == "alloc":
                live[ev.sid] = ev.delta
            elif ev.kind == "resize":
                live[ev.sid] += ev.delta
            elif ev.kind == "free":
                live.pop(ev.sid, None)
        return live

    def composition_at(
        self, index: int, category_of: Callable[[StorageRecord], str]
    ) -> dict[str, int]:
        """Live bytes after event ``index`` grouped by ``category_of``; sums to the live total."""
        out: dict[str, int] = {}
        for sid, nbytes in self.live_at(index).items():
            cat = category_of(self.records[sid])
            out[cat] = out.get(cat, 0) + nbytes
        return out

    def top_live(self, index: int, n: int = 10) -> list[tuple[StorageRecord, int]]:
        """The ``n`` largest storages alive after event ``index`` with their size then."""
        live = self.live_at(index)
        ranked = sorted(live.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
        return [(self.records[sid], nbytes) for sid, nbytes in ranked]


@cache
def _mode_class() -> type:
    """Build the ``TorchDispatchMode`` subclass (imports torch on first use)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class _TrackingMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
        def __init__(self, tracker: LiveStorageTracker) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.tracker = tracker

        def __torch_dispatch__(
            self,
            func: Any,
            types: Any,
            args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None,
        ) -> Any:
            refs = _torch_refs()
            if func is refs.device:
                # ``tensor.device`` of a tensor subclass (autograd's engine asks it of every gradient): no memory, and
                # two thirds of a fake step's ops. A fake tensor answers it as FakeTensor.__torch_dispatch__ does.
                if type(args[0]) is refs.fake and not args[0].fake_mode.in_kernel_invocation:
                    return args[0].fake_device
                return func(*args, **(kwargs or {}))
            if func is refs.local_scalar_dense and args and isinstance(args[0], refs.fake):
                # ``.item()`` of a fake tensor has no value (Adafactor reads norms and its step counter this
                # way). Memory never depends on such a scalar: read it as one and go on tracing.
                return True if args[0].dtype == torch.bool else 1 if not args[0].is_floating_point() else 1.0
            if func is refs.wait_tensor and args and isinstance(args[0], refs.fake):
                # the real kernel waits and returns its argument; the fake one (a meta kernel) returns a new empty
                # tensor, which would count a collective's output twice while both are alive
                return args[0]
            out = func(*args, **(kwargs or {}))
            self.tracker._on_op(func, args, out)
            return out

    return _TrackingMode


_RESIZE_WATCHERS: list[LiveStorageTracker] = []
_ORIGINAL_RESIZE: list[Any] = []


def _watch_resizes(tracker: LiveStorageTracker, on: bool) -> None:
    """Route ``torch.UntypedStorage.resize_`` through the active trackers while any is entered."""
    import torch

    if on:
        if not _RESIZE_WATCHERS:
            original = torch.UntypedStorage.resize_
            _ORIGINAL_RESIZE.append(original)

            def resize_(storage: Any, size: int) -> Any:
                out = original(storage, size)
                for watcher in list(_RESIZE_WATCHERS):
                    watcher._on_storage_resize(storage)
                return out

            torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        _RESIZE_WATCHERS.append(tracker)
        return
    if tracker in _RESIZE_WATCHERS:
        _RESIZE_WATCHERS.remove(tracker)
    if not _RESIZE_WATCHERS and _ORIGINAL_RESIZE:
        torch.UntypedStorage.resize_ = _ORIGINAL_RESIZE.pop()  # type: ignore[method-assign]


def _local(tensor: Any) -> Any:
    """This rank's shard of a DTensor (FSDP2's sharded parameters, gradients and optimizer state): the memory this
    process holds; other tensors as they are."""
    local = getattr(tensor, "_local_tensor", None)
    return local if local is not None and type(tensor).__name__ == "DTensor" else tensor


@dataclass(frozen=True, slots=True)
class _TorchRefs:
    """What the tracker looks up on every op, looked up once: the imports, ``torch.ops`` lookups and the op's name
    formatted anew on each op cost about 13 µs of the tracker's 43 µs per op on fake tensors (the op itself ~75 µs;
    docs/speed.md)."""

    tensor: type
    fake: type
    strided: Any
    tree_flatten: Callable[[Any], Any]
    local_scalar_dense: Any
    wait_tensor: Any
    device: Any


@cache
def _torch_refs() -> _TorchRefs:
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_flatten

    return _TorchRefs(torch.Tensor, FakeTensor, torch.strided, tree_flatten,
                      torch.ops.aten._local_scalar_dense.default, torch.ops._c10d_functional.wait_tensor.default,
                      torch.ops.prim.device.default)


#: ``str(op)`` per op overload (formatted anew on each call otherwise)
_OP_NAMES: dict[Any, str] = {}


def _op_name(func: Any) -> str:
    name = _OP_NAMES.get(func)
    if name is None:
        name = _OP_NAMES[func] = str(func)
    return name


def _holds_memory(tensor: Any) -> bool:
    """False for a real tensor whose storage has no data of its own: the autograd wrapper a functional collective
    returns before its wait (``_c10d_functional._wrap_tensor_autograd``), and views of it. Its storage reports the
    output's size but refuses its data pointer; the memory is the collective's output, counted once already. False
    too for a tensor on the meta device, fake or real: shapes only (a pipeline stage's example inputs and outputs,
    given to ``PipelineStage`` on the meta device, read as a logits-sized transient at load before)."""
    local = _local(tensor)
    if local.device.type == "meta":
        return False
    if _is_fake(local):
        return True
    try:
        local.untyped_storage().data_ptr()
    except RuntimeError:
        return False
    return True


def _is_fake(tensor: Any) -> bool:
    return isinstance(tensor, _torch_refs().fake)


def format_storages(
    rows: list[tuple[StorageRecord, int]],
    category_of: Callable[[StorageRecord], str] | None = None,
) -> str:
    """A text table of storages (as returned by :meth:`LiveStorageTracker.top_live`)."""
    lines = [
        f"{'bytes':>14}  {'category':<22}{'created in':<20}{'op':<44}{'dtype':<10}shape"
    ]
    for rec, nbytes in rows:
        cat = category_of(rec) if category_of else ",".join(sorted(rec.tags))
        where = f"{rec.phase}#{rec.iteration}" + (f".{rec.micro}" if rec.micro else "")
        lines.append(
            f"{nbytes:>14,}  {cat:<22}{where:<20}{rec.op.removeprefix('aten.'):<44}{rec.dtype:<10}{list(rec.shape)}"
        )
    return "\n".join(lines)
