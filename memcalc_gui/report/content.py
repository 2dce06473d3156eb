"""What a report says, as plain text and rows (no Qt): the PDF and the PNG renderers draw from this.

Every number comes from the core (:func:`memcalc_gui.core.result.evaluate`) or from a measurement or
trace result; this module only formats them (binary units, labelled GiB/MiB) and attaches the source
of each assumption and formula.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

from .. import __version__
from ..core.distributed import STRATEGY_LABELS
from ..core.ledger import parameter_rows, shown_objects
from ..core.result import Result
from ..core.setup import PRECISION_LABELS, gpu_presets
from ..core.solver import MAX_SEARCH_BATCH
from ..core.timeline import Timeline, compare_phases
from ..core.units import format_bytes, format_count, in_unit, ordinal
from ..core.vocab import OBJECT_LABELS, PHASE_LABELS, PHASES
from ..view.plan_text import (
    ADVICE_ORDER,
    BEST_MARK,
    OFFLOAD_TEXT,
    host_bytes,
    host_text,
    is_per_gpu,
    parallel_label,
    per_gpu_headline,
    pipeline_text,
    plan_rows,
    plan_sentences,
    strategy_text,
    suggestions_note,
)

if TYPE_CHECKING:  # the measurement engine is optional input; never import torch here
    from ..measure.engine import MeasureResult

#: Keys of :data:`SOURCES`, in the order the reference list prints them.
SEED_000 = "Hugging Face blog"
SEED_001 = "PyTorch memory notes"
SEED_002 = "Transformers docs"
SEED_003 = "memory-profiling guide"
SEED_004 = "memory ledger"
KORTHIKANTI = "Korthikanti 2022"
ZERO = "ZeRO 2020"
DEEPSPEED = "DeepSpeed"
FSDP = "PyTorch FSDP"
DDP = "PyTorch DDP"
MEMCALC = "memcalc"
LIGER = "Liger-Kernel"
TORCHTITAN = "torchtitan"
PT_OPT_BWD = "PyTorch tutorial"
TORCHTUNE = "torchtune"
FSDP2 = "PyTorch FSDP2"
PT_SAVE_ON_CPU = "PyTorch autograd docs"
HF_PACKING = "Transformers packing"
FLASH_ATTN = "FlashAttention-2"
GALORE = "GaLore 2024"
ANYPRECISION = "AnyPrecisionAdamW"

SOURCES: dict[str, str] = {
    SEED_000: "Hugging Face blog, “Visualize and understand GPU memory in PyTorch” — phases, colours, "
              "the peak formula Total = Model + OptState + max(Grad + OptIntermediates, Activations).",
    SEED_001: "Zhihu article on PyTorch’s GPU memory mechanics — byte-exact steps of nn.Linear + AdamW, "
              "CUDA context, 512 B allocator rounding, memory_allocated / max_memory_allocated / memory_reserved.",
    SEED_002: "Hugging Face Transformers documentation, “GPU memory” — bytes per parameter: mixed precision 6 B "
              "weights, Adam 8 B state, 4 B gradients, quantised Adam 2 B.",
    SEED_003: "DeepHub IMBA, PyTorch GPU memory profiling guide — the seven consumers, fragmentation 5–20 %, "
              "gradient checkpointing saves 40–60 % of activations.",
    SEED_004: "“Memory Profiling and Optimization” (memory-ledger chapter) — objects × lifetimes × phases, the "
              "candidate peak, micro-batch vs accumulation, estimate vs allocated / reserved / capacity.",
    KORTHIKANTI: "Korthikanti et al. 2022, “Reducing Activation Recomputation in Large Transformer Models” "
                 "(arXiv:2205.05198) — activations per layer sbh(34 + 5as/h) for GPT-3 blocks.",
    ZERO: "Rajbhandari et al. 2020, “ZeRO: Memory Optimizations Toward Training Trillion Parameter Models” "
          "(arXiv:1910.02054) — model states (2 + 2 + K)Ψ per GPU and their partitioning in stages 1–3.",
    DEEPSPEED: "DeepSpeed, estimate_zero2_model_states_mem_needs and estimate_zero3_model_states_mem_needs "
               "(deepspeed/runtime/zero/stage_1_and_2.py, stage3.py) — fp32 gradient partitions, reduce "
               "buckets, the largest layer gathered (4·L), host memory × 1.5 buffer factor.",
    FSDP: "PyTorch documentation, FullyShardedDataParallel — sharding strategies FULL_SHARD, SHARD_GRAD_OP, "
          "HYBRID_SHARD, MixedPrecision, CPUOffload; limit_all_gathers keeps at most two units gathered.",
    DDP: "PyTorch documentation, DistributedDataParallel — gradient buckets (bucket_cap_mb = 25, "
         "gradient_as_bucket_view = False keeps a second copy of every gradient).",
    MEMCALC: "memcalc’s own measurements — a live-storage tracker on CPU, exact to the byte against the PyTorch "
             "profiler (tests/test_analytic_vs_measured.py).",
    LIGER: "Liger-Kernel, liger_kernel/ops/fused_linear_cross_entropy.py — the chunked fused linear cross-entropy: "
           "chunks of next_power_of_2(⌈T / ⌈V/H⌉⌉) tokens, gradients made in forward; its memory benchmark.",
    TORCHTITAN: "torchtitan, activation checkpointing options — selective layer checkpointing of every N-th block "
                "(ac_freq) and per-op selective checkpointing (its op save list: attention kernels and every other "
                "mm, through torch.utils.checkpoint.create_selective_checkpoint_contexts).",
    PT_OPT_BWD: "PyTorch tutorial “How to save memory by fusing the optimizer step into the backward pass” — a "
                "step per parameter from register_post_accumulate_grad_hook, the gradient freed.",
    FSDP2: "PyTorch documentation, torch.distributed.fsdp.fully_shard (FSDP2) — per-parameter DTensor sharding, "
           "reshard_after_forward, MixedPrecisionPolicy; torchtitan's docs/fsdp.md on its memory against FSDP1.",
    TORCHTUNE: "torchtune, training/_activation_offloading.py (OffloadActivations) — saved tensors of 1 KiB or more, "
               "parameters apart, copied to host memory in forward and back in backward on a side stream; used with "
               "activation checkpointing, so what goes is each layer's input.",
    PT_SAVE_ON_CPU: "PyTorch documentation, “Autograd mechanics: hooks for saved tensors” — "
                    "torch.autograd.graph.save_on_cpu copies every saved tensor to the CPU and back in backward.",
    HF_PACKING: "Hugging Face Transformers, DataCollatorWithFlattening and masking_utils "
                "(find_packed_sequence_indices) — packed documents in one row, position_ids restarting at each; "
                "SDPA gets a block-diagonal mask.",
    GALORE: "Zhao et al. 2024, “GaLore: Memory-Efficient LLM Training by Gradient Low-Rank Projection” "
            "(arXiv:2403.03507), and galore-torch's GaLoreAdamW / GaLoreProjector — Adam's moments of an r-row "
            "projection of each matrix's gradient, the projection from an SVD refreshed every 200 steps.",
    ANYPRECISION: "torchdistx, optimizers/anyprecision_optimizer.py (AnyPrecisionAdamW; Trainer's "
                  "optim=\"adamw_anyprecision\" with momentum_dtype and variance_dtype bfloat16) — AdamW moments in "
                  "bf16 beside the weights; Megatron-Core's precision-aware optimizer (exp_avg_dtype, "
                  "exp_avg_sq_dtype) keeps the same.",
    FLASH_ATTN: "Dao 2023, “FlashAttention-2” (arXiv:2307.08691) and flash-attn's flash_attn_varlen_func — attention "
                "over packed variable-length documents from cumulative lengths, saving q, k, v, the output and "
                "the log-sum-exp.",
}

METHOD_LABELS = {
    "analytic": "analytic — the model’s blocks counted tensor by tensor",
    "quick": "quick — a rough heuristic from the parameter count (Hugging Face blog); activations are overestimated",
    "trace": "trace — one step traced on fake tensors",
}

UNITS_TEXT = ("All sizes are binary and labelled so: 1 GiB = 2³⁰ B = 1,073,741,824 bytes; 1 MiB = 2²⁰ B = "
              "1,048,576 bytes. A GPU’s capacity is what the device reports to PyTorch (a card sold as "
              "“80 GB”, decimal, reports about 79.2 GiB). Phase totals include the CUDA context and the "
              "allocator reserve; “tensors” is what torch.cuda.max_memory_allocated shows.")

#: Rows of a long per-module table beyond this are summed into one row.
MAX_MODULE_ROWS = 150

#: The short names assumptions cite in their text (the keys of :data:`SOURCES`).
_CITED = (SEED_000, SEED_001, SEED_002, SEED_003, SEED_004)
_KEYWORD_SOURCES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Steady-state", (SEED_004, SEED_000)),
    ("counted tensor by tensor", (KORTHIKANTI, MEMCALC)),
    ("Loss:", (MEMCALC, SEED_000)),
    ("CUDA context", (SEED_001, SEED_003)),
    ("Rough heuristic", (SEED_000,)),
    ("P = ", (SEED_000, SEED_002)),
    ("fp32:", (SEED_002,)),
    ("bf16:", (SEED_002,)),
    ("Adam", (SEED_002, SEED_001)),
    ("SGD", (SEED_002,)),
    ("Adafactor", (SEED_002,)),
    ("Lion", (SEED_002,)),
    ("full gradient checkpointing", (SEED_003,)),
    ("ZeRO", (ZERO, DEEPSPEED)),
    ("FSDP", (FSDP,)),
    ("DDP", (DDP,)),
    ("largest unit gathered", (DEEPSPEED, FSDP)),
    ("Liger", (LIGER,)),
    ("torchtitan", (TORCHTITAN,)),
    ("step in backward", (PT_OPT_BWD,)),
    ("OffloadActivations", (TORCHTUNE,)),
    ("save_on_cpu", (PT_SAVE_ON_CPU,)),
    ("DataCollatorWithFlattening", (HF_PACKING,)),
    ("FlashAttention-2", (FLASH_ATTN,)),
    ("GaLore", (GALORE,)),
    ("AnyPrecisionAdamW", (ANYPRECISION,)),
)


def sources_for(text: str) -> tuple[str, ...]:
    """The sources an assumption cites by name in its text plus those its subject implies."""
    found: list[str] = [key for key in _CITED if key.lower() in text.lower()]
    for needle, keys in _KEYWORD_SOURCES:
        if needle.lower() in text.lower():
            found.extend(keys)
    if not found:
        found.append(MEMCALC)
    return tuple(dict.fromkeys(found))


@dataclass(frozen=True)
class Row:
    """One table row; ``strong`` rows (totals) are bold, ``highlight`` marks the peak/verdict cells."""

    cells: tuple[str, ...]
    strong: bool = False
    color: str = ""  # a swatch colour for the first cell (ledger objects)
    highlight: bool = False


@dataclass(frozen=True)
class Table:
    header: tuple[str, ...]
    rows: tuple[Row, ...]
    #: Column index → alignment ("left"/"right"); default left.
    align: dict[int, str] = field(default_factory=dict)
    #: Relative column widths (percent); empty → automatic.
    widths: tuple[int, ...] = ()
    highlight_column: int | None = None


@dataclass(frozen=True)
class MeasurementSection:
    device: str
    headline: str
    notes: tuple[str, ...]
    table: Table
    signals: tuple[str, ...]
    extra: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class ReportContent:
    title: str
    subtitle: str
    date: str
    version: str
    method: str
    fits: bool | None
    headline: str
    verdict: tuple[tuple[str, str], ...]
    setup: tuple[tuple[str, str], ...]
    ledger: Table
    suggestions: Table | None
    suggestions_note: str
    measurement: MeasurementSection | None
    modules: Table | None
    modules_note: str
    assumptions: Table
    formulas: Table
    units: str
    references: tuple[tuple[str, str], ...]
    notes: tuple[str, ...] = ()
    chart_caption: str = ""
    measured_peaks: dict[str, int] = field(default_factory=dict)
    measured_reference: dict[str, int] = field(default_factory=dict)
    measured_label: str = ""
    #: A distributed setup: the parallelism in words (every ledger number is per GPU); "" for one GPU.
    per_gpu: str = ""
    plan: Table | None = None
    plan_notes: tuple[str, ...] = ()
    host: str = ""
    #: A timeline drawn as a figure (PDF): what it is, said under it; "" for none.
    timeline_caption: str = ""

    def plain_text(self) -> str:
        """Everything as text (tests, and a fallback for a reader without PDF support)."""
        out = [self.title, self.subtitle, f"{self.date} · memcalc {self.version}", self.headline]
        out += [f"{k}: {v}" for k, v in self.verdict]
        out += [f"{k}: {v}" for k, v in self.setup]
        out += list(self.plan_notes)
        if self.host:
            out.append(self.host)
        tables = [self.ledger, self.suggestions, self.plan, self.modules, self.assumptions, self.formulas]
        if self.measurement is not None:
            tables.append(self.measurement.table)
            out += list(self.measurement.signals)
        for t in tables:
            if t is None:
                continue
            out.append(" | ".join(t.header))
            out += [" | ".join(r.cells) for r in t.rows]
        out.append(self.units)
        return "\n".join(out)


def _bytes_cell(n: int, unit: str | None = None) -> str:
    """A size for a table cell; ``unit`` gives the whole table one unit (``units.result_unit``)."""
    if not n:
        return "—"
    if unit is not None and in_unit(n, unit) < 0.005:
        return f"<0.01 {unit}"
    return format_bytes(n, unit=unit)


def _gpu_name(setup_gpu: str | None) -> tuple[str, str]:
    for g in gpu_presets():
        if g.id == setup_gpu:
            return g.name, g.nominal
    return "", ""


def gpu_label(result: Result) -> str:
    """``NVIDIA A100 80GB (79.15 GiB)`` or ``79.15 GiB capacity`` or ``no GPU chosen``."""
    setup = result.setup
    if setup.capacity_bytes is None:
        return "no GPU chosen"
    name, _nominal = _gpu_name(setup.gpu)
    cap = result.size(setup.capacity_bytes)
    return f"{name} ({cap})" if name else f"{cap} capacity"


def _setup_rows(result: Result) -> list[tuple[str, str]]:
    s = result.setup
    rows: list[tuple[str, str]] = []
    if s.model is not None:
        m = s.model
        rows += [
            ("Model", m.name or "config.json"),
            ("Family", m.family),
            ("Parameters", f"{m.num_params:,} (exact count, {format_count(m.num_params)})"),
            ("Config from", m.source or "config.json"),
            ("Architecture", f"{m.num_layers} layers, hidden {m.hidden_size:,}, {m.num_heads} attention heads "
                             f"({m.num_kv_heads} key/value), head dim {m.head_dim}, MLP {m.intermediate_size:,}"
                             f"{' (gated)' if m.gated_mlp else ''}, vocabulary {m.vocab_size:,}, "
                             f"{'tied' if m.tied_embeddings else 'separate'} embeddings / LM head, {m.norm}"),
        ]
    else:
        rows += [
            ("Model", "a bare parameter count (no architecture)"),
            ("Family", "unknown"),
            ("Parameters", f"{s.num_params:,} ({format_count(s.num_params)})"),
            ("Config from", "parameter count typed by the user"),
        ]
    rows += [
        ("Micro-batch", f"{s.batch:,}"),
        ("Sequence length", f"{s.seq:,} tokens"),
        ("Gradient accumulation", f"{s.grad_accum:,} micro-batches per optimizer step"),
        ("Effective batch", f"{s.effective_batch:,} {'documents' if s.packing else 'sequences'} = "
                            f"{s.tokens * s.grad_accum:,}{' real' if s.packing else ''} tokens per step"),
        *([("Packing", f"padding-free: {s.packing_text()}")] if s.packing else []),
        ("Precision", PRECISION_LABELS.get(s.precision, s.precision)),
        ("Optimizer", f"{s.optimizer} ({s.optimizer_impl} step)"),
        ("Attention", {"flash": "flash (flash_attention_2)"}.get(s.attention, s.attention)),
        ("Gradient checkpointing", s.checkpointing),
        *([("Activation offload", {"checkpoint-inputs": "checkpointed layers' inputs in host memory (torchtune)",
                                   "all": "every saved tensor in host memory (save_on_cpu)"}[s.activation_offload])]
          if s.activation_offload != "none" else []),
        ("use_cache", "True: the loop keeps transformers' k/v cache in forward" if s.use_cache else
         "False, as transformers' Trainer passes in training"),
        ("Fine-tuning", s.tuning_text()),
    ]
    split = result.estimate.details.get("parameter_split")
    if split:
        rows.append(("Parameters", ", ".join(f"{name} {format_bytes(n)}" for name, n in split.items())))
    if s.capacity_bytes is not None:
        name, nominal = _gpu_name(s.gpu)
        label = f"{name} (sold as {nominal}), " if name else "custom capacity, "
        rows.append(("GPU", f"{label}{format_bytes(s.capacity_bytes)} = {s.capacity_bytes:,} bytes as reported "
                            "to PyTorch"))
    else:
        rows.append(("GPU", "none chosen (no verdict)"))
    par = s.parallel
    rows.append(("GPUs", f"{par.gpus:,}" + (" — the ledger, the chart and the verdict are per GPU"
                                             if par.is_distributed else "")))
    if par.is_distributed:
        rows.append(("Strategy", STRATEGY_LABELS.get(par.strategy, par.strategy)))
        if par.dp_replicate > 1:
            rows.append(("Hybrid sharding", f"{par.dp_replicate:,} replicas, each sharded over {par.fsdp2_ranks:,} "
                                            "GPUs (gradients all-reduced across replicas)"))
        if par.model_parallel_text:
            rows.append(("Layout", f"{par.model_parallel_text} × data parallel {par.dp:,}"))
        if par.expert_split > 1:
            parts = ([f"split over {par.ep:,} GPUs (expert parallel)"] if par.ep > 1 else []) + (
                [f"each expert's weights over {par.etp:,} GPUs (Megatron-LM's expert tensor parallel)"]
                if par.etp > 1 else [])
            rows.append(("Routed experts", ", ".join(parts)))
        if pipeline_text(result):
            rows.append(("Pipeline", pipeline_text(result)))
        rows.append(("Offload", "none" if par.offload == "none" else OFFLOAD_TEXT[par.offload]))
        if par.strategy == "fsdp-hybrid" or par.offload != "none":
            rows.append(("GPUs per node", f"{par.node_size:,}"))
        if par.offload != "none":
            rows.append(("Host memory", f"{format_bytes(host_bytes(result))} per node for the offloaded state"
                         + (" and activations" if s.activation_offload != "none" else "")))
    rows += [
        ("CUDA context", f"{format_bytes(s.cuda_context_bytes)} outside PyTorch"),
        ("Allocator reserve", f"{s.allocator_reserve:.0%} of the tensor bytes of each phase"),
        ("Method", METHOD_LABELS.get(result.estimate.method, result.estimate.method)),
    ]
    return rows


def _max_batch_text(result: Result) -> str:
    v = result.verdict
    if v.max_micro_batch is None:
        return "— (choose a GPU)"
    if v.max_micro_batch == 0:
        return "none (not even 1)"
    if v.max_micro_batch >= MAX_SEARCH_BATCH:
        return f"{MAX_SEARCH_BATCH:,} or more"
    extra = ""
    if v.max_micro_batch >= result.setup.batch:
        extra = f" (this setup uses {result.setup.batch})"
    return f"{v.max_micro_batch:,}{extra}"


def _verdict_rows(result: Result) -> list[tuple[str, str]]:
    """Six facts: peak, largest object, GPU (left column in the PDF); tensor peak, headroom or excess,
    largest micro-batch that fits (right column)."""
    est, v = result.estimate, result.verdict
    peak = PHASE_LABELS[est.peak_phase]
    each = " per GPU" if is_per_gpu(result) else ""
    gpu = gpu_label(result)
    if is_per_gpu(result):
        gpu = f"{result.setup.parallel.gpus:,} × {gpu}, {strategy_text(result.setup)}"
    rows = [
        ("Peak", f"{result.size(est.peak_bytes)}{each} in the {peak.lower()} phase"),
        ("Largest object", f"{OBJECT_LABELS[est.dominant_object]} "
                           f"({result.size(est.peak.objects[est.dominant_object])})"),
        ("GPU", gpu),
        ("Tensor peak", f"{result.size(est.peak_tensor_bytes)}{each} (allocated)"),
    ]
    if v.capacity_bytes is not None and v.headroom_bytes is not None:
        if v.headroom_bytes >= 0:
            rows.append(("Headroom", f"{result.size(v.headroom_bytes)} free"))
        else:
            rows.append(("Over by", result.size(-v.headroom_bytes)))
    else:
        rows.append(("Headroom", "— (no GPU)"))
    rows.append(("Largest micro-batch that fits", _max_batch_text(result)))
    if host_bytes(result):
        rows.append(("Host memory", f"{result.size(host_bytes(result))} per node (offload)"))
    return rows


def _plan_table(result: Result) -> Table | None:
    rows = plan_rows(result)
    if not rows:
        return None
    gpus = result.setup.parallel.gpus
    return Table(("Strategy", "Fewest GPUs", f"Peak per GPU with {gpus:,}", "Result"),
                 tuple(Row(r, highlight=r[0].endswith(BEST_MARK)) for r in rows),
                 align={1: "right", 2: "right"}, widths=(40, 18, 24, 18))


def _ledger_table(result: Result) -> Table:
    est = result.estimate
    unit = result.unit  # one unit, as in the window's ledger
    rows = []
    for obj in shown_objects(est):
        cells = (OBJECT_LABELS[obj], *(_bytes_cell(est.phases[p].objects[obj], unit) for p in PHASES))
        rows.append(Row(cells, color=obj))
        if obj == "parameters":  # a fine-tuning run's parts, as the window's ledger lists them
            rows += [Row((f"   ↳ {name}", *(_bytes_cell(row[p], unit) for p in PHASES)))
                     for name, row in parameter_rows(est)]
    rows.append(Row(("Total", *(_bytes_cell(est.phases[p].total_bytes, unit) for p in PHASES)), strong=True))
    rows.append(Row(("Tensors (allocated)", *(_bytes_cell(est.phases[p].tensor_bytes, unit) for p in PHASES))))
    header = ("Object", *(PHASE_LABELS[p] + (" (peak)" if p == est.peak_phase else "") for p in PHASES))
    return Table(header, tuple(rows), align={i: "right" for i in range(1, len(PHASES) + 1)},
                 widths=(28, 18, 18, 18, 18), highlight_column=1 + PHASES.index(est.peak_phase))


def _suggestions_table(result: Result) -> tuple[Table | None, str]:
    v = result.verdict
    if not v.suggestions:
        return None, suggestions_note(result)
    rows = []
    size, cap = result.size, v.capacity_bytes  # one unit, the verdict's and the ledger's
    for i, s in enumerate(v.suggestions, 1):
        fit = "—" if s.fits is None or cap is None else (f"fits, headroom {size(cap - s.peak_bytes)}" if s.fits
                                                        else f"still over by {size(s.peak_bytes - cap)}")
        if s.host_bytes:
            fit += f"; host {size(s.host_bytes)} per node"
        rows.append(Row((str(i), s.title, size(s.peak_bytes), size(s.saves_bytes), fit, s.tradeoff),
                        highlight=bool(s.fits)))
    table = Table(("#", "Change", "Peak after", "Saves", "Result", "Trade-off"), tuple(rows),
                  align={0: "right", 2: "right", 3: "right"}, widths=(4, 31, 12, 11, 16, 26))
    if v.fits:
        note = "Ranked by the bytes they save at the peak (the setup already fits)."
    elif v.fits is None:
        note = "Ranked by the bytes they save at the peak."
    else:
        note = ADVICE_ORDER
    pending = suggestions_note(result)
    return table, f"{note} {pending}" if pending else note


def _pct(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{round(value, 1) or 0.0:+.1f} %"  # never "-0.0 %"


def _measurement_section(m: MeasureResult) -> MeasurementSection:
    kind = "CUDA allocator (torch.cuda.max_memory_allocated)" if m.device.kind == "cuda" \
        else "CPU tensor measurement (live-storage tracker; no GPU found)"
    device = f"{m.device.name} — {kind}"
    notes: list[str] = []
    if m.scale_note:
        notes.append(m.scale_note)
    if m.scaled:
        notes.append("The estimates in this table are of exactly the measured (scaled-down) setup.")
    if m.oom:
        notes.append(f"Out of memory: {m.oom}")
    notes += list(m.notes)
    err = m.error_pct
    rows = []
    est_phases = m.estimate.estimate.phases
    for p in PHASES:
        reading = m.phases.get(p)
        if reading is None:
            continue
        e = err.get(p)
        rows.append(Row((PHASE_LABELS[p], format_bytes(est_phases[p].tensor_bytes), format_bytes(reading.peak_bytes),
                         _pct(e))))
    table = Table(("Phase", "Estimated (tensors)", "Measured peak", "Estimate − measured"), tuple(rows),
                  align={1: "right", 2: "right", 3: "right"}, widths=(28, 24, 24, 24))
    extra: list[tuple[str, str]] = [("Measured setup", m.setup.summary())]
    for r in m.ranks if len(m.ranks) > 1 else ():  # every rank of a multi-GPU setup, beside its own estimate
        errors = r.error_pct
        readings = "; ".join(f"{PHASE_LABELS[p].lower()} {format_bytes(r.phases[p].peak_bytes)} "
                             f"({_pct(errors.get(p))})" for p in PHASES[1:] if p in r.phases)
        extra.append((r.label[0].upper() + r.label[1:] + (" — shown above" if r.rank == m.shown_rank else ""),
                      readings))
    if m.context_bytes is not None:
        extra.append(("CUDA context measured", format_bytes(m.context_bytes)))
    if m.peak_reserved_bytes:
        extra.append(("Peak reserved", format_bytes(m.peak_reserved_bytes)))
    leak = m.leak
    live = ", ".join(format_bytes(b) for b in leak.get("live_bytes_per_iteration", []))
    if live:
        verdict = "growing from iteration to iteration (a leak: memory ledger)" if leak.get("growing") else "steady"
        extra.append(("Live bytes per iteration", f"{live} — {verdict}"))
    if m.seconds:
        extra.append(("Time", f"{m.seconds:.1f} s"))
    return MeasurementSection(device, m.headline(), tuple(notes), table, tuple(m.signals), tuple(extra))


def _modules_table(modules: Sequence[tuple[str, int]]) -> tuple[Table | None, str]:
    items = [(str(name), int(n)) for name, n in modules]
    if not items:
        return None, ""
    items.sort(key=lambda t: -t[1])
    total = sum(n for _, n in items)
    shown = items[:MAX_MODULE_ROWS]
    rows = [Row((name, format_bytes(n), f"{n / total * 100:.1f} %" if total else "—")) for name, n in shown]
    rest = items[MAX_MODULE_ROWS:]
    if rest:
        n_rest = sum(n for _, n in rest)
        rows.append(Row((f"{len(rest):,} more modules", format_bytes(n_rest),
                         f"{n_rest / total * 100:.1f} %" if total else "—")))
    rows.append(Row(("Total", format_bytes(total), "100.0 %" if total else "—"), strong=True))
    note = (f"{len(items):,} modules from the trace, largest first: the activations each holds at the forward "
            "peak (repeated layers summed as layers.*); shares are of the modules listed.")
    return Table(("Module", "Memory", "Share"), tuple(rows), align={1: "right", 2: "right"},
                 widths=(64, 20, 16)), note


def _formulas(result: Result, measured: bool) -> list[tuple[str, tuple[str, ...]]]:
    s, method = result.setup, result.estimate.method
    rows: list[tuple[str, tuple[str, ...]]] = [
        ("Phases load → forward → backward → optimizer step; the object colours of the chart.", (SEED_000,)),
        ("Phase total = the sum of the objects live at that phase’s peak; the peak is the largest phase total; "
         "the dominant object is the largest object of the peak phase.", (SEED_004,)),
    ]
    if method == "quick":
        rows.append(("Total = N·P + 2·N·P + max(2·N·P, A·B·L·P), A = 4.6894e-4·N + 1.8494e6 (N parameters, "
                     "P bytes per value, B micro-batch, L sequence length).", (SEED_000,)))
    else:
        rows += [
            ("Weights N·4 B (fp32), N·6 B (mixed: fp32 master + 16-bit compute copy of the matmul weights), "
             "N·2 B (bf16); gradients in the weight dtype.", (SEED_002,)),
            ("Adam/AdamW state 8 B/param in fp32 (exp_avg + exp_avg_sq); 8-bit AdamW ≈ 2 B/param.", (SEED_002,)),
            ("AdamW step temporaries: foreach ≈ 1× the parameters, single-tensor ≈ max over tensors of "
             "size[i−1] + 2·size[i], fused ≈ 0.", (SEED_001, MEMCALC)),
            ("Activations: the tensors autograd saves, counted per op of the actual block (SDPA keeps q, k, v, the "
             "output and a logsumexp; eager attention adds B·heads·L² scores); for a GPT-3 block this reduces to "
             "sbh(34 + 5as/h).", (KORTHIKANTI, MEMCALC)),
        ]
        if s.loss == "full":
            rows.append(("Loss: B·L·V logits in the compute dtype, an fp32 copy and the log-softmax kept for "
                         "backward.", (MEMCALC,)))
        if s.checkpointing == "full":
            rows.append(("Full checkpointing keeps each layer’s input (B·L·h) and recomputes the block in backward "
                         "(memory-profiling guide: 40–60 % less activation memory).", (SEED_003,)))
        elif s.checkpointing == "selective":
            rows.append(("Per-op selective checkpointing: each layer keeps its input, its attention output and every "
                         "other matrix product’s output; the rest is recomputed in backward, one layer at a time.",
                         (TORCHTITAN,)))
        elif s.checkpointing.startswith("every:"):
            rows.append((f"Every {ordinal(int(s.checkpointing[6:]))} layer checkpointed: those keep their input "
                         "(B·L·h), the others what they save; one layer recomputed at a time in backward.",
                         (TORCHTITAN,)))
        if s.loss == "chunked":
            rows.append(("Chunked loss: no B·L·V logits; the hidden-state gradient (B·L·h) and the fp32 head-weight "
                         "gradient (V·h) made in forward beside one chunk’s logits.", (LIGER,)))
        if s.optimizer_in_backward:
            rows.append(("Optimizer step in backward: each gradient stepped and freed as it is accumulated; the "
                         "optimizer phase keeps weights and state only.", (PT_OPT_BWD,)))
        if s.packing:
            rows.append((f"Padding-free packing: {s.packing_text()}; activations scale with the real tokens. "
                         + ("FlashAttention-2 attends within each document from their lengths, keeping no mask."
                            if s.attention == "flash" else
                            "SDPA gets a block-diagonal mask (L × L) and keeps it in every layer."
                            if s.attention == "sdpa" else "Eager attention computes and masks L × L scores."),
                         (HF_PACKING,) + ((FLASH_ATTN,) if s.attention == "flash" else ())))
        if s.activation_offload == "checkpoint-inputs":
            rows.append(("Checkpoint inputs offloaded: each layer’s input (B·L·h) lives in host memory and comes back "
                         "for its recomputation; the GPU keeps one or two at a time.", (TORCHTUNE,)))
        elif s.activation_offload == "all":
            rows.append(("Every saved tensor offloaded: the GPU holds one layer’s working set in forward and one "
                         "backward node’s saved tensors at a time; the host holds a copy per saving op, weights’ "
                         "copies included.", (PT_SAVE_ON_CPU,)))
    if s.parallel.is_distributed:
        rows += [
            ("Per GPU, mixed precision + Adam: DDP keeps (2 + 2 + K)Ψ with K = 12 on every GPU; ZeRO-1 2Ψ + 2Ψ + "
             "KΨ/N, ZeRO-2 2Ψ + (2 + K)Ψ/N, ZeRO-3 (2 + 2 + K)Ψ/N (Ψ parameters, N GPUs); activations stay those "
             "of one micro-batch.", (ZERO,)),
            ("DeepSpeed's engines add an fp32 gradient partition (4Ψ/N), a reduce bucket of up to 5e8 elements "
             "(stage 2) and the largest layer gathered (stage 3: 18Ψ/N + 4·L); offloaded state needs host memory "
             "× GPUs per node × 1.5.", (DEEPSPEED,)),
            ("FSDP FULL_SHARD shards fp32 flat parameters, gradients and optimizer state over N and gathers the "
             "root unit and at most two units; SHARD_GRAD_OP keeps parameters gathered from forward to backward; "
             "HYBRID_SHARD shards within a node. CPUOffload moves the shards and the step to the host.", (FSDP,)),
            *([("FSDP2 (fully_shard) keeps its fp32 shard, the root unit and the last all-gather's output; a layer "
                "is gathered while it runs (from forward to backward without reshard_after_forward); finished "
                "layers' gradients are reduce-scattered into shards. Under mixed precision the gathered weights "
                "and the compute are bf16 (MixedPrecisionPolicy). Checked against real 2- and 4-process steps.",
                (FSDP2, MEMCALC))] if s.parallel.strategy == "fsdp2" else []),
            ("Fewest GPUs per strategy: binary search on the GPU count (the per-GPU peak never grows with more "
             "GPUs); best strategy: the least communication that fits (DDP, ZeRO-1, ZeRO-2, FSDP shard-grad-op, "
             "hybrid, ZeRO-3, FSDP full shard).", (MEMCALC, ZERO)),
        ]
    rows += [
        ("Effective batch = micro-batch × accumulation steps; only the micro-batch moves activations; with "
         "accumulation the gradients live through forward and backward.", (SEED_004,)),
        ("Tensor peak = parameters + gradients + optimizer state and temporaries + activations + temporaries + "
         "inputs (what torch.cuda.max_memory_allocated reports).", (SEED_001, SEED_000)),
        (f"CUDA context: a fixed {format_bytes(s.cuda_context_bytes)} outside PyTorch (1.35–1.64 GB measured with "
         "older CUDA; lazy loading needs less).", (SEED_001,)),
        (f"Allocator reserve = {s.allocator_reserve:.0%} × the phase’s tensor bytes (fragmentation 5–20 %).",
         (SEED_003,)),
        ("Largest micro-batch: exponential, then binary search on this estimate (the peak never decreases with "
         "the micro-batch).", (SEED_004, MEMCALC)),
    ]
    if measured:
        rows.append(("Error = (estimate − measured) / measured, per phase; three signals compare the estimate with "
                     "allocated, reserved and the capacity.", (SEED_004, SEED_001)))
    return rows


def build_content(result: Result, *, measurement: MeasureResult | None = None,
                  modules: Sequence[tuple[str, int]] | None = None, notes: Sequence[str] = (),
                  when: datetime | None = None, timeline: Timeline | None = None) -> ReportContent:
    """The report of ``result`` (and of a measurement, a trace's per-module breakdown or a timeline, when
    given)."""
    setup, est, v = result.setup, result.estimate, result.verdict
    when = when or datetime.now().astimezone()
    named = str(setup.extras.get("model_name") or "")  # a family without a block model: the preset's or config's
    model = setup.model.name if setup.model is not None and setup.model.name else (
        "config.json model" if setup.model is not None else
        f"{named} ({format_count(setup.num_params)} parameters)" if named else
        f"{format_count(setup.num_params)} parameters")
    title = f"GPU memory report: {model}"
    per_gpu = parallel_label(setup) if is_per_gpu(result) else ""
    where = f"on {gpu_label(result)}" if setup.capacity_bytes is not None else "no GPU chosen"
    if per_gpu:
        n = setup.parallel.gpus
        gpus = f"{n:,} × {gpu_label(result)}" if setup.capacity_bytes is not None else f"{n:,} GPUs"
        where = f"per GPU on {gpus}, {strategy_text(setup)}"
    tuned = f"{setup.tuning_short()}, " if setup.tuning.method != "full" else ""
    packed = f" (packed: {setup.row_len:,} tokens)" if setup.packing else ""
    subtitle = (f"Micro-batch {setup.batch} × sequence {setup.seq:,}{packed} × accumulation {setup.grad_accum}, "
                f"{tuned}{setup.precision}, {setup.optimizer} — {where}")
    ledger = _ledger_table(result)
    suggestions, suggestions_note = _suggestions_table(result)
    modules_table, modules_note = _modules_table(modules or [])

    assumption_rows = [Row((a, "; ".join(sources_for(a))))
                       for a in (*(f"Warning: {w}" for w in result.warnings), *notes, *est.assumptions)]
    assumptions = Table(("Assumption", "Source"), tuple(assumption_rows), widths=(76, 24))
    formula_rows = [Row((text, "; ".join(keys))) for text, keys in _formulas(result, measurement is not None)]
    formulas = Table(("Formula", "Source"), tuple(formula_rows), widths=(76, 24))
    cited = {k for r in (*assumption_rows, *formula_rows) for k in r.cells[1].split("; ")}
    references = tuple((k, SOURCES[k]) for k in SOURCES if k in cited)

    measured_peaks: dict[str, int] = {}
    measured_reference: dict[str, int] = {}
    measured_label = ""
    measurement_section = None
    unit = result.unit
    caption = ("Memory per GPU per phase" if per_gpu else "Memory per phase") + \
        f", stacked by object ({unit}); the outlined bar is the peak" + (
        ", the dashed line the GPU capacity." if setup.capacity_bytes is not None else ".")
    if measurement is not None:
        measurement_section = _measurement_section(measurement)
        if measurement.requested.same_tensors(setup) and measurement.phases and not measurement.oom:
            measured_peaks = {p: r.peak_bytes for p, r in measurement.phases.items() if p in PHASES}
            where = measurement.device.name if measurement.device.kind == "cuda" else "CPU"
            measured_label = f"Measured ({where}{', scaled-down setup' if measurement.scaled else ''})"
            if measurement.scaled:
                measured_reference = {p: measurement.estimate.estimate.phases[p].tensor_bytes
                                      for p in measured_peaks}
                caption += (" Diamonds: measured tensor peaks of the scaled-down setup, on narrow dashed bars "
                            "that are its estimate.")
            else:
                caption += " Diamonds: measured tensor peaks (allocated), drawn above the CUDA context."
        else:
            measurement_section = MeasurementSection(
                measurement_section.device, measurement_section.headline,
                ("This measurement is of a different setup than the estimate above.", *measurement_section.notes),
                measurement_section.table, measurement_section.signals, measurement_section.extra)
    return ReportContent(
        title=title,
        subtitle=subtitle,
        date=when.strftime("%Y-%m-%d %H:%M %Z").strip(),
        version=__version__,
        method=est.method,
        fits=v.fits,
        headline=per_gpu_headline(result),
        verdict=tuple(_verdict_rows(result)),
        setup=tuple(_setup_rows(result)),
        ledger=ledger,
        suggestions=suggestions,
        suggestions_note=suggestions_note,
        measurement=measurement_section,
        modules=modules_table,
        modules_note=modules_note,
        assumptions=assumptions,
        formulas=formulas,
        units=UNITS_TEXT,
        references=references,
        notes=tuple(notes),
        chart_caption=caption,
        measured_peaks=measured_peaks,
        measured_reference=measured_reference,
        measured_label=measured_label,
        per_gpu=per_gpu,
        plan=_plan_table(result),
        plan_notes=tuple(plan_sentences(result)),
        host=host_text(result),
        timeline_caption=timeline_caption(timeline, result) if timeline is not None and timeline.events else "",
    )


def timeline_caption(timeline: Timeline, result: Result) -> str:
    """What the timeline figure shows, and each phase's peak beside the estimate."""
    what = {"trace": "Predicted by the trace (the real model on fake tensors, two iterations, sizes rounded as "
                     "the CUDA caching allocator rounds them)",
            "measured": "Measured on this machine (every tensor storage of the measured iterations)",
            "profiler": "A PyTorch profiler memory timeline (its categories, no phases)",
            "ledger": f"Coarse, drawn from the {result.estimate.method} ledger (each phase reaches the ledger's peak, "
                      "decoder layers one by one; the shape between the peaks is not predicted — the trace predicts "
                      "every allocation)"}.get(
        timeline.source, "A CUDA memory snapshot (phases found from its stack frames)")
    rows = [] if timeline.source == "ledger" else \
        compare_phases(timeline, {p: dict(ph.objects) for p, ph in result.estimate.phases.items()})
    peaks = "; ".join(f"{PHASE_LABELS.get(r.phase, 'at the peak')}: {format_bytes(r.timeline_bytes)} "
                      f"(estimate {format_bytes(r.estimate_bytes)})" for r in rows)
    caption = (f"{what}: {len(timeline.events):,} allocations and frees, live memory stacked by object, phases "
               "shaded; the estimate's tensor peak and the capacity are drawn as lines when the timeline comes within "
               "a fifth of them.")
    return caption + (f" Peaks — {peaks}." if peaks else "")

