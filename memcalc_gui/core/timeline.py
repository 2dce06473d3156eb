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
import pickle
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
#: The most events a snapshot may hold (memory_viz's own default ring buffer keeps far fewer).
MAX_EVENTS: Final = 5_000_000
#: The largest snapshot file read (bytes).
MAX_SNAPSHOT_BYTES: Final = 2 * 2**30


@dataclass(frozen=True)
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

    def write_snapshot(self, path: str | Path) -> None:
        """Write :meth:`to_snapshot` as a pickle (plain containers only)."""
        Path(path).write_bytes(pickle.dumps(self.to_snapshot(), protocol=4))


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
class _PlainUnpickler(pickle.Unpickler):
    """Unpickles plain data only: any class or function a pickle names is refused (nothing runs)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names the Python object {module}.{name}, which a memory snapshot never does")


def read_timeline(data: bytes, device: int | None = None) -> Timeline:
    """A timeline from a file's bytes: a snapshot pickle, or a PyTorch profiler memory timeline
    (``profile.export_memory_timeline("x.json")``, JSON). :class:`InputError` naming ``snapshot`` otherwise."""
    if data[:1] in (b"[", b"{") or data[:3] == b"\xef\xbb\xbf":
        import json

        try:
            obj = json.loads(data.decode("utf-8-sig"))
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise InputError("snapshot", f"not a memory timeline: the JSON does not parse ({type(exc).__name__})") \
                from None
        return timeline_from_profiler_json(obj)
    return timeline_from_snapshot(load_snapshot(data), device)


#: ``torch.profiler._memory_profiler._CATEGORY_TO_INDEX`` order (index 0 of each row is unused), as ledger objects.
PROFILER_JSON_CATEGORIES: Final = ("parameters", "optimizer_state", "inputs", "temporaries", "activations",
                                   "gradients", "temporaries", "unknown")


def timeline_from_profiler_json(obj: Any) -> Timeline:
    """A PyTorch profiler memory timeline (``[times, sizes]``: live bytes per category after each timestamp, in
    ``_memory_profiler``'s category order: parameter, optimizer state, input, temporary, activation, gradient,
    autograd detail, unknown) as a timeline of per-category changes. It names no phases; PyTorch's categories
    become ledger objects (autograd detail joins temporaries)."""
    if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], list) and isinstance(obj[1], list)
            and len(obj[0]) == len(obj[1])):
        raise InputError("snapshot", "not a memory timeline: expected [times, sizes by category] as "
                                     "torch.profiler's export_memory_timeline writes it")
    rows = obj[1]
    if len(rows) > MAX_EVENTS:
        raise InputError("snapshot", f"more than {MAX_EVENTS:,} samples")
    n = len(PROFILER_JSON_CATEGORIES)
    previous = [0] * n
    events: list[TimelineEvent] = []
    for row in rows:
        if not isinstance(row, list) or len(row) != n + 1 or \
                not all(isinstance(v, int) and not isinstance(v, bool) and abs(v) <= MAX_SIZE_BYTES for v in row):
            raise InputError("snapshot", f"a sample is not {n + 1} integers (the profiler's categories)")
        for i, value in enumerate(row[1:]):
            if value != previous[i]:
                events.append(TimelineEvent(value - previous[i], PROFILER_JSON_CATEGORIES[i], "", 0,
                                            op="profiler"))
                previous[i] = value
    if sum(abs(e.size_bytes) for e in events) > 2**62:
        raise InputError("snapshot", "its sizes add up past 4 EiB: not a real profiler's timeline")
    return Timeline(tuple(events), "profiler")


def load_snapshot(data: bytes) -> Any:
    """The object in a snapshot pickle, read without running code; :class:`InputError` naming ``snapshot``."""
    if len(data) > MAX_SNAPSHOT_BYTES:
        raise InputError("snapshot", f"the file is larger than {MAX_SNAPSHOT_BYTES // 2**30} GiB")
    try:
        obj = _PlainUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise InputError("snapshot", f"not a memory snapshot: {exc}") from None
    except (EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError, MemoryError, RecursionError,
            OverflowError, UnicodeDecodeError) as exc:
        raise InputError("snapshot", f"not a readable pickle (truncated or corrupt: {type(exc).__name__})") from None
    return obj


#: Frame names and files that place a CUDA allocation in a phase of the step.
_BACKWARD = ("backward", "_engine_run_backward", "autograd/graph.py", "run_backward")
_OPTIMIZER = ("torch/optim/", "optimizer.py", "bitsandbytes/optim", "zero_grad")


def _classify(frames: Sequence[Any]) -> tuple[str, str]:
    """(phase, category) of an allocation from its stack frames (innermost first)."""
    text = " ".join(f"{f.get('filename', '')}:{f.get('name', '')}" for f in frames if isinstance(f, dict))
    if any(k in text for k in _OPTIMIZER):
        return "optimizer_step", "optimizer_state" if ("zeros_like" in text or "_init_group" in text) \
            else "optimizer_temporaries"
    if any(k in text for k in _BACKWARD):
        return "backward", "gradients" if "accumulate" in text.lower() else "temporaries"
    if "forward" in text or "torch/nn/modules" in text:
        return "forward", "activations"
    return "", "unknown"


def timeline_from_snapshot(obj: Any, device: int | None = None) -> Timeline:
    """The timeline of one device of a snapshot (``torch.cuda.memory._dump_snapshot``, or memcalc's own): events
    from its device trace, phases from memcalc's spans or from stack frames (optimizer code, autograd's backward,
    module forwards), what was alive before the trace started as the baseline. :class:`InputError` if malformed."""
    if isinstance(obj, list):  # segments only (torch.cuda.memory_snapshot())
        obj = {"segments": obj, "device_traces": []}
    if not isinstance(obj, dict) or not isinstance(obj.get("device_traces"), list):
        raise InputError("snapshot", "not a memory snapshot: no device_traces (write one with "
                                     "torch.cuda.memory._record_memory_history() and _dump_snapshot())")
    traces = obj["device_traces"]
    if device is None:
        device = max(range(len(traces)), key=lambda i: len(traces[i]) if isinstance(traces[i], list) else 0,
                     default=0)
    if not traces or not 0 <= device < len(traces) or not isinstance(traces[device], list):
        raise InputError("snapshot", f"the snapshot has no trace for device {device}")
    trace = traces[device]
    if len(trace) > MAX_EVENTS:
        raise InputError("snapshot", f"more than {MAX_EVENTS:,} events")
    mine = obj.get("memcalc") if isinstance(obj.get("memcalc"), dict) else None
    events: list[TimelineEvent] = []
    live: dict[int, TimelineEvent] = {}
    for raw in trace:
        if not isinstance(raw, dict):
            raise InputError("snapshot", "a trace entry is not a record")
        action, addr, size = raw.get("action"), raw.get("addr"), raw.get("size")
        if action not in ("alloc", "free_completed"):
            continue
        if not isinstance(addr, int) or not isinstance(size, int) or not 0 <= size <= MAX_SIZE_BYTES:
            raise InputError("snapshot", f"a {action} entry has no integer address and size")
        frames: list[Any] = raw["frames"] if isinstance(raw.get("frames"), list) else []
        if action == "alloc":
            cat = raw.get("category")
            if mine is not None and isinstance(frames, list) and frames and isinstance(frames[-1], dict):
                outer = frames[-1]
                phase = str(outer.get("filename", "")).removeprefix("memcalc ")
                phase = "" if phase == "step" else phase
                cat = str(outer.get("name", "unknown"))
                e = TimelineEvent(size, cat if cat in CATEGORIES else "unknown", phase,
                                  int(outer.get("line", 0) or 0), str(frames[0].get("filename", "")),
                                  str(frames[0].get("name", "")), addr)
            else:
                phase, cat2 = _classify(frames)
                if isinstance(cat, str) and cat in PROFILER_CATEGORIES:  # PyTorch's own categories, when given
                    cat2 = PROFILER_CATEGORIES[cat]
                    if cat2 == "temporaries" and phase == "optimizer_step":
                        cat2 = "optimizer_temporaries"
                e = TimelineEvent(size, cat2, phase, 0, _module_of(frames), _op_of(frames), addr)
            events.append(e)
            live[addr] = e
        else:
            start = live.pop(addr, None)
            if start is None:  # allocated before the trace began: part of the baseline
                events.append(TimelineEvent(-size, "unknown", "", 0, "", "", addr))
            else:
                events.append(TimelineEvent(-start.size_bytes, start.category, start.phase, start.iteration,
                                            start.module, start.op, addr))
    baseline: dict[str, int] = {}
    freed_early = -sum(e.size_bytes for e in events if e.size_bytes < 0 and e.category == "unknown" and not e.phase)
    segs: list[Any] = [s for s in obj["segments"] if isinstance(s, dict) and s.get("device", device) == device] \
        if isinstance(obj.get("segments"), list) else []
    at_end = sum(_int(b.get("size")) for s in segs for b in (s.get("blocks") if isinstance(s.get("blocks"), list)
                                                              else []) if isinstance(b, dict)
                 and b.get("state") == "active_allocated")
    traced_at_end = sum(e.size_bytes for e in events)
    if at_end > traced_at_end or freed_early:
        baseline["unknown"] = max(freed_early, at_end - traced_at_end)
    if sum(abs(e.size_bytes) for e in events) + sum(baseline.values()) > 2**62:
        raise InputError("snapshot", "its sizes add up past 4 EiB: not a real allocator's trace")
    spans = _spans_of(events, mine)
    reserved = min(sum(_int(s.get("total_size")) for s in segs), 2**62)
    return Timeline(tuple(events), "snapshot" if mine is None else str(mine.get("source", "trace")), spans,
                    baseline, reserved_bytes=reserved if mine is None else 0)


def _int(value: Any) -> int:
    """A non-negative integer field of a snapshot, or 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


#: PyTorch's memory profiler categories (``torch.profiler._memory_profiler.Category``) as ledger objects.
PROFILER_CATEGORIES: Final = {"parameter": "parameters", "gradient": "gradients", "activation": "activations",
                              "optimizer_state": "optimizer_state", "input": "inputs", "temporary": "temporaries",
                              "autograd_detail": "temporaries"}


def _module_of(frames: Sequence[Any]) -> str:
    for f in frames:
        if isinstance(f, dict) and "torch/nn/modules" not in str(f.get("filename", "")) and \
                str(f.get("name", "")) == "forward":
            return f"{f.get('filename', '')}:{f.get('line', '')}"
    return ""


def _op_of(frames: Sequence[Any]) -> str:
    return str(frames[0].get("name", "")) if frames and isinstance(frames[0], dict) else ""


def _spans_of(events: Sequence[TimelineEvent], mine: dict[str, Any] | None) -> tuple[Span, ...]:
    if mine is not None and isinstance(mine.get("spans"), list):
        try:
            return tuple(Span(str(p), int(i), int(a), int(b)) for p, i, a, b in mine["spans"])
        except (TypeError, ValueError):
            pass
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
