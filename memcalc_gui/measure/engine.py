"""'Measure on this GPU': run a real training step of a setup and compare it with the estimate.

On CUDA the caching allocator's own counters are read at every phase boundary (after
``synchronize``): ``reset_peak_memory_stats``, ``max_memory_allocated``, ``memory_allocated``,
``memory_reserved``/``max_memory_reserved``, and ``mem_get_info`` for what lies outside PyTorch (the
CUDA context = total − free − reserved). On a machine without a GPU the live-storage tracker measures
CPU tensors instead (labelled so). When the full setup would not fit the device with margin, or would
take too long, a scaled-down setup (fewer layers, then a smaller micro-batch, then a shorter sequence)
is measured and compared with the estimate of exactly that setup. Any setup, ``full_size`` included, whose planned
resident size exceeds what this machine's memory has available (:mod:`.hostmem`) is refused before anything is
built (:func:`host_need`): on a machine without swap the kernel's OOM killer would otherwise end some process.

torch is imported inside functions only.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import math
import os
import pickle
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import install_hint
from ..core.errors import InputError, MemcalcError, one_line
from ..core.files import atomic_write
from ..core.model import spec_from_config
from ..core.reconcile import reconcile
from ..core.result import Result, evaluate
from ..core.setup import TrainingSetup, checkpoint_every
from ..core.timeline import Timeline, read_timeline
from ..core.units import format_bytes
from ..core.vocab import PHASES
from . import collect_garbage, exclusive_torch_job, hostmem
from .fitted import CONFIG_KEY, FittedScaling
from .layout import PROCESS_BYTES, check_measurable, measured_world, rank_job, scale_layout, start_seconds

#: Fraction of the device's free memory a scaled-down measurement plans to fill with its tensors (:func:`plan`).
MEMORY_MARGIN = 0.6
#: Fraction of this machine's available memory (:func:`.hostmem.available_bytes`) a measurement, full size or scaled
#: down, may plan to hold (:func:`host_need`): the rest is left to the other processes and to the estimate's error.
HOST_MARGIN = 0.8
#: A CPU step's resident peak over its tensor peak, beside the process's own ``PROCESS_BYTES`` (the allocator's and
#: the tracker's memory): measured here, VmHWM less the tensor peak was 389 MB for a 46 MiB step (torch and
#: transformers imported: 334 MB VmRSS), 555 MB for GPT-2's 2.3 GiB and 923 MB for Qwen2.5-0.5B's 9.2 GiB (1.07, 1.06).
RESIDENT_FACTOR = 1.1
#: A CUDA measurement's host memory beside its pinned buffers (torch's CUDA libraries, the context's host side): an
#: allowance, not measured here (no GPU on the machine that set it).
CUDA_PROCESS_BYTES = 2 * 2**30
#: Rough sustained throughput for planning the time budget (FLOP/s).
CPU_FLOPS = 2e10
CUDA_FLOPS = 1e14
#: Importing torch and transformers the first time, and building a model with random weights (per 10^9 params),
#: measured on a 2-core machine.
TORCH_IMPORT_S = 3.0
BUILD_S_PER_BILLION = 4.0
#: Per layer and micro-batch, the fixed cost of a forward and backward on the CPU under the tracker.
LAYER_OVERHEAD_S = 0.04
LEAK_TOLERANCE_BYTES = 64 * 1024
#: A layout's ranks: their step against the single-process CPU step (DTensor's and the collectives' dispatch, the
#: trackers of several processes), and what gloo moves per second between processes on one machine (measured here:
#: Qwen2.5-0.5B's rank steps took about twice the single-process time).
RANK_STEP_FACTOR = 1.5
GLOO_BYTES_PER_S = 1e9
#: Iterations a measurement runs at most: the second is already the steady state; a few more show a leak.
MAX_ITERATIONS = 20


class MeasureError(MemcalcError):
    """The measurement could not run (missing torch/transformers, unsupported setup)."""


class Cancelled(MemcalcError):
    """The user cancelled the measurement."""


ProgressFn = Callable[[str], None]


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "cuda" or "cpu"
    name: str  # "NVIDIA H100 80GB HBM3" or "CPU"
    total_bytes: int
    free_bytes: int
    #: This machine's available memory when the device was found (:func:`.hostmem.available_bytes`; ``None``:
    #: unknown, and then no setup is refused for it).
    host_free_bytes: int | None = None

    @property
    def label(self) -> str:
        return f"on {self.name}" if self.kind == "cuda" else "on this CPU"


@dataclass(frozen=True)
class PhaseReading:
    peak_bytes: int
    live_bytes: int
    objects: dict[str, int]
    reserved_bytes: int = 0


@dataclass(frozen=True)
class RankReading:
    """One rank of a multi-rank measurement beside its own estimate (a pipeline stage's, or the layout's rank)."""

    rank: int
    world: int
    stage: int | None  # its pipeline stage (0-based), None without pipeline parallelism
    stages: int
    phases: dict[str, PhaseReading]
    estimate_bytes: dict[str, int]  # the rank's estimated tensor bytes per phase
    live_bytes: list[int]

    @property
    def label(self) -> str:
        """``rank 2 of 4`` or ``rank 2 of 4 (stage 1 of 2)``, 1-based as people count."""
        stage = f" (stage {self.stage + 1} of {self.stages})" if self.stage is not None else ""
        return f"rank {self.rank + 1} of {self.world}{stage}"

    @property
    def peak_bytes(self) -> int:
        return max((p.peak_bytes for p in self.phases.values()), default=0)

    @property
    def error_pct(self) -> dict[str, float]:
        """(estimate − measured) / measured per phase, in percent."""
        return {name: (self.estimate_bytes[name] - r.peak_bytes) / r.peak_bytes * 100
                for name, r in self.phases.items() if r.peak_bytes and name in self.estimate_bytes}


@dataclass
class MeasureResult:
    """A measured step beside the estimate of the same setup."""

    device: DeviceInfo
    setup: TrainingSetup  # what was measured (scaled down when ``scaled``)
    requested: TrainingSetup
    scaled: bool
    scale_note: str
    phases: dict[str, PhaseReading]
    estimate: Result
    iterations_live_bytes: list[int]
    context_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    oom: str | None = None
    snapshot: str | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    #: The most host memory the step held (offloaded activations); 0 without offloading.
    host_bytes: int = 0
    #: Every allocation and free of the measured iterations (CPU: the tracker's; CUDA: the snapshot's, when one
    #: was written), for the timeline view.
    timeline: Timeline | None = field(default=None, repr=False)
    #: Every rank of a multi-rank measurement (``phases`` are then those of ``shown_rank``, the one the estimate
    #: shown describes: the most loaded pipeline stage's first rank, else the rank that held the most).
    ranks: list[RankReading] = field(default_factory=list)
    shown_rank: int = 0

    @property
    def measured_peak_bytes(self) -> int:
        return max((p.peak_bytes for p in self.phases.values()), default=0)

    @property
    def error_pct(self) -> dict[str, float]:
        """(estimate − measured) / measured per phase, in percent (positive: the estimate is higher)."""
        out = {}
        for name, reading in self.phases.items():
            est = self.estimate.estimate.phases[name].tensor_bytes
            if reading.peak_bytes:
                out[name] = (est - reading.peak_bytes) / reading.peak_bytes * 100
        return out

    @property
    def leak(self) -> dict[str, Any]:
        """Seed 004 Q5: live bytes growing from one steady-state iteration to the next."""
        live = self.iterations_live_bytes
        steady = live[1:] if len(live) > 2 else live
        growth = [b - a for a, b in itertools.pairwise(steady)]
        growing = bool(growth) and all(g > LEAK_TOLERANCE_BYTES for g in growth)
        return {"live_bytes_per_iteration": live, "growth_bytes": growth, "growing": growing}

    @property
    def signals(self) -> list[str]:
        if not self.phases or self.oom:
            return []
        allocated = self.measured_peak_bytes
        reserved = max(self.peak_reserved_bytes or allocated, allocated)
        # on a CPU the GPU's capacity says nothing about this run: judge against the machine's memory
        capacity = self.device.total_bytes if self.device.kind == "cpu" else \
            (self.requested.capacity_bytes or self.device.total_bytes)
        capacity = max(capacity, reserved)
        return list(reconcile(self.estimate.estimate.peak_tensor_bytes, allocated, reserved, capacity).signals)

    def measured_overheads(self) -> dict[str, Any] | None:
        """The CUDA context and allocator reserve measured here, for "Use measured overheads"."""
        if self.device.kind != "cuda" or self.context_bytes is None or not self.peak_reserved_bytes:
            return None
        allocated = self.measured_peak_bytes
        reserve = max(0.0, min(0.9, self.peak_reserved_bytes / allocated - 1)) if allocated else 0.0
        return {"cuda_context_bytes": int(self.context_bytes), "allocator_reserve": round(reserve, 4)}

    def headline(self) -> str:
        if self.oom:
            return self.oom
        err = self.error_pct
        worst = max(err, key=lambda k: abs(err[k])) if err else None
        where = ""
        if worst:
            value = err[worst] if abs(err[worst]) >= 0.05 else 0.0
            where = f"; largest phase error {value:+.1f} % in {worst.replace('_', ' ')}"
        kind = "CPU tensor measurement" if self.device.kind == "cpu" else "CUDA allocator"
        scaled = ", scaled-down setup" if self.scaled else ""
        if self.ranks:
            worst_rank = max(((r, ph) for r in self.ranks for ph in r.error_pct), default=None,
                             key=lambda pair: abs(pair[0].error_pct[pair[1]]))
            if worst_rank is not None:
                r, ph = worst_rank
                value = r.error_pct[ph] if abs(r.error_pct[ph]) >= 0.05 else 0.0
                where = f"; largest phase error {value:+.1f} % in {ph.replace('_', ' ')} on {r.label}"
            return (f"Measured {len(self.ranks)} ranks {self.device.label} (one gloo process each, {kind}{scaled})"
                    f"{where}.")
        return f"Measured {self.device.label} ({kind}{scaled}){where}."

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": 1,
            "device": self.device.name if self.device.kind == "cuda" else "cpu",
            "device_kind": self.device.kind,
            "setup": self.setup.describe(),
            "scaled": self.scaled,
            "scale_note": self.scale_note,
            "phases": {
                name: {"peak_bytes": r.peak_bytes, "live_bytes": r.live_bytes, "objects": dict(r.objects),
                       **({"reserved_bytes": r.reserved_bytes} if self.device.kind == "cuda" else {})}
                for name, r in self.phases.items()
            },
            "estimate": self.estimate.to_json(),
            "error_pct": {k: round(v, 3) for k, v in self.error_pct.items()},
            "signals": self.signals,
            "leak": self.leak,
            "context_bytes": self.context_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "measured_overheads": self.measured_overheads(),
            "oom": self.oom,
            "snapshot": self.snapshot,
            "seconds": round(self.seconds, 3),
            "notes": self.notes,
            "host_bytes": self.host_bytes,
            "ranks": [{"rank": r.rank, "stage": r.stage, "label": r.label,
                       "phases": {name: {"peak_bytes": p.peak_bytes, "live_bytes": p.live_bytes,
                                         "objects": dict(p.objects)} for name, p in r.phases.items()},
                       "estimate_bytes": dict(r.estimate_bytes),
                       "error_pct": {k: round(v, 3) for k, v in r.error_pct.items()},
                       "live_bytes_per_iteration": list(r.live_bytes)} for r in self.ranks],
            "shown_rank": self.shown_rank if self.ranks else None,
        }


# ---- device -------------------------------------------------------------------------------------
def _import_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise MeasureError(f"measuring needs PyTorch: {install_hint()}") from None
    return torch


def torch_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def _cpu_memory() -> tuple[int, int]:
    """This machine's memory and what is available of it (:mod:`.hostmem`: a cgroup's limit included); a guess
    where the system does not say (the device budget of a scaled-down plan needs a number)."""
    total = 0
    available = hostmem.available_bytes()
    free = available or 0
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in fh if ":" in line}
        total = info.get("MemTotal", 0)
        free = free or info.get("MemAvailable", 0)
    except OSError:
        pass
    if not total and hasattr(os, "sysconf"):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            free = total // 2
        except (ValueError, OSError):
            total = free = 8 * 2**30
    return total, free


def detect_device(device: str = "auto") -> DeviceInfo:
    """The device a measurement would use (``auto`` prefers CUDA)."""
    if device not in ("auto", "cpu", "cuda"):
        raise InputError("device", f"must be auto, cpu or cuda, got {device!r}")
    torch = _import_torch()
    if device in ("auto", "cuda") and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return DeviceInfo("cuda", torch.cuda.get_device_name(0), int(total), int(free), hostmem.available_bytes())
    if device == "cuda":
        raise MeasureError("no CUDA device is available to this PyTorch build")
    total, free = _cpu_memory()
    return DeviceInfo("cpu", "CPU", total, free, hostmem.available_bytes())


# ---- planning -----------------------------------------------------------------------------------
def _with_config(setup: TrainingSetup, **changes: Any) -> TrainingSetup:
    assert setup.model is not None
    cfg = dict(setup.model.raw)
    cfg.update(changes)
    spec = spec_from_config(cfg, name=f"{setup.model.name} (scaled down)", source=setup.model.source)
    return setup.with_changes(model=spec)


def _with_layers(setup: TrainingSetup, layers: int) -> TrainingSetup:
    assert setup.model is not None
    # the key the model is built from: the common name where the config has it (GPT-2's n_layer is its alias)
    raw = setup.model.raw
    key = "n_layer" if setup.model.family == "gpt2" and "num_hidden_layers" not in raw else "num_hidden_layers"
    return _with_config(setup, **{key: layers})


def _step_seconds(setup: TrainingSetup, flops: float) -> float:
    """One training step of one rank: the matmul work (6·N·tokens, N the rank's share of the model) or, for narrow
    deep models, the per-op overhead of each layer's forward and backward (about 40 ms per layer and micro-batch with
    the CPU tracker on a 2-core machine)."""
    par = setup.parallel
    t = setup.tokens * setup.grad_accum // par.cp
    scaled = FittedScaling.scaled(setup)  # a family without a block model: its layers, and the parameters a token uses
    layers = (setup.model.num_layers if setup.model is not None else scaled[0] if scaled else 1) // par.pp
    params = setup.extras.get("active_params") if scaled else None
    params = params if isinstance(params, int) and params > 0 else setup.num_params
    overhead = LAYER_OVERHEAD_S * (layers + 2) * setup.grad_accum * (1 if flops == CPU_FLOPS else 0.1)
    return max(6 * params / (par.tp * par.pp) * t / flops, overhead)


def host_need(setup: TrainingSetup, kind: str, peak_bytes: int, offloaded_bytes: int = 0) -> tuple[int, str]:
    """The most of this machine's memory measuring ``setup`` (exactly what will be built and run) is planned to hold,
    and what that is, in words. ``peak_bytes``: the estimate's tensor peak of ``setup`` (of its most loaded rank for a
    layout); ``offloaded_bytes``: what the step keeps in host memory beside it (the estimate's ``host_bytes``:
    offloaded activations). Each process counts :data:`PROCESS_BYTES` (torch and transformers) and its tensors
    :data:`RESIDENT_FACTOR` times.

    On a CPU the step's tensors are host memory. On CUDA the model is built on the GPU directly (:func:`_measure_cuda`),
    so the host holds the process (:data:`CUDA_PROCESS_BYTES`) and the offloaded activations. A layout's ranks are
    CPU processes, each building its whole model (a pipeline stage its tensor-parallel rank's narrower one) before
    it is sharded: each holds the larger of that and its step's peak, and a fork server not yet running adds one
    process (:func:`.distributed.rank_context`)."""
    par = setup.parallel
    if par.is_distributed:
        from .distributed import fork_server_started, uses_fork_server

        processes = measured_world(par)
        built = setup.num_params * (2 if setup.precision in ("bf16", "bf16-autocast") else 4) // \
            (par.tp if par.pp > 1 else 1)
        rank = int((max(peak_bytes, built) + offloaded_bytes) * RESIDENT_FACTOR) + PROCESS_BYTES
        server = PROCESS_BYTES if uses_fork_server() and not fork_server_started() else 0
        return processes * rank + server, f"{processes} rank processes, each building the whole model first"
    if kind == "cuda":
        return CUDA_PROCESS_BYTES + int(offloaded_bytes * RESIDENT_FACTOR), \
            "the CUDA process and its offloaded activations"
    return int((peak_bytes + offloaded_bytes) * RESIDENT_FACTOR) + PROCESS_BYTES, \
        "the step's tensors on the CPU, and the process"


def _host_bytes(result: Result) -> int:
    """What the estimate holds in host memory beside the device (offloaded activations)."""
    value = result.estimate.details.get("host_bytes", 0)
    return int(value) if isinstance(value, int | float) and value > 0 else 0


def check_host_memory(setup: TrainingSetup, estimate: Result, device: DeviceInfo) -> None:
    """Refuse (an :class:`InputError` on ``full_size``) a full-size measurement of ``setup`` whose planned resident
    size (:func:`host_need`) exceeds :data:`HOST_MARGIN` of this machine's available memory; nothing is refused
    where that is unknown. Called before anything is built."""
    available = device.host_free_bytes
    if available is None:
        return
    need, what = host_need(setup, device.kind, estimate.estimate.peak_tensor_bytes, _host_bytes(estimate))
    if need > available * HOST_MARGIN:
        raise InputError("full_size", f"measuring this setup at full size would hold about {format_bytes(need)} of "
                                      f"this machine's memory ({what}), and {format_bytes(available)} is available "
                                      f"(a measurement plans at most {HOST_MARGIN * 100:.0f} % of it): drop "
                                      "--full-size to measure a scaled-down setup, or measure a smaller setup")


def plan(setup: TrainingSetup, device: DeviceInfo, time_budget_s: float,
         fitted: FittedScaling | None = None) -> tuple[TrainingSetup, str]:
    """The setup to measure: the full one when it fits the device with margin, this machine's available memory
    (:func:`host_need`, ``device.host_free_bytes``) and the time budget. A multi-GPU layout runs as that many
    processes (:mod:`.layout`), each holding its rank and sharing the CPU's cores. ``fitted``: a family without a
    block model, scaled and estimated as :mod:`.fitted` says (one process)."""
    if setup.model is None and fitted is None:
        raise InputError("model", "measuring needs an architecture (a preset or a config.json), not a bare count")
    flops = CUDA_FLOPS if device.kind == "cuda" else CPU_FLOPS
    budget = device.free_bytes * MEMORY_MARGIN
    host_room = None if device.host_free_bytes is None else device.host_free_bytes * HOST_MARGIN
    changes: list[str] = []
    ranked = setup.parallel.is_distributed
    if ranked:
        setup, changes = scale_layout(setup)
    processes = measured_world(setup.parallel) if ranked else 1
    cores = max(1, os.cpu_count() or 1)
    par = setup.parallel
    multiple = par.pp * par.virtual_stages  # the stages split the layers evenly

    def ledger(s: TrainingSetup) -> tuple[int, int]:
        """The tensor peak of ``s`` and what it holds in host memory beside (offloaded activations)."""
        if fitted is not None:
            return fitted.peak_bytes(s), 0
        result = evaluate(s.with_changes(capacity_bytes=None))
        return result.estimate.peak_tensor_bytes, _host_bytes(result)

    def on_device(peak: int) -> int:
        return processes * (peak + (PROCESS_BYTES if ranked else 0))

    def fits_memory(s: TrainingSetup) -> bool:
        peak, offloaded = ledger(s)
        return on_device(peak) <= budget and \
            (host_room is None or host_need(s, device.kind, peak, offloaded)[0] <= host_room)

    def seconds(s: TrainingSetup) -> float:
        """Importing torch (first time only; the rank processes' start: :func:`.layout.start_seconds`), building the
        model, three iterations (the ranks share the cores and send their weights' and gradients' bytes through
        gloo)."""
        if not ranked:
            start = 0.0 if "torch" in sys.modules else TORCH_IMPORT_S
            return start + BUILD_S_PER_BILLION * s.num_params / 1e9 + 3 * _step_seconds(s, flops)
        share = max(1.0, processes / cores)
        # every rank builds its whole model before it is split (a pipeline stage's is the tensor-parallel rank's
        # narrower model); gathers and reductions move about three times its share of the fp32 weights an iteration
        par = s.parallel
        build = BUILD_S_PER_BILLION * s.num_params / (par.tp if par.pp > 1 else 1) / 1e9 * share
        sent = 3 * 4 * s.num_params / (par.tp * par.pp) / GLOO_BYTES_PER_S
        return start_seconds(processes, cores) + build + 3 * (_step_seconds(s, flops) * RANK_STEP_FACTOR * share + sent)

    def ok(s: TrainingSetup) -> bool:
        # memory is a hard limit; time a soft one
        return fits_memory(s) and seconds(s) <= time_budget_s

    if fitted is not None:
        full_layers, full_vocab = fitted.layers, fitted.vocab
        setup = fitted.setup(setup, full_layers, full_vocab)
    else:
        assert setup.model is not None
        full_layers, full_vocab = setup.model.num_layers, setup.model.vocab_size

    def rescale(s: TrainingSetup, layers: int, vocab: int) -> TrainingSetup:
        if fitted is not None:
            return fitted.setup(s, layers, vocab)
        if vocab != full_vocab:
            return _with_config(s, vocab_size=vocab)
        return _with_layers(s, layers)

    if ok(setup):
        return setup, _scale_note(changes)
    current = setup
    layers = full_layers
    floor = fitted.min_layers(setup) if fitted is not None else multiple
    while layers > floor and not ok(current):
        layers = fitted.fewer_layers(layers, floor) if fitted is not None else \
            max(multiple, layers // 2 // multiple * multiple)
        current = rescale(setup, layers, full_vocab)
    if layers != full_layers:
        changes.append(f"{layers} of {full_layers} layers")
    while current.batch > 1 and not ok(current):
        current = current.with_changes(batch=max(1, current.batch // 2))
    if current.batch != setup.batch:
        changes.append(f"micro-batch {current.batch} instead of {setup.batch}")
    if current.grad_accum > 2 and not ok(current):
        current = current.with_changes(grad_accum=2)
        changes.append("2 accumulation steps" if par.pp == 1 else "2 micro-batches per step")
    while current.seq > 64 and not ok(current):
        current = current.with_changes(seq=max(64, current.seq // 2))
    if current.seq != setup.seq:
        changes.append(f"sequence {current.seq} instead of {setup.seq}")
    vocab = full_vocab
    # the vocabulary shrinks for memory; for a layout's ranks also for time (their embedding and head are most of a
    # scaled-down rank's work and of what gloo sends)
    while vocab > 4096 and not (fits_memory(current) and (not ranked or ok(current))):
        vocab = max(4096, vocab // 4)
        current = rescale(current, layers, vocab)
    if vocab != full_vocab:
        changes.append(f"vocabulary {vocab:,} instead of {full_vocab:,}")
    if not fits_memory(current):
        peak, offloaded = ledger(current)
        smallest = (f"even the smallest scaled-down setup ({layers} of {full_layers} layers, micro-batch "
                    f"{current.batch}, sequence {current.seq}, vocabulary {vocab:,})")
        need, what = host_need(current, device.kind, peak, offloaded)
        if host_room is not None and need > host_room:
            assert device.host_free_bytes is not None
            raise InputError("model", f"{smallest} would hold about {format_bytes(need)} of this machine's memory "
                                      f"({what}), and {format_bytes(device.host_free_bytes)} is available (a "
                                      f"measurement plans at most {HOST_MARGIN * 100:.0f} % of it): measure a "
                                      "smaller setup")
        raise InputError("model", f"{smallest} would need about {format_bytes(on_device(peak))} of "
                                  f"{'this device' if device.kind == 'cuda' else 'this machine'}'s memory, and "
                                  f"{format_bytes(device.free_bytes)} is free (a scaled-down measurement plans at most "
                                  f"{MEMORY_MARGIN * 100:.0f} % of it): measure a smaller setup")
    expected = seconds(current)
    slow = "" if ok(current) or expected < 1 else f" (expect about {expected:.0f} s)"
    return current, _scale_note(changes, slow)


def _scale_note(changes: list[str], slow: str = "") -> str:
    if not changes:
        return ""
    return "Measured a scaled-down setup: " + ", ".join(changes) + \
        "; the comparison is with the estimate of exactly that setup" + slow + "."


# ---- running ------------------------------------------------------------------------------------
def measure(
    setup: TrainingSetup,
    device: str = "auto",
    iterations: int = 3,
    snapshot: str | Path | None = None,
    progress: ProgressFn | None = None,
    should_stop: Callable[[], bool] | None = None,
    time_budget_s: float = 30.0,
    full_size: bool = False,
    config: dict[str, Any] | None = None,
) -> MeasureResult:
    """Measure ``setup`` on ``device`` and compare with its estimate. Out-of-memory is a result.

    ``config``: the config of a family without a block model (``setup.model`` is then ``None``), compared with the
    fitted method's ledger of what ran (:mod:`.fitted`)."""
    if not 2 <= iterations <= MAX_ITERATIONS:
        raise InputError("iterations", f"must be 2 to {MAX_ITERATIONS} (the first iteration creates the optimizer "
                                       f"state; the second is the steady state), got {iterations:,}")
    if setup.model is None and config is None:
        raise InputError("model", "measuring needs an architecture (a preset or a config.json), not a bare count")
    t0 = time.perf_counter()
    info = detect_device(device)
    ranked = setup.parallel.is_distributed
    if ranked:  # the layout's ranks as CPU processes (measure.layout)
        check_measurable(setup)
        if info.kind == "cuda":
            if device == "cuda":
                raise MeasureError("a multi-GPU layout is measured as CPU processes over gloo; NCCL across GPUs is "
                                   "not run yet (measure with --device cpu or auto)")
            info = detect_device("cpu")
    # the estimate the measurement is compared with models the device it runs on (CPU dropout masks differ)
    target = "cuda" if info.kind == "cuda" else "cpu"
    try:
        with exclusive_torch_job(should_stop, Cancelled):
            result = _planned(setup, info, target, time_budget_s, full_size, progress, should_stop, config)
            measured = result.setup
            run_config = measured.extras.get(CONFIG_KEY) if config is not None else None
            config = dict(run_config) if isinstance(run_config, dict) else \
                dict(measured.model.raw) if measured.model is not None else {}

            def on_phase(phase: str, it: int, micro: int) -> None:
                if should_stop is not None and should_stop():
                    raise Cancelled("measurement cancelled")
                if progress is not None:
                    if phase == "load":
                        progress(f"starting {measured_world(measured.parallel)} rank processes and building the "
                                 "model" if ranked else
                                 f"building the model on {info.name if info.kind == 'cuda' else 'the CPU'}")
                        return
                    extra = f", accumulation step {micro + 1} of {measured.grad_accum}" \
                        if measured.grad_accum > 1 and phase in ("forward", "backward") and \
                        measured.parallel.pp == 1 else ""
                    who = "rank 1: " if ranked else ""
                    progress(f"{who}iteration {it} of {iterations}: {phase.replace('_', ' ')}{extra}")

            if ranked:
                _measure_ranks(result, measured, iterations, on_phase, should_stop)
            elif info.kind == "cuda":
                _measure_cuda(result, config, measured, iterations, snapshot, on_phase)
            else:
                _measure_cpu(result, config, measured, iterations, on_phase)
        if info.kind != "cuda" and snapshot:
            result.notes.append("memory snapshots need CUDA; none was written")
    except (Cancelled, MemcalcError, KeyboardInterrupt):
        raise
    except ImportError as exc:
        raise MeasureError(f"measuring this model needs transformers: {install_hint()} ({exc})") from None
    except RecursionError:
        raise MeasureError("the measurement failed: the model nests too deeply") from None
    except Exception as exc:  # a config transformers cannot build, an op that fails: one line, not a traceback
        raise MeasureError(f"the measurement failed ({type(exc).__name__}: {one_line(exc, 240)})") from None
    finally:
        collect_garbage()
    result.seconds = time.perf_counter() - t0
    return result


def _planned(setup: TrainingSetup, info: DeviceInfo, target: str, time_budget_s: float, full_size: bool,
             progress: ProgressFn | None, should_stop: Callable[[], bool] | None,
             config: dict[str, Any] | None) -> MeasureResult:
    """What will be measured (scaled down unless ``full_size``), beside the estimate of exactly that: the analytic
    ledger, or a family without a block model's fitted one (:mod:`.fitted`, calibrated here when it is not cached)."""
    ranked = setup.parallel.is_distributed
    on_target = setup.with_changes(target_device=target)
    notes: list[str] = []
    if setup.model is None:
        assert config is not None
        if should_stop is not None and should_stop():
            raise Cancelled("measurement cancelled")
        fitted = FittedScaling(config, on_target, progress)
        if full_size:
            changes: list[str] = []
            if ranked:
                on_target, changes = scale_layout(on_target)
            measured, note = fitted.setup(on_target, fitted.layers, fitted.vocab), _scale_note(changes)
        else:
            measured, note = plan(on_target, info, time_budget_s, fitted)
        measured = measured.with_changes(target_device=setup.target_device)
        estimate = fitted.result(measured.with_changes(capacity_bytes=setup.capacity_bytes, target_device=target))
        if full_size:
            check_host_memory(measured, estimate, info)
        if fitted.traced:
            notes.append("the fitted method does not apply to this config (too few layers to extrapolate from, or "
                         "its check refused the fit): the measurement is compared with the trace of the step")
    else:
        if ranked and full_size:
            measured, changes = scale_layout(setup)
            note = _scale_note(changes)
        else:
            measured, note = (setup, "") if full_size else plan(setup, info, time_budget_s)
        estimate = evaluate(measured.with_changes(capacity_bytes=setup.capacity_bytes, target_device=target))
        if full_size:
            check_host_memory(measured, estimate, info)
    return MeasureResult(info, measured, setup, bool(note), note, {}, estimate, [], notes=notes)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure: Python's ``MemoryError``, ``torch.OutOfMemoryError``, or the
    ``RuntimeError`` torch's CPU allocator raises ("DefaultCPUAllocator: can't allocate memory")."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


def _oom_message(phase: str, setup: TrainingSetup) -> str:
    return f"Does not fit: out of memory in {phase.replace('_', ' ')} at micro-batch {setup.batch}."


def _measure_cpu(result: MeasureResult, config: dict[str, Any], setup: TrainingSetup, iterations: int,
                 on_phase: Callable[[str, int, int], None]) -> None:
    from .cpu_step import measure_training_step

    current = {"phase": "load"}

    def track_phase(phase: str, it: int, micro: int) -> None:
        current["phase"] = phase
        on_phase(phase, it, micro)

    try:
        m = measure_training_step(
            config, batch=setup.rows, seq=setup.row_len, documents=setup.batch if setup.packing else None,
            precision=setup.precision, optimizer=setup.optimizer,
            optimizer_impl=setup.optimizer_impl, attention=setup.attention, checkpointing=setup.checkpointing,
            use_cache=setup.use_cache, grad_accum=setup.grad_accum, iterations=iterations, num_threads=None,
            on_phase=track_phase, tuning=setup.tuning if setup.tuning.method != "full" else None,
            loss=setup.loss, loss_chunk=setup.loss_chunk, optimizer_in_backward=setup.optimizer_in_backward,
            activation_offload=setup.activation_offload, galore_rank=setup.galore_rank, keep_tracker=True,
            module_names=True,
        )
    except NotImplementedError as exc:  # an optimizer torch lacks, or a family without a reference module
        raise MeasureError(str(exc)) from None
    except (MemoryError, RuntimeError) as exc:
        if not is_out_of_memory(exc):
            raise
        result.oom = _oom_message(current["phase"], setup)
        return
    for name in PHASES:
        ph = m.phases[name]
        peak = ph.live_bytes if name == "load" else ph.peak_bytes
        objects = {"parameters": peak} if name == "load" else dict(ph.objects)
        result.phases[name] = PhaseReading(peak, ph.live_bytes, objects)
    result.iterations_live_bytes = [r.live_bytes_end for r in m.iterations]
    result.host_bytes = m.host_bytes
    if m.tracker is not None:
        from .cpu_step import timeline_from_tracker

        result.timeline = timeline_from_tracker(m.tracker, "measured")
    result.notes.append("CPU tensor measurement (live-storage tracker): every tensor storage, split by "
                        "ledger object; no CUDA context or allocator cache on a CPU")


def _measure_ranks(result: MeasureResult, setup: TrainingSetup, iterations: int,
                   on_phase: Callable[[str, int, int], None], should_stop: Callable[[], bool] | None) -> None:
    """Every rank of the layout as a gloo process (:mod:`.distributed`), each compared with its own estimate."""
    from ..core.pipeline import stage_estimate
    from .distributed import RanksCancelled, measure_sharded_step

    job = rank_job(setup)
    on_phase("load", 0, 0)  # at once: the ranks report their own phases once they have started

    def rank_phase(phase: str, it: int, micro: int) -> None:
        if phase != "load":
            on_phase(phase, it, micro)

    step = dict(batch=setup.rows, seq=setup.row_len, documents=setup.batch if setup.packing else None,
                precision=setup.precision, optimizer=setup.optimizer, optimizer_impl=setup.optimizer_impl,
                attention=setup.attention, checkpointing=setup.checkpointing, use_cache=setup.use_cache,
                grad_accum=setup.grad_accum, iterations=iterations,
                tuning=setup.tuning if setup.tuning.method != "full" else None, loss=setup.loss,
                loss_chunk=setup.loss_chunk, optimizer_in_backward=setup.optimizer_in_backward,
                activation_offload=setup.activation_offload, galore_rank=setup.galore_rank)
    try:
        measured = measure_sharded_step(job.config, world=job.world, strategy=job.strategy, layout=job.layout,
                                        reshard_after_forward=setup.parallel.reshard_after_forward,
                                        on_phase=rank_phase, should_stop=should_stop, **step)
    except RanksCancelled:
        raise Cancelled("measurement cancelled") from None
    except RuntimeError as exc:
        text = str(exc)
        if "can't allocate memory" in text or "out of memory" in text.lower() or "exit code -9" in text:
            result.oom = f"Does not fit: a rank ran out of this machine's memory ({one_line(text, 160)})."
            return
        raise MeasureError(f"a rank failed: {one_line(text, 300)}") from None
    staged = setup.parallel.pp > 1
    estimates: dict[int, dict[str, int]] = {}
    shown_est = result.estimate.estimate
    fitted_rows = {row["rank"]: row for row in shown_est.details.get("pipeline_ranks", ())} \
        if staged and shown_est.method == "fitted" else {}
    for stage in sorted(set(job.stage_of)):
        if fitted_rows:  # a family without a block model: each rank's own fit (core.fitted; its checked ranks)
            row = fitted_rows.get(stage)
            if row is None:
                raise MeasureError(f"pipeline rank {stage + 1} of a family without a block model has no fit of its own "
                                   "(the first, second and last ranks are fitted): measure 3 stages or fewer")
            estimates[stage] = {name: int(row["tensor_bytes"][name]) for name in PHASES}
            continue
        est = stage_estimate(shown_est.setup, stage) if staged else shown_est
        estimates[stage] = {name: est.phases[name].tensor_bytes for name in PHASES}
    for r, m in enumerate(measured):
        phases = {}
        for name in PHASES:
            ph = m.phases[name]
            peak = ph.live_bytes if name == "load" else ph.peak_bytes
            phases[name] = PhaseReading(peak, ph.live_bytes, {"parameters": peak} if name == "load"
                                        else dict(ph.objects))
        result.ranks.append(RankReading(r, job.world, job.stage_of[r] if staged else None, setup.parallel.pp,
                                        phases, estimates[job.stage_of[r]],
                                        [i.live_bytes_end for i in m.iterations]))
    if staged:  # the first rank of the stage the estimate shows (its most loaded)
        shown_stage = int(result.estimate.estimate.details.get("pipeline_rank", 0))
        result.shown_rank = job.stage_of.index(shown_stage)
    else:
        result.shown_rank = max(range(job.world), key=lambda r: result.ranks[r].peak_bytes)
    shown = result.ranks[result.shown_rank]
    result.phases = dict(shown.phases)
    result.iterations_live_bytes = list(shown.live_bytes)
    result.notes += list(job.notes)
    if setup.parallel.ep > 1:
        result.notes.append(_routing_note(result.ranks))
    result.notes.append(f"{job.world} ranks, one CPU process each on PyTorch's gloo backend, each measured with the "
                        f"live-storage tracker; the table shows {shown.label}, the one the estimate describes")


def _routing_note(ranks: list[RankReading]) -> str:
    """What the router did to the ranks of an expert-parallel step: the estimate assumes balanced routing (each GPU's
    experts get their share of the tokens); random weights route unevenly, so each rank's forward peak lies above or
    below it, by how much said here (their mean is the balanced step)."""
    shares = [(r.phases["forward"].peak_bytes - r.estimate_bytes["forward"]) / r.estimate_bytes["forward"] * 100
              for r in ranks if "forward" in r.phases and r.estimate_bytes.get("forward")]
    if not shares:
        return "Expert parallelism: the estimate assumes balanced routing"
    mean = sum(shares) / len(shares)
    return (f"Expert parallelism: the estimate assumes balanced routing (every GPU's experts get their share of the "
            f"tokens); this step's router sent them unequal shares, and the ranks' measured forward peaks lie "
            f"{_pct(min(shares))} % to {_pct(max(shares))} % from it ({_pct(mean)} % on average)")


def _measure_cuda(result: MeasureResult, config: dict[str, Any], setup: TrainingSetup, iterations: int,
                  snapshot: str | Path | None, on_phase: Callable[[str, int, int], None]) -> None:
    """One real training step on CUDA, read through the caching allocator's counters."""
    torch = _import_torch()
    from .cpu_step import (
        apply_tuning,
        build_model,
        enable_checkpointing,
        host_peak,
        make_optimizer,
        offload_hooks,
        step_forward,
    )
    from .varlen_attention import document_lengths

    if setup.attention == "flash" and importlib.util.find_spec("flash_attn") is None:
        raise MeasureError("FlashAttention-2 on a GPU needs the flash-attn package (pip install flash-attn); "
                           "measure with SDPA, or on the CPU, which runs its stand-in")
    dev = torch.device("cuda", 0)
    torch.cuda.init()
    torch.zeros(1, device=dev)  # create the context
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    result.context_bytes = int(total - free - torch.cuda.memory_reserved())
    if snapshot:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    model = opt = input_ids = loss = None
    params: list[Any] = []
    # bf16 autocast where the GPU has it (Ampere and later), fp16 otherwise: the same bytes either way
    half = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    phase_name = "load"
    peaks: dict[str, PhaseReading] = {}
    max_reserved = 0

    def begin(name: str, it: int, micro: int = 0) -> None:
        nonlocal phase_name
        phase_name = name
        on_phase(name, it, micro)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def end(name: str, keep: bool, known: dict[str, int]) -> None:
        nonlocal max_reserved
        torch.cuda.synchronize()
        peak = int(torch.cuda.max_memory_allocated())
        live = int(torch.cuda.memory_allocated())
        reserved = int(torch.cuda.max_memory_reserved())
        max_reserved = max(max_reserved, reserved)
        if not keep:
            return
        prev = peaks.get(name)
        if prev is not None and prev.peak_bytes >= peak:
            return
        rest = max(0, peak - sum(known.values()))
        other = {"load": "parameters", "forward": "activations", "backward": "temporaries",
                 "optimizer_step": "optimizer_temporaries"}[name]
        objects = dict(known)
        objects[other] = objects.get(other, 0) + rest
        peaks[name] = PhaseReading(peak, live, objects, reserved)

    def nbytes(tensors: Any) -> int:
        return int(sum(t.untyped_storage().nbytes() for t in tensors))

    try:
        begin("load", 0)
        with dev:  # build on the GPU directly (no CPU copy of the weights)
            model = build_model(config, precision=setup.precision, use_cache=setup.use_cache,
                                attention="flash_attention_2" if setup.attention == "flash" else setup.attention)
        every = checkpoint_every(setup.checkpointing)
        if every is not None:
            enable_checkpointing(model, every=every, selective=setup.checkpointing == "selective")
        if setup.tuning.method != "full":
            with dev:
                model = apply_tuning(model, setup.tuning, config, device="cuda")
        param_bytes = nbytes(model.parameters()) + nbytes(model.buffers())
        params = [p for p in model.parameters() if p.requires_grad]
        end("load", True, {"parameters": param_bytes})
        if setup.activation_offload != "none":
            offloading = offload_hooks(model, None, setup.activation_offload)
            host_peak(reset=True)
        opt = make_optimizer(params, setup.optimizer, setup.optimizer_impl, model, setup.galore_rank)
        input_ids = torch.randint(0, int(model.config.vocab_size), (setup.rows, setup.row_len), device=dev)
        position_ids = None
        if setup.packing:  # positions restart at every document: transformers attends within each one
            position_ids = torch.cat([torch.arange(n, device=dev) for n in
                                      document_lengths(setup.row_len, setup.batch)]).unsqueeze(0)
        input_bytes = nbytes([input_ids] + ([position_ids] if position_ids is not None else []))
        for it in range(1, iterations + 1):
            steady = it == iterations
            state_bytes = nbytes(v for s in opt.state.values() for v in s.values()
                                 if isinstance(v, torch.Tensor) and v.is_cuda)
            for micro in range(setup.grad_accum):
                grad_bytes = nbytes(p.grad for p in params if p.grad is not None)
                known = {"parameters": param_bytes, "optimizer_state": state_bytes, "inputs": input_bytes,
                         "gradients": grad_bytes}
                begin("forward", it, micro)
                loss = step_forward(model, input_ids, setup.precision, setup.loss, setup.loss_chunk, "cuda", half,
                                    position_ids=position_ids)
                if setup.grad_accum > 1:
                    loss = loss / setup.grad_accum
                end("forward", steady, known)
                begin("backward", it, micro)
                loss.backward()
                loss = None
                end("backward", steady, known)
            begin("optimizer_step", it)
            grad_bytes = nbytes(p.grad for p in params if p.grad is not None)
            opt.step()
            state_bytes = nbytes(v for s in opt.state.values() for v in s.values()
                                 if isinstance(v, torch.Tensor) and v.is_cuda)
            known = {"parameters": param_bytes, "optimizer_state": state_bytes, "inputs": input_bytes,
                     "gradients": grad_bytes}
            end("optimizer_step", steady, known)
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            result.iterations_live_bytes.append(int(torch.cuda.memory_allocated()))
        result.phases = {name: peaks[name] for name in PHASES if name in peaks}
        result.peak_reserved_bytes = max_reserved
        if setup.activation_offload != "none":
            result.host_bytes = host_peak()
            for h in offloading:
                h.remove()
        # bitsandbytes' paged buffers are CPU-typed views of CUDA managed memory (functional.get_paged)
        paged = nbytes(v for s in opt.state.values() for v in s.values() if getattr(v, "is_paged", False))
        if paged:
            result.notes.append(f"bitsandbytes paged optimizer state: {format_bytes(paged)} in CUDA unified memory, "
                                "outside the allocator's counters (the estimate lists it apart)")
        result.notes.append("CUDA caching allocator counters (max_memory_allocated per phase, after synchronize); "
                            "objects other than parameters, gradients, state and inputs are the remainder")
    except torch.cuda.OutOfMemoryError:
        result.oom = _oom_message(phase_name, setup)
        result.phases = {}
    finally:
        if snapshot:
            try:
                # torch's _dump_snapshot writes in place; memcalc writes every file whole (core.files)
                data = pickle.dumps(torch.cuda.memory._snapshot(), protocol=4)
                result.snapshot = str(atomic_write(snapshot, data, field="snapshot"))
                with contextlib.suppress(InputError):  # the bytes just written, read as any snapshot is
                    result.timeline = read_timeline(data)
            finally:
                torch.cuda.memory._record_memory_history(enabled=None)
        params.clear()  # the last references to the weights: let the cache be emptied below
        del model, opt, input_ids, loss
        collect_garbage()
        torch.cuda.empty_cache()


def measured_overheads_setup(full: TrainingSetup, result: MeasureResult) -> TrainingSetup:
    """The full-size setup with the measured CUDA context and allocator reserve applied."""
    overheads = result.measured_overheads()
    if overheads is None:
        raise MeasureError("measured overheads exist only for a CUDA measurement")
    return full.with_changes(**overheads)


def _pct(value: float) -> str:
    """``+1.2``, ``-3.4``; a value that rounds to zero is ``0.0`` (never ``-0.0``)."""
    return "0.0" if abs(value) < 0.05 else f"{value:+.1f}"


def format_measurement(result: MeasureResult) -> str:
    """Measured vs estimated as a text table."""
    from ..core.units import format_bytes

    lines = [result.headline()]
    if result.scale_note:
        lines.append(result.scale_note)
    if result.oom:
        return "\n".join(lines)
    lines.append("")
    lines.append(f"{'phase':<16}{'measured':>14}{'estimated':>14}{'error':>9}")
    err = result.error_pct
    for name in PHASES:
        r = result.phases.get(name)
        if r is None:
            continue
        est = result.estimate.estimate.phases[name].tensor_bytes
        lines.append(f"{name.replace('_', ' '):<16}{format_bytes(r.peak_bytes):>14}{format_bytes(est):>14}"
                     f"{_pct(err.get(name, math.nan)):>8}%")
    if len(result.ranks) > 1:
        lines += ["", "Every rank, measured and (estimate − measured) / measured:",
                  f"{'rank':<28}" + "".join(f"{p.replace('_', ' '):>21}" for p in PHASES[1:])]
        for rank in result.ranks:
            errors = rank.error_pct
            cells = "".join(f"{format_bytes(rank.phases[p].peak_bytes):>12}{_pct(errors.get(p, math.nan)):>8}%"
                            for p in PHASES[1:] if p in rank.phases)
            shown = "  ← above" if rank.rank == result.shown_rank else ""
            lines.append(f"{rank.label:<28}{cells}{shown}")
    if result.context_bytes is not None:
        lines.append(f"CUDA context {format_bytes(result.context_bytes)}; peak reserved "
                     f"{format_bytes(result.peak_reserved_bytes or 0)}")
    leak = result.leak
    lines.append("Leak check: " + ("live bytes grow every iteration — something keeps tensors alive (memory ledger)"
                                   if leak["growing"] else "no growth across iterations"))
    if result.signals:
        lines.append("Signals: " + ", ".join(result.signals))
    lines += [f"Note: {n}" for n in result.notes]
    return "\n".join(lines)
