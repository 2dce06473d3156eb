"""The memory timeline of a training step: every allocation and free in order, by ledger object and phase.

A :class:`Timeline` comes from memcalc's trace (predicted), from a measured CPU step, or from a real CUDA memory
snapshot (``torch.cuda.memory._dump_snapshot``). It converts to and from the snapshot format PyTorch's memory_viz
reads (``torch/cuda/_memory_viz.py``; its ``_profile_to_snapshot`` builds the same structure from profiler data):
``{"segments": [...], "device_traces": [[{"action", "addr", "size", "stream", "frames"}, ...]]}``. Snapshots are
read with an unpickler that refuses every Python object but plain containers, numbers and strings: a user's file
never runs code.

Standard library only; sizes in bytes.
"""

from __future__ import annotations

import io
import itertools
import operator
import pickle
import re
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from .errors import InputError
from .units import MAX_SIZE_BYTES
from .vocab import OBJECTS, PHASES, TENSOR_OBJECTS

#: Categories an event can carry: the ledger's objects and "unknown" (a snapshot frame memcalc cannot place).
CATEGORIES: Final = (*OBJECTS, "unknown")
#: The most events a snapshot or profiler timeline may hold (a 70B model's step on one GPU records tens of thousands
#: of allocations and frees an iteration: docs/reliability.md).
MAX_EVENTS: Final = 5_000_000


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    """One allocation (``size_bytes`` > 0) or free (< 0) and what it was."""

    size_bytes: int
    category: str
    phase: str
    iteration: int
    module: str = ""
    op: str = ""
    addr: int = 0


@dataclass(frozen=True)
class Span:
    """A phase window over event indices ``[start, end)``."""

    phase: str
    iteration: int
    start: int
    end: int


@dataclass(frozen=True)
class Timeline:
    """Events in order; ``baseline_bytes`` were live before the first (by category in ``baseline``)."""

    events: tuple[TimelineEvent, ...]
    source: str  # "trace", "measured", "snapshot", "profiler" or "ledger" (coarse, from an estimate)
    spans: tuple[Span, ...] = ()
    baseline: dict[str, int] = field(default_factory=dict)
    #: How sizes were rounded (512: the CUDA caching allocator's block rounding).
    rounding: int = 1
    #: What the allocator held in segments when a real snapshot was taken (0: unknown).
    reserved_bytes: int = 0

    def __post_init__(self) -> None:
        for e in self.events:
            if e.category not in CATEGORIES:
                raise ValueError(f"unknown category {e.category!r}")

    @property
    def baseline_bytes(self) -> int:
        return sum(self.baseline.values())

    def live(self) -> array[int]:
        """Live bytes after each event (the baseline included)."""
        out = array("q")
        now = self.baseline_bytes
        for e in self.events:
            now += e.size_bytes
            out.append(now)
        return out

    def series(self) -> dict[str, array[int]]:
        """Live bytes of each category after each event (stacked, they sum to :meth:`live`)."""
        now = {c: self.baseline.get(c, 0) for c in CATEGORIES}
        cols = {c: array("q") for c in CATEGORIES}
        for e in self.events:
            now[e.category] += e.size_bytes
            for c in CATEGORIES:
                cols[c].append(now[c])
        return {c: v for c, v in cols.items() if any(v)}

    def peak(self) -> tuple[int, int]:
        """(event index, live bytes) of the highest point; the first such event."""
        best_i, best = -1, self.baseline_bytes
        for i, v in enumerate(self.live()):
            if v > best:
                best_i, best = i, v
        return best_i, best

    def phase_peaks(self) -> dict[str, int]:
        """The highest live bytes inside each phase's spans (the last iteration's when there are several)."""
        live = self.live()
        return {phase: live[i] for phase, i in self.phase_peak_indices(live).items()}

    def composition_at(self, index: int) -> dict[str, int]:
        """Live bytes by category just after event ``index`` (-1: the baseline)."""
        return self.compositions_at([index])[index]

    def compositions_at(self, indices: Iterable[int]) -> dict[int, dict[str, int]]:
        """:meth:`composition_at` of several events in one pass."""
        wanted = sorted(set(indices))
        now = {c: self.baseline.get(c, 0) for c in CATEGORIES}
        out: dict[int, dict[str, int]] = {}
        k = 0
        while k < len(wanted) and wanted[k] < 0:
            out[wanted[k]] = {c: v for c, v in now.items() if v}
            k += 1
        for i, e in enumerate(self.events):
            if k >= len(wanted):
                break
            now[e.category] += e.size_bytes
            while k < len(wanted) and wanted[k] == i:
                out[i] = {c: v for c, v in now.items() if v}
                k += 1
        for rest in wanted[k:]:
            out[rest] = {c: v for c, v in now.items() if v}
        return out

    def phase_peak_indices(self, live: array[int] | None = None) -> dict[str, int]:
        """The event index of each phase's peak (last iteration; the first event reaching it), for
        :meth:`composition_at`; ``live`` is :meth:`live` when the caller has it."""
        live = self.live() if live is None else live
        last: dict[str, int] = {}
        for s in self.spans:
            last[s.phase] = max(last.get(s.phase, 0), s.iteration)
        out: dict[str, int] = {}
        for s in self.spans:
            if s.iteration != last[s.phase] or s.end <= s.start:
                continue
            i = max(range(s.start, s.end), key=lambda j: live[j])
            if s.phase not in out or live[i] > live[out[s.phase]]:
                out[s.phase] = i
        return out

    def largest_live(self, index: int, n: int = 10) -> list[TimelineEvent]:
        """The ``n`` largest allocations alive just after event ``index``."""
        alive: dict[int, TimelineEvent] = {}
        for i, e in enumerate(self.events[: index + 1]):
            if e.size_bytes > 0:
                alive[e.addr if e.addr else -(i + 1)] = e
            else:
                alive.pop(e.addr, None)
        return sorted(alive.values(), key=lambda e: -e.size_bytes)[:n]

    # ---- memory_viz's snapshot format ---------------------------------------------------------------------
    def to_snapshot(self) -> dict[str, Any]:
        """The events as a snapshot memory_viz opens (Active Memory Timeline, Allocator State History): one
        device trace of alloc / free_requested / free_completed with the phase, module path and op as frames, and
        one segment holding what is alive at the end."""
        trace: list[dict[str, Any]] = []
        live: dict[int, tuple[int, list[dict[str, Any]]]] = {}
        base = 1 << 32
        for e in self.events:
            frames = _frames(e)
            if e.size_bytes > 0:
                trace.append({"action": "alloc", "addr": e.addr or base + len(trace) * 512, "size": e.size_bytes,
                              "stream": 0, "frames": frames, "category": e.category})
                live[trace[-1]["addr"]] = (e.size_bytes, frames)
            else:
                size, alloc_frames = live.pop(e.addr, (-e.size_bytes, frames))
                for action in ("free_requested", "free_completed"):
                    trace.append({"action": action, "addr": e.addr, "size": size, "stream": 0,
                                  "frames": alloc_frames})
        blocks: list[dict[str, Any]] = [{"size": size, "requested_size": size, "state": "active_allocated",
                                          "frames": frames, "address": addr}
                                         for addr, (size, frames) in sorted(live.items())]
        total = sum(int(b["size"]) for b in blocks)
        segment = {"device": 0, "address": blocks[0]["address"] if blocks else base, "total_size": total,
                   "allocated_size": total, "active_size": total, "requested_size": total, "stream": 0,
                   "segment_type": "large", "blocks": [{k: v for k, v in b.items() if k != "address"}
                                                        for b in blocks]}
        return {"segments": [segment] if blocks else [], "device_traces": [trace],
                "memcalc": {"source": self.source, "rounding": self.rounding,
                            "spans": [[s.phase, s.iteration, s.start, s.end] for s in self.spans]}}

    def write_snapshot(self, path: str | Path, field: str = "snapshot_out") -> Path:
        """Write :meth:`to_snapshot` as a pickle (plain containers only), whole or not at all
        (:func:`~memcalc_gui.core.files.atomic_write`; :class:`~memcalc_gui.core.files.OutputError` naming
        ``field``); returns the file written."""
        from .files import atomic_write

        return atomic_write(path, pickle.dumps(self.to_snapshot(), protocol=4), field=field)


# ---- a coarse timeline from the analytic ledger ---------------------------------------------------------------
#: Objects that build up layer by layer: activations in forward (freed in backward), gradients in backward.
_LAYERED: Final = ("activations", "gradients")


class _Blocks:
    """Events that move each object's live bytes to a target, as blocks with addresses (a free releases a whole
    block, last allocated first), so the hover's "largest live" and memory_viz see real allocations."""

    def __init__(self) -> None:
        self.events: list[TimelineEvent] = []
        self.live: dict[str, list[tuple[int, int, str, str]]] = {c: [] for c in TENSOR_OBJECTS}
        self.next_addr = 1 << 32

    def now(self, cat: str) -> int:
        return sum(b[1] for b in self.live[cat])

    def set(self, cat: str, value: int, phase: str, module: str, op: str, free_only: bool = False) -> None:
        """Free whole blocks (the last allocated first) down to ``value``, shrinking the last one when only part of it
        goes; then (unless ``free_only``) allocate what is missing as one block."""
        cur = self.now(cat)
        stack = self.live[cat]
        while cur > value:
            addr, size, mod, what = stack[-1]
            if cur - size >= value:
                stack.pop()
                self.events.append(TimelineEvent(-size, cat, phase, 0, mod, what, addr))
                cur -= size
            else:  # part of a block: an anonymous free (the block stays listed, smaller)
                stack[-1] = (addr, size - (cur - value), mod, what)
                self.events.append(TimelineEvent(value - cur, cat, phase, 0, mod, what, 0))
                cur = value
        if value > cur and not free_only:
            self.events.append(TimelineEvent(value - cur, cat, phase, 0, module, op, self.next_addr))
            stack.append((self.next_addr, value - cur, module, op))
            self.next_addr += -(-(value - cur) // 512) * 512 + 512

    def set_all(self, target: Mapping[str, int], phase: str, module: str, op: str,
                only: Iterable[str] = TENSOR_OBJECTS, free_only: bool = False) -> None:
        """Frees first, then allocations: the moves never overshoot the target's total."""
        cats = [c for c in only if c in self.live]
        for c in cats:
            self.set(c, target.get(c, 0), phase, module, op, free_only=True)
        for c in cats if not free_only else ():
            if target.get(c, 0) > self.now(c):
                self.set(c, target.get(c, 0), phase, module, op)


def ledger_timeline(phases: Mapping[str, Mapping[str, int]], layers: int, prefix: str = "model.layers") -> Timeline:
    """A coarse timeline of one step drawn from an estimate's phase ledger (``Estimate.phases[p].objects``), for the
    analytic and fitted methods when no trace was run (source ``"ledger"``).

    The model loads; forward saves each decoder layer's share of the activations (and of autocast's weight copies) in
    turn, then the head and the loss add the forward's temporaries; backward frees activations, adds gradients and
    releases the copies layer by layer, passing through the ledger's backward peak where its gradients say it lies;
    the optimizer step reaches its peak and frees its temporaries and the gradients (``zero_grad(set_to_none=True)``).
    Each phase's highest point is that phase's tensor total in the ledger; the shape between the peaks is a per-layer
    interpolation, not a prediction."""
    layers = max(1, min(int(layers), 10_000))
    target = {p: {c: int(phases.get(p, {}).get(c, 0)) for c in TENSOR_OBJECTS} for p in PHASES}
    if max(sum(t.values()) for t in target.values()) > 2**62:
        raise InputError("timeline", "the step's tensors add up past 4 EiB, more than a timeline draws")
    b = _Blocks()
    spans: list[Span] = []

    def span(phase: str, start: int, entered_before: bool = False) -> None:
        # a phase that changes nothing (an optimizer without temporaries) is the moment its state was reached; so is
        # a phase whose entry state the previous one's last frees reached
        first = max(0, start - 1) if entered_before or len(b.events) == start else start
        spans.append(Span(phase, 0, first, len(b.events)))

    def share(start: int, end: int, k: int) -> int:
        return start + (end - start) * k // layers

    start = len(b.events)
    b.set_all(target["load"], "load", "model", "weights")
    span("load", start)

    fwd = target["forward"]
    start = len(b.events)
    per_layer = ("activations", "parameters")  # saved tensors, and autocast's 16-bit copies of each layer's weights
    b.set_all(fwd, "forward", "model", "state",
              only=[c for c in TENSOR_OBJECTS if c not in (*per_layer, "temporaries")])
    b.set("temporaries", 0, "forward", "model", "temporaries")
    b.set("gradients", fwd["gradients"], "forward", "model", "accumulated gradients")
    before = {c: b.now(c) for c in per_layer}
    for k in range(1, layers + 1):
        b.set_all({c: share(before[c], fwd[c], k) for c in per_layer}, "forward", f"{prefix}.{k - 1}",
                  "saved for backward", only=per_layer)
    b.set("temporaries", fwd["temporaries"], "forward", "lm_head", "logits and loss")
    # as forward ends, its own transients (the loss's, autocast's weight copies) go, and nothing layered enters
    # backward above the backward peak's own amount
    bwd, step = target["backward"], target["optimizer_step"]
    entry = bwd | {"temporaries": 0} | {c: min(b.now(c), bwd[c]) for c in _LAYERED}
    b.set_all(entry, "forward", "model", "end of forward", free_only=True)
    span("forward", start)

    start = len(b.events)
    b.set_all(entry, "backward", "model", "state")
    # layer by layer towards the state the optimizer step starts from: activations freed, gradients made, autocast's
    # weight copies released as each layer's backward has used them
    first = {c: b.now(c) for c in TENSOR_OBJECTS}
    last = step | {"optimizer_temporaries": 0, "temporaries": 0}
    # what a sharded step makes itself (ZeRO's fp32 gradient partition) appears in the step, not before: backward
    # ends no higher than its peak
    excess = sum(last.values()) - sum(bwd.values())
    for c in ("gradients", "parameters", *TENSOR_OBJECTS):
        cut = min(max(excess, 0), last[c])
        last[c] -= cut
        excess -= cut
    g0, g1 = first["gradients"], last["gradients"]
    # where the backward peak lies: as far through the layers as its gradients have come
    at = 0 if g1 == g0 else round(min(1.0, max(0.0, (bwd["gradients"] - g0) / (g1 - g0))) * layers)
    for k in range(0, layers + 1):
        if k:
            b.set_all({c: share(first[c], last[c], k) for c in TENSOR_OBJECTS}, "backward",
                      f"{prefix}.{layers - k}", "backward")
        if k == at:
            b.set_all(bwd, "backward", "lm_head" if k == 0 else f"{prefix}.{layers - k}", "backward peak")
    b.set_all(last, "backward", "model.embed_tokens", "backward")  # from a peak at the very end, back to ``last``
    span("backward", start, entered_before=True)

    start = len(b.events)
    b.set_all(step, "optimizer_step", "optimizer", "step")
    span("optimizer_step", start)
    b.set_all({"optimizer_temporaries": 0, "temporaries": 0, "gradients": 0, "activations": 0, "inputs": 0},
              "", "optimizer", "zero_grad", only=("optimizer_temporaries", "temporaries", "gradients", "activations",
                                                  "inputs"))
    return Timeline(tuple(b.events), "ledger", tuple(spans))


def _frames(e: TimelineEvent) -> list[dict[str, Any]]:
    """memory_viz shows frames innermost first: the op, then each module of the path, then the phase."""
    frames = [{"filename": e.module or "model", "line": 0, "name": e.op or "op"}]
    parts = e.module.split(".") if e.module else []
    for i in range(len(parts) - 1, 0, -1):
        frames.append({"filename": ".".join(parts[:i]), "line": 0, "name": "forward"})
    frames.append({"filename": f"memcalc {e.phase or 'step'}", "line": e.iteration, "name": e.category})
    return frames


# ---- reading real snapshots ---------------------------------------------------------------------------------
# A snapshot is a user's file from anywhere. What is read is bounded before anything is built from it: the file's
# size (and a regular file only: core.files), the pickle's opcodes (nothing named is imported, no memo index a
# pickler could not have written), the entries, the stack frames read, the length of each text, the spans. Each
# field is checked against the format PyTorch writes (``torch.cuda.memory._snapshot``'s docstring: Snapshot,
# Segment, Block, Frame, TraceEntry) before it is used, so a malformed file is one line naming the snapshot.
# docs/reliability.md gives the measured sizes of real snapshots beside these limits.

#: The largest snapshot or profiler timeline file read (bytes).
MAX_SNAPSHOT_BYTES: Final = 2**30
#: The most device traces a snapshot may hold (one per GPU of the process).
MAX_DEVICES: Final = 4096
#: The innermost frames of one entry's stack that are read (a deeper stack's outer frames are not looked at).
MAX_STACK_READ: Final = 1024
#: Stack frames read in all (a frame list shared by many entries is read once).
MAX_FRAMES_READ: Final = 50_000_000
#: The longest text of a frame (file name, function name) or a category.
MAX_TEXT_CHARS: Final = 65_536
#: The most phase spans memcalc's own snapshot may carry, and segment blocks read in all.
MAX_SPANS: Final = 100_000
MAX_BLOCKS: Final = 5_000_000
#: Bounds of a frame's line number and an address.
_LINE_RANGE: Final = (-(2**31), 2**31)
_ADDR_MAX: Final = 2**64


def _bad(message: str) -> InputError:
    return InputError("snapshot", message)


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles plain data only: any class or function a pickle names is refused (nothing runs)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names the Python object {module:.60}.{name:.60}, which a memory snapshot "
                                     "never does")


#: The largest memo index a pickle may name with PUT or LONG_BINPUT (and never past its own offset: every object
#: stored took at least a byte before it). Python's picklers of protocol 4 and 5, PyTorch's included, write MEMOIZE
#: and no index at all; 2²⁴ indices make a memo table of 256 MiB at most.
MAX_MEMO_INDEX: Final = 2**24


def _opcode_table() -> tuple[list[int], dict[str, int]]:
    """For :func:`_check_opcodes`: each opcode's whole length (opcode and argument) where it is fixed and nothing is
    checked in it (> 0), else 0 (an opcode that needs a look, or none at all); and the codes by name."""
    import pickletools

    skip = [0] * 256
    codes: dict[str, int] = {}
    for op in pickletools.opcodes:
        code = op.code.encode("latin-1")[0]
        codes[op.name] = code
        n = 0 if op.arg is None else op.arg.n
        if n >= 0 and op.name not in ("LONG_BINPUT", "STOP"):
            skip[code] = n + 1
    return skip, codes


_SKIP, _CODE = _opcode_table()
#: Opcodes whose argument runs to a newline (protocol 0 text), and those of two such arguments.
_TEXT_ARGS: Final = frozenset(_CODE[n] for n in ("INT", "LONG", "STRING", "UNICODE", "FLOAT", "GET", "PUT", "PERSID"))
_TWO_LINES: Final = frozenset((_CODE["GLOBAL"], _CODE["INST"]))
#: Opcodes whose argument's length is stored before it, by the width of that length (signed for BINSTRING).
_SIZED: Final = {**dict.fromkeys((_CODE[n] for n in ("LONG1", "SHORT_BINSTRING", "SHORT_BINBYTES",
                                                     "SHORT_BINUNICODE")), 1),
                 **dict.fromkeys((_CODE[n] for n in ("LONG4", "BINSTRING", "BINBYTES", "BINUNICODE")), 4),
                 **dict.fromkeys((_CODE[n] for n in ("BINBYTES8", "BYTEARRAY8", "BINUNICODE8")), 8)}
_SIGNED: Final = frozenset((_CODE["LONG4"], _CODE["BINSTRING"]))


def _check_opcodes(data: bytes) -> None:
    """Walk a pickle's opcodes, building nothing: an unknown opcode, a negative length, or a memo index no pickler
    writes (:data:`MAX_MEMO_INDEX`) is refused. CPython's unpickler makes its memo table as large as the largest
    index it is given: a 9-byte pickle asking for index 10⁹ took 48 s and 15 GB here. The common opcodes (fixed
    length, nothing to check) take one table look-up each: a real snapshot walks in about a third of a second per
    million opcodes."""
    skip, n, i = _SKIP, len(data), 0
    stop, long_binput, put = _CODE["STOP"], _CODE["LONG_BINPUT"], _CODE["PUT"]
    while i < n:
        k = skip[data[i]]
        if k:
            i += k
            continue
        code = data[i]
        i += 1
        if code == stop:
            return
        if code == long_binput:
            if int.from_bytes(data[i:i + 4], "little") > min(i, MAX_MEMO_INDEX):
                raise _bad(f"not a memory snapshot: a memo index at offset {i - 1:,} no pickler writes")
            i += 4
        elif code in _SIZED:
            width = _SIZED[code]
            if i + width > n:
                return  # truncated: the unpickler says so
            length = int.from_bytes(data[i:i + width], "little", signed=code in _SIGNED)
            if length < 0:
                raise _bad(f"not a memory snapshot: a negative length at offset {i - 1:,}")
            i += width + length
        elif code in _TEXT_ARGS or code in _TWO_LINES:
            j = data.find(b"\n", i)
            if j < 0:
                return
            if code == put:
                text = data[i:j]
                if not (0 < len(text) <= 19 and text.isdigit()) or int(text) > min(i, MAX_MEMO_INDEX):
                    raise _bad(f"not a memory snapshot: a memo index at offset {i - 1:,} no pickler writes")
            if code in _TWO_LINES:
                j = data.find(b"\n", j + 1)
                if j < 0:
                    return
            i = j + 1
        else:
            raise _bad(f"not a memory snapshot: byte 0x{code:02x} at offset {i - 1:,} is not a pickle opcode")


def load_snapshot(data: bytes) -> Any:
    """The object in a snapshot pickle, read without running code and within the limits above; :class:`InputError`
    naming ``snapshot``."""
    if len(data) > MAX_SNAPSHOT_BYTES:
        raise _bad(f"the file is larger than {MAX_SNAPSHOT_BYTES // 2**20:,} MiB")
    _check_opcodes(data)
    try:
        obj = _PlainUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise _bad(f"not a memory snapshot: {exc}") from None
    except (EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError, MemoryError, RecursionError,
            OverflowError, UnicodeDecodeError) as exc:
        raise _bad(f"not a readable pickle (truncated or corrupt: {type(exc).__name__})") from None
    return obj


def read_timeline(data: bytes, device: int | None = None) -> Timeline:
    """A timeline from a file's bytes: a snapshot pickle, or a PyTorch profiler memory timeline
    (``profile.export_memory_timeline("x.json")``, JSON). :class:`InputError` naming ``snapshot`` otherwise."""
    if data[:1] in (b"[", b"{") or data[:3] == b"\xef\xbb\xbf" or data[:1].isspace():
        return timeline_from_profiler_json(data)
    return timeline_from_snapshot(load_snapshot(data), device)


def read_timeline_file(path: str | Path, device: int | None = None) -> Timeline:
    """:func:`read_timeline` of the file at ``path``, read through the bounded reader (a regular file of at most
    :data:`MAX_SNAPSHOT_BYTES`: a FIFO, a device or a folder is refused before any read)."""
    from .files import read_regular

    return read_timeline(read_regular(path, field="snapshot", limit=MAX_SNAPSHOT_BYTES, what="memory snapshot"),
                         device)


#: ``torch.profiler._memory_profiler._CATEGORY_TO_INDEX`` order (index 0 of each row is unused), as ledger objects.
PROFILER_JSON_CATEGORIES: Final = ("parameters", "optimizer_state", "inputs", "temporaries", "activations",
                                   "gradients", "temporaries", "unknown")

_INT_ONLY: Final = {int}
#: Rows of a profiler timeline parsed in one call of the JSON decoder: flat ``[…]`` runs separated by commas.
ROWS_AT_ONCE: Final = 4096
_ROW_RUN: Final = re.compile(r"\s*\[[^\[\]]*\](?:\s*,\s*\[[^\[\]]*\]){0," + str(ROWS_AT_ONCE - 1) + "}")
#: What the times of a profiler timeline are written with (numbers, commas, spaces): anything else is refused.
_NUMBER_CHARS: Final = str.maketrans("", "", "0123456789.eE+-, \t\r\n")
_SPACE: Final = re.compile(r"\s*")


def timeline_from_profiler_json(data: bytes | str) -> Timeline:
    """A PyTorch profiler memory timeline (``[times, sizes]``: live bytes per category after each timestamp, in
    ``_memory_profiler``'s category order: parameter, optimizer state, input, temporary, activation, gradient,
    autograd detail, unknown) as a timeline of per-category changes. It names no phases; PyTorch's categories
    become ledger objects (autograd detail joins temporaries).

    Read a row at a time (a real step's file runs to hundreds of MB): the times are checked to be numbers and
    counted, never built; each row is parsed alone and turned into changes kept in two compact arrays, and events
    are made only once their count is known to be within :data:`MAX_EVENTS`."""
    import json

    def expected() -> InputError:
        return _bad("not a memory timeline: expected [times, sizes by category] as torch.profiler's "
                    "export_memory_timeline writes it")

    def unparsable(what: str) -> InputError:
        return _bad(f"not a memory timeline: the JSON does not parse ({what})")

    if isinstance(data, bytes):
        if len(data) > MAX_SNAPSHOT_BYTES:
            raise _bad(f"the file is larger than {MAX_SNAPSHOT_BYTES // 2**20:,} MiB")
        if data.count(b"[") > MAX_EVENTS + 3:
            raise _bad(f"more than {MAX_EVENTS:,} samples")
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError:
            raise unparsable("UnicodeDecodeError") from None
    else:
        text = data
    decoder = json.JSONDecoder()
    i = _SPACE.match(text).end()  # type: ignore[union-attr]
    if text[i:i + 1] != "[":
        if text[i:i + 1] == "{":
            raise expected()
        raise unparsable("JSONDecodeError")
    i = _SPACE.match(text, i + 1).end()  # type: ignore[union-attr]
    if text[i:i + 1] != "[":
        raise expected()
    close = text.find("]", i)
    if close < 0:
        raise unparsable("JSONDecodeError")
    times = text[i + 1:close]
    if times.translate(_NUMBER_CHARS):
        raise expected()
    count = times.count(",") + 1 if times.strip() else 0
    i = _SPACE.match(text, close + 1).end()  # type: ignore[union-attr]
    if text[i:i + 1] != ",":
        raise unparsable("JSONDecodeError") if i >= len(text) else expected()
    i = _SPACE.match(text, i + 1).end()  # type: ignore[union-attr]
    if text[i:i + 1] != "[":
        raise expected() if i < len(text) else unparsable("JSONDecodeError")
    i += 1
    n = len(PROFILER_JSON_CATEGORIES)
    previous = [0] * n
    cats, deltas = array("B"), array("q")
    every = range(n)
    rows = 0
    while True:
        i = _SPACE.match(text, i).end()  # type: ignore[union-attr]
        if text[i:i + 1] == "]":
            i += 1
            break
        if rows:
            if text[i:i + 1] != ",":
                raise unparsable("JSONDecodeError")
            i += 1
        run = _ROW_RUN.match(text, i)  # up to ROWS_AT_ONCE rows, parsed together by the C decoder
        try:
            if run is None:  # not a flat row: parsed alone, to say what it is
                chunk = [decoder.raw_decode(text, _SPACE.match(text, i).end())[0]]  # type: ignore[union-attr]
            else:
                chunk = json.loads(f"[{run.group()}]")
                i = run.end()
        except (ValueError, RecursionError) as exc:
            raise unparsable(type(exc).__name__) from None
        values = list(itertools.chain.from_iterable(r for r in chunk if type(r) is list))
        if any(type(r) is not list or len(r) != n + 1 for r in chunk) or set(map(type, values)) != _INT_ONLY or \
                min(values) < -MAX_SIZE_BYTES or max(values) > MAX_SIZE_BYTES:
            raise _bad(f"a sample is not {n + 1} integers (the profiler's categories)")
        rows += len(chunk)
        for row in chunk:
            sizes = row[1:]
            if sizes == previous:
                continue
            change = list(map(operator.sub, sizes, previous))
            if all(change):
                cats.extend(every)
                deltas.extend(change)
            else:
                for k in itertools.compress(every, change):
                    cats.append(k)
                    deltas.append(change[k])
            previous = sizes
        if len(cats) > MAX_EVENTS:
            raise _bad(f"more than {MAX_EVENTS:,} changes")
    i = _SPACE.match(text, i).end()  # type: ignore[union-attr]
    if text[i:i + 1] != "]" or text[i + 1:].strip():
        raise unparsable("JSONDecodeError")
    if rows != count:
        raise expected()
    if sum(abs(d) for d in deltas) > 2**62:
        raise _bad("its sizes add up past 4 EiB: not a real profiler's timeline")
    names = PROFILER_JSON_CATEGORIES
    return Timeline(tuple(TimelineEvent(d, names[c], "", 0, op="profiler") for c, d in zip(cats, deltas, strict=True)),
                    "profiler")


#: Frame names and files that place a CUDA allocation in a phase of the step.
_BACKWARD = ("backward", "_engine_run_backward", "autograd/graph.py", "run_backward")
_OPTIMIZER = ("torch/optim/", "optimizer.py", "bitsandbytes/optim", "zero_grad")
#: What a frame says of its allocation (OR-ed over a stack by :class:`_StackReader`).
_OPT, _OPT_STATE, _BWD, _ACC, _FWD = 1, 2, 4, 8, 16


def _frame_flags(filename: str, name: str) -> int:
    text = f"{filename}:{name}"
    flags = 0
    if any(k in text for k in _OPTIMIZER):
        flags |= _OPT
    if "zeros_like" in text or "_init_group" in text:
        flags |= _OPT_STATE
    if any(k in text for k in _BACKWARD):
        flags |= _BWD
    if "accumulate" in text.lower():
        flags |= _ACC
    if "forward" in text or "torch/nn/modules" in text:
        flags |= _FWD
    return flags


class _StackReader:
    """Checks and reads the stack frames of a snapshot's entries, each frame record and each frame list once: PyTorch
    shares frame records between entries, and a hostile file can share one list among every entry. What an entry
    costs is then one look-up; every frame read counts toward :data:`MAX_FRAMES_READ`."""

    def __init__(self) -> None:
        self.frames: dict[int, tuple[int, str, str, int]] = {}  # id → (flags, filename, name, line)
        self.stacks: dict[int, tuple[str, str, str, str]] = {}  # id → (phase, category, module, op)
        self.read = 0

    def frame(self, f: Any) -> tuple[int, str, str, int]:
        got = self.frames.get(id(f))
        if got is not None:
            return got
        if not isinstance(f, dict):
            raise _bad("a stack frame is not a record of filename, line and name")
        filename, name, line = f.get("filename", ""), f.get("name", ""), f.get("line", 0)
        if not isinstance(filename, str) or not isinstance(name, str):
            raise _bad("a stack frame's filename or name is not text")
        if len(filename) > MAX_TEXT_CHARS or len(name) > MAX_TEXT_CHARS:
            raise _bad(f"a stack frame's text is longer than {MAX_TEXT_CHARS:,} characters")
        line = 0 if line is None else line
        if not isinstance(line, int) or isinstance(line, bool) or not _LINE_RANGE[0] <= line < _LINE_RANGE[1]:
            raise _bad("a stack frame's line is not a line number")
        got = (_frame_flags(filename, name), filename, name, line)
        self.frames[id(f)] = got
        return got

    def count(self, n: int) -> None:
        self.read += n
        if self.read > MAX_FRAMES_READ:
            raise _bad(f"its stacks hold more than {MAX_FRAMES_READ:,} frames in all (record fewer entries, "
                       "max_entries, or Python stacks only)")

    def stack(self, frames: list[Any]) -> tuple[str, str, str, str]:
        """(phase, category, module, op) of an allocation from its stack frames (innermost first)."""
        got = self.stacks.get(id(frames))
        if got is not None:
            self.count(1)
            return got
        read = frames[:MAX_STACK_READ]
        self.count(max(1, len(read)))
        flags, module = 0, ""
        for f in read:
            bits, filename, name, line = self.frame(f)
            flags |= bits
            if not module and name == "forward" and "torch/nn/modules" not in filename:
                module = f"{filename}:{line}"
        op = self.frame(read[0])[2] if read else ""
        if flags & _OPT:
            phase, cat = "optimizer_step", "optimizer_state" if flags & _OPT_STATE else "optimizer_temporaries"
        elif flags & _BWD:
            phase, cat = "backward", "gradients" if flags & _ACC else "temporaries"
        elif flags & _FWD:
            phase, cat = "forward", "activations"
        else:
            phase, cat = "", "unknown"
        got = (phase, cat, module, op)
        self.stacks[id(frames)] = got
        return got

    def own(self, frames: list[Any]) -> tuple[str, str, int, str, str]:
        """(phase, category, iteration, module, op) of memcalc's own snapshot: the outermost frame names the phase,
        the iteration and the ledger object, the innermost the module and op (:func:`_frames`)."""
        self.count(2)
        _, outer_file, outer_name, line = self.frame(frames[-1])
        _, inner_file, inner_name, _ = self.frame(frames[0])
        phase = outer_file.removeprefix("memcalc ")
        if line < 0:
            raise _bad("memcalc's iteration number is negative")
        return (phase if phase in PHASES else "", outer_name if outer_name in CATEGORIES else "unknown", line,
                inner_file, inner_name)


def _an(action: str) -> str:
    return f"an {action}" if action[:1] in "aeiou" else f"a {action}"


def _size(value: Any, what: str, upper: int = MAX_SIZE_BYTES) -> int:
    """A non-negative integer field of a snapshot, at most ``upper``; :class:`InputError` otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= upper:
        raise _bad(f"{what} is not a whole number of bytes between 0 and {upper:,}")
    return value


def _snapshot_device(traces: list[Any], device: int | None) -> int:
    if len(traces) > MAX_DEVICES:
        raise _bad(f"it holds traces of more than {MAX_DEVICES:,} devices")
    if device is None:
        return max(range(len(traces)), key=lambda i: len(traces[i]) if isinstance(traces[i], list) else -1,
                   default=0)
    return device


def _own_marker(obj: dict[str, Any]) -> dict[str, Any] | None:
    mine = obj.get("memcalc")
    if mine is None:
        return None
    if not isinstance(mine, dict):
        raise _bad("its memcalc record is not a record")
    return mine


#: The sources memcalc's own snapshots name (``Timeline.source``).
_OWN_SOURCES: Final = ("trace", "measured", "ledger", "snapshot", "profiler")


def timeline_from_snapshot(obj: Any, device: int | None = None) -> Timeline:
    """The timeline of one device of a snapshot (``torch.cuda.memory._dump_snapshot``, or memcalc's own): events
    from its device trace, phases from memcalc's spans or from stack frames (optimizer code, autograd's backward,
    module forwards), what was alive before the trace started as the baseline. Every field read is checked (types,
    ranges, index bounds, the limits above): :class:`InputError` naming ``snapshot`` if malformed."""
    if isinstance(obj, list):  # segments only (torch.cuda.memory_snapshot())
        obj = {"segments": obj, "device_traces": []}
    if not isinstance(obj, dict) or not isinstance(obj.get("device_traces"), list):
        raise _bad("not a memory snapshot: no device_traces (write one with "
                   "torch.cuda.memory._record_memory_history() and _dump_snapshot())")
    traces = obj["device_traces"]
    device = _snapshot_device(traces, device)
    if not traces or not 0 <= device < len(traces) or not isinstance(traces[device], list):
        raise _bad(f"the snapshot has no trace for device {device}")
    trace = traces[device]
    if len(trace) > MAX_EVENTS:
        raise _bad(f"more than {MAX_EVENTS:,} events")
    mine = _own_marker(obj)
    stacks = _StackReader()
    events: list[TimelineEvent] = []
    live: dict[int, TimelineEvent] = {}
    for raw in trace:
        if type(raw) is not dict:
            raise _bad("a trace entry is not a record")
        action = raw.get("action")
        if action != "alloc" and action != "free_completed":
            if type(action) is not str:
                raise _bad("a trace entry names no action")
            continue
        addr, size = raw.get("addr"), raw.get("size")
        if type(addr) is not int or type(size) is not int or not 0 <= addr < _ADDR_MAX or \
                not 0 <= size <= MAX_SIZE_BYTES:
            raise _bad(f"{_an(action)} entry has no integer address and size")
        if action == "free_completed":
            start = live.pop(addr, None)
            if start is None:  # allocated before the trace began: part of the baseline
                events.append(TimelineEvent(-size, "unknown", "", 0, "", "", addr))
            else:
                events.append(TimelineEvent(-start.size_bytes, start.category, start.phase, start.iteration,
                                            start.module, start.op, addr))
            continue
        frames = raw.get("frames")
        if frames is None:
            frames = []
        elif type(frames) is not list:
            raise _bad(f"{_an(action)} entry's frames are not a list")
        if mine is not None and frames:
            phase, cat, iteration, module, op = stacks.own(frames)
            e = TimelineEvent(size, cat, phase, iteration, module, op, addr)
        else:
            phase, cat, module, op = stacks.stack(frames)
            category = raw.get("category")
            if category is not None and type(category) is str and category in PROFILER_CATEGORIES:
                cat = PROFILER_CATEGORIES[category]  # PyTorch's own, when given
                if cat == "temporaries" and phase == "optimizer_step":
                    cat = "optimizer_temporaries"
            e = TimelineEvent(size, cat, phase, 0, module, op, addr)
        events.append(e)
        live[addr] = e
    segs = _segments(obj.get("segments"), device)
    baseline: dict[str, int] = {}
    freed_early = -sum(e.size_bytes for e in events if e.size_bytes < 0 and e.category == "unknown" and not e.phase)
    at_end = segs[1]
    traced_at_end = sum(e.size_bytes for e in events)
    if at_end > traced_at_end or freed_early:
        baseline["unknown"] = max(freed_early, at_end - traced_at_end)
    if sum(abs(e.size_bytes) for e in events) + sum(baseline.values()) > 2**62:
        raise _bad("its sizes add up past 4 EiB: not a real allocator's trace")
    spans = _own_spans(mine, len(events)) if mine is not None and "spans" in mine else _spans_of(events)
    source = mine.get("source") if mine is not None else "snapshot"
    return Timeline(tuple(events), source if isinstance(source, str) and source in _OWN_SOURCES else "trace", spans,
                    baseline, reserved_bytes=min(segs[0], 2**62) if mine is None else 0)


def _segments(raw: Any, device: int) -> tuple[int, int]:
    """(reserved bytes, bytes of active blocks) of ``device``'s segments; every segment is checked, and each list
    of blocks once however many segments share it."""
    if raw is None:
        return 0, 0
    if not isinstance(raw, list):
        raise _bad("its segments are not a list")
    if len(raw) > MAX_BLOCKS:
        raise _bad(f"more than {MAX_BLOCKS:,} segments")
    reserved, active, blocks_read = 0, 0, 0
    read: dict[int, int] = {}  # id of a blocks list → its active bytes
    for seg in raw:
        if type(seg) is not dict:
            raise _bad("a segment is not a record")
        on = seg.get("device", device)
        if type(on) is not int:
            raise _bad("a segment's device is not a number")
        blocks = seg.get("blocks", [])
        if type(blocks) is not list:
            raise _bad("a segment's blocks are not a list")
        if id(blocks) not in read:
            blocks_read += len(blocks)
            if blocks_read > MAX_BLOCKS:
                raise _bad(f"its segments hold more than {MAX_BLOCKS:,} blocks in all")
            read[id(blocks)] = sum(_block_bytes(block) for block in blocks)
        if on == device:
            reserved += _size(seg.get("total_size", 0), "a segment's total_size")
            active += read[id(blocks)]
    return reserved, active


def _block_bytes(block: Any) -> int:
    """The bytes of an allocated block (0 for a free one); :class:`InputError` for a malformed one."""
    if type(block) is not dict:
        raise _bad("a segment's block is not a record")
    state = block.get("state")
    if type(state) is not str or len(state) > MAX_TEXT_CHARS:
        raise _bad("a block's state is not text")
    return _size(block.get("size"), "a block's size") if state == "active_allocated" else 0


#: PyTorch's memory profiler categories (``torch.profiler._memory_profiler.Category``) as ledger objects.
PROFILER_CATEGORIES: Final = {"parameter": "parameters", "gradient": "gradients", "activation": "activations",
                              "optimizer_state": "optimizer_state", "input": "inputs", "temporary": "temporaries",
                              "autograd_detail": "temporaries"}


def _own_spans(mine: dict[str, Any], events: int) -> tuple[Span, ...]:
    """The phase spans memcalc wrote (``[phase, iteration, start, end]`` each), every index within the events."""
    raw = mine["spans"]
    if not isinstance(raw, list) or len(raw) > MAX_SPANS:
        raise _bad(f"memcalc's phase spans are not a list of at most {MAX_SPANS:,}")
    out = []
    for item in raw:
        if not isinstance(item, list | tuple) or len(item) != 4:
            raise _bad("a phase span is not [phase, iteration, start, end]")
        phase, iteration, start, end = item
        if not isinstance(phase, str) or phase not in PHASES:
            raise _bad("a phase span names no phase of the step")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (iteration, start, end)) or \
                not (0 <= iteration < 2**31 and 0 <= start <= end <= events):
            raise _bad(f"a phase span's indices are not within the {events:,} events")
        out.append(Span(phase, iteration, start, end))
    return tuple(out)


def _spans_of(events: Sequence[TimelineEvent]) -> tuple[Span, ...]:
    # contiguous runs of allocations in one phase, frees joining the run they fall in
    spans: list[Span] = []
    current, start, it = "", 0, 1
    seen: set[str] = set()
    for i, e in enumerate(events):
        if e.size_bytes <= 0 or not e.phase or e.phase == current:
            continue
        if current:
            spans.append(Span(current, it, start, i))
        if e.phase == "forward" and "optimizer_step" in seen:
            it += 1
            seen.clear()
        current, start = e.phase, i
        seen.add(e.phase)
    if current:
        spans.append(Span(current, it, start, len(events)))
    return tuple(spans)


def phase_order(spans: Iterable[Span]) -> list[str]:
    """The phases present, in the ledger's order."""
    present = {s.phase for s in spans}
    return [p for p in PHASES if p in present]


@dataclass(frozen=True)
class PhaseComparison:
    """One phase of a timeline beside an estimate: peaks, their difference and the object that differs most."""

    phase: str
    timeline_bytes: int
    estimate_bytes: int
    timeline_objects: dict[str, int]
    estimate_objects: dict[str, int]

    @property
    def difference_bytes(self) -> int:
        """Timeline − estimate (signed: positive when the run needed more)."""
        return self.timeline_bytes - self.estimate_bytes

    @property
    def largest_gap(self) -> tuple[str, int]:
        """The ledger object whose bytes differ most at the two peaks, and by how much (timeline − estimate)."""
        keys = set(self.timeline_objects) | set(self.estimate_objects)
        if not keys:
            return "", 0
        key = max(sorted(keys), key=lambda k: abs(self.timeline_objects.get(k, 0) - self.estimate_objects.get(k, 0)))
        return key, self.timeline_objects.get(key, 0) - self.estimate_objects.get(key, 0)

    def to_json(self) -> dict[str, Any]:
        obj, gap = self.largest_gap
        return {"phase": self.phase, "timeline_bytes": self.timeline_bytes, "estimate_bytes": self.estimate_bytes,
                "difference_bytes": self.difference_bytes, "largest_gap_object": obj, "largest_gap_bytes": gap,
                "timeline_objects": self.timeline_objects, "estimate_objects": self.estimate_objects}


def compare_phases(timeline: Timeline, phases: dict[str, dict[str, int]]) -> list[PhaseComparison]:
    """Each phase the timeline shows beside the estimate's tensor objects of that phase (``Estimate.phases[p]
    .objects`` without the CUDA context and allocator reserve, which a snapshot does not hold). A timeline without
    phases (a profiler's) gives one row, ``peak``: its highest point beside the estimate's peak phase."""
    out = []
    peaks = timeline.phase_peak_indices()
    live = timeline.live()
    compositions = timeline.compositions_at(list(peaks.values()) + ([timeline.peak()[0]] if not peaks else []))
    if not peaks and timeline.events and phases:
        i, _ = timeline.peak()
        tensors = {p: {k: v for k, v in objs.items() if v and k not in ("cuda_context", "allocator_reserve")}
                   for p, objs in phases.items()}
        top = max(tensors, key=lambda p: sum(tensors[p].values()))
        return [PhaseComparison("peak", live[i], sum(tensors[top].values()), compositions[i], tensors[top])]
    for phase in PHASES:
        if phase not in peaks or phase not in phases:
            continue
        est = {k: v for k, v in phases[phase].items() if v and k not in ("cuda_context", "allocator_reserve")}
        i = peaks[phase]
        out.append(PhaseComparison(phase, live[i], sum(est.values()), compositions[i], est))
    return out
