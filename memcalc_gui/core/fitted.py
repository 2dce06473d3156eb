"""Method ``fitted``: any transformers family at analytic speed, from a few small fake-tensor traces.

A family without a hand-written block model is traced (``memcalc_gui.trace.fit``) at two or three layer counts
and two shapes each. Every storage of a training step has a size that is a monomial in the micro-batch ``b``
and the sequence length ``s`` (``b·s·h`` bytes for a hidden state, ``b·heads·s²`` for eager attention scores, a
constant for a weight), and the op sequence does not depend on ``b`` and ``s``; so every moment of the step has
live bytes ``c₀ + c₁·b + c₂·s + c₃·b·s + c₄·s² + c₅·b·s²`` per ledger object, and a phase's peak is the largest
of its moments. The calibration keeps each phase's moments that can be the largest for some ``b, s ≥ 1`` (the
others are below one of them everywhere); evaluating them is a few hundred multiplications. Layers repeat: the
peak composition at ``L`` layers is extrapolated linearly from the traced layer counts (decoders whose layers
all look alike), and a further trace at another layer count and shape checks the whole fit before it is used.

This module is standard-library only: it holds the calibrated coefficients and evaluates them.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .configfile import dense_prefix_layers
from .distributed import (
    BF16_COMPUTE,
    ModelStates,
    check_expert_placement,
    check_experts,
    expert_parallel_states,
    model_states,
)
from .errors import InputError
from .layouts import (
    MIN_GPUS_FOR,
    NOT_CALIBRATED,
    TRACED_PIPELINE_STRATEGIES,
    ModelShape,
    Search,
    search,
    stage_group_runs,
)
from .ledger import Estimate, with_overheads
from .quick import precision_bytes
from .result import Result
from .setup import TrainingSetup, checkpoint_every, one_replica_sequence_parallel
from .solver import gpu_plan, solve
from .units import MAX_COUNT, MAX_SIZE_BYTES
from .vocab import PHASES, TENSOR_OBJECTS

#: The monomials of (b, s) a moment's live bytes are made of.
BASIS = ("1", "b", "s", "b·s", "s²", "b·s²")
#: The fit's JSON (7: the check trace's bytes, ``FitModel.anchor``); a cached fit of another schema is calibrated again.
FIT_SCHEMA = 7

Poly = tuple[float, float, float, float, float, float]
Moment = dict[str, Poly]  # ledger object → coefficients
Transform = Callable[[str, dict[str, float]], dict[str, float]]  # (phase, composition) → per-GPU composition

#: The counts of ``FitModel.structure`` (``trace.meta.structure_on_meta``): what a per-GPU budget needs.
STRUCTURE_KEYS = ("num_params", "active_params", "layer_params", "largest_module", "root_unit", "expert_params",
                  "num_experts", "top_k", "hidden_size", "layer_expert_params", "largest_expert_module",
                  "largest_dense_module")
#: The most layers a fit's counts may name (a config's layers are at most 100,000: ``core.model``).
MAX_FIT_LAYERS_READ = 1_000_000


def structure_problem(counts: Any) -> str | None:
    """Why ``counts`` (``trace.meta.structure_on_meta``'s, or the subset a fit keeps) cannot be a model's, or
    ``None``: every count a whole number from 0 to 10¹⁸, some parameters, and the counts consistent with one
    another as the meta-device build makes them (active ≤ all, the routed experts within the parameters, one layer
    and the root within the whole, the experts' and top-k's presence together). A cache file that fails this is
    damaged (``core.cachefile``)."""
    if not isinstance(counts, dict):
        return "the counts are not an object"
    for name, value in counts.items():
        if type(value) is not int or not 0 <= value <= MAX_COUNT:
            return f"the count {str(name)[:40]!r} is not a whole number from 0 to 10^18"
    n = counts.get("num_params")
    if n is not None and n < 1:
        return "the model has no parameters"

    def get(name: str) -> int | None:
        value = counts.get(name)
        return value if isinstance(value, int) else None

    rules = (("active_params", "num_params"), ("expert_params", "num_params"), ("layer_params", "num_params"),
             ("largest_module", "num_params"), ("root_unit", "num_params"), ("largest_dense_module", "num_params"),
             ("layer_expert_params", "expert_params"), ("layer_expert_params", "layer_params"),
             ("largest_expert_module", "expert_params"), ("top_k", "num_experts"))
    for small, large in rules:
        a, b = get(small), get(large)
        if a is not None and b is not None and a > b:
            return f"{small} ({a:,}) exceeds {large} ({b:,})"
    total, experts, active = get("num_params"), get("expert_params"), get("active_params")
    if total is not None and experts is not None and active is not None and active < total - experts:
        return f"active_params ({active:,}) is below the parameters outside the routed experts ({total - experts:,})"
    root, layer = get("root_unit"), get("layer_params")
    if total is not None and root is not None and layer is not None and root + layer > total:
        return f"root_unit and layer_params ({root:,} + {layer:,}) exceed num_params ({total:,})"
    present = [get(k) for k in ("expert_params", "num_experts", "top_k")]
    if None not in present and len({bool(v) for v in present}) > 1:
        return "expert_params, num_experts and top_k are not all zero or all non-zero"
    return None


def basis(b: int, s: int) -> tuple[int, int, int, int, int, int]:
    return 1, b, s, b * s, s * s, b * s * s


def poly_value(poly: Poly | list[float], b: int, s: int) -> float:
    return sum(c * x for c, x in zip(poly, basis(b, s), strict=True))


def signature(setup: TrainingSetup) -> dict[str, Any]:
    """What a calibration depends on besides the config: every choice except the shape, the layer count and the
    GPU (which only set capacity and overheads)."""
    if setup.activation_offload != "none":
        raise InputError("activation_offload", "the fitted method does not model activation offloading yet (its host "
                                               "memory is not fitted): trace this setup (--method trace)")
    if setup.packing:
        raise InputError("packing", "the fitted method calibrates padded rows, not packed documents: trace this "
                                    "setup (--method trace) or use the analytic method")
    ft = setup.tuning
    return {
        **({"pipeline": pipeline_layout(setup)} if setup.parallel.pp > 1 else {}),
        "precision": traced_precision(setup), "optimizer": setup.optimizer, "optimizer_impl": setup.optimizer_impl,
        "attention": setup.attention, "checkpointing": setup.checkpointing, "use_cache": setup.use_cache,
        "loss": setup.loss, "loss_chunk": setup.loss_chunk, "optimizer_in_backward": setup.optimizer_in_backward,
        "target_device": setup.target_device,
        **({"galore_rank": setup.galore_rank} if setup.optimizer == "galore-adamw" else {}),
        # the rank of a tensor-parallel group is its own, narrower model (trace.ranks.tensor_parallel_config)
        **({"tp": setup.parallel.tp} if setup.parallel.tp > 1 else {}),
        # beside expert parallelism its routed experts keep their width (transformers' plan)
        **({"experts_whole": True} if setup.parallel.tp > 1 and setup.parallel.ep > 1 else {}),
        "tuning": {"method": ft.method, "rank": ft.rank, "targets": list(ft.targets), "dropout": ft.dropout,
                   "adapter_dtype": ft.adapter_dtype, "quant": ft.quant, "double_quant": ft.double_quant,
                   "trainable": list(ft.trainable), "prepare_kbit": ft.prepare_kbit}
        if ft.method != "full" else {"method": "full"},
    }


#: Optimizers whose state (and step temporaries) torch keeps in the parameters' dtype: a bf16 calibration holds half
#: the bytes of the fp32 shards a bf16-compute strategy steps on.
STATE_IN_PARAM_DTYPE = ("adamw", "adam", "sgd-momentum", "adafactor", "lion", "galore-adamw")


def bf16_compute(setup: TrainingSetup) -> bool:
    """Mixed precision under a strategy that computes in bf16 over fp32 state (FSDP2's ``MixedPrecisionPolicy``,
    Megatron-LM's bf16 model): the calibration traces the bf16 step, as ``trace.fake`` does."""
    return setup.precision == "mixed" and setup.parallel.strategy in BF16_COMPUTE and setup.parallel.is_distributed


def traced_precision(setup: TrainingSetup) -> str:
    """The precision the calibration traces (:func:`bf16_compute`)."""
    return "bf16" if bf16_compute(setup) else setup.precision


#: And those whose stage is traced as one replica of its bf16 step, its model states then laid out by rule as for
#: one GPU (:func:`per_gpu_states`): Megatron-LM's optimizers. (DeepSpeed's pipeline engine runs ZeRO stage 1 only,
#: over autocast here, whose weight copies per micro-batch in flight the one-GPU rule does not follow: not offered.)
PIPELINE_STRATEGIES = (*TRACED_PIPELINE_STRATEGIES, "megatron", "megatron-distopt")
#: The most micro-batches a fitted pipeline rank's traces run: GPipe keeps every one in flight and the interleaved
#: schedule's rounds depend on their number, so their traces run the step's own count.
MAX_PIPELINE_MICROBATCHES = 64


def rank_layout(setup: TrainingSetup) -> dict[str, Any] | None:
    """The FSDP2 layout whose rank a fit also traces (``FitModel.rank``): ``fully_shard`` over the data-parallel
    GPUs of one pipeline-free model, its routed experts split over ``ep`` of them, on the fake process group, as
    ``--method trace`` runs it. The rule of :func:`per_gpu_states` bounds FSDP2's gathered units by the root unit and
    two layers, up to 20 % over the traced rank where they weigh as much as the activations (bench/expert.py);
    the traced rank needs no rule. Beside expert and tensor parallelism, under the other strategies, the rank of the
    replicated layout (``dp_replicate``): DDP's ledger with its buckets by rule, and the activations the strategies
    not traced lay their states over. With tensor parallelism the rank runs transformers' plan on the whole model (the
    one-replica fit calibrates the narrower model that stands for it). With context parallelism, the rank of the ring
    (ring attention over its seq/cp tokens; FSDP2 over dp × cp, or the model whole on every rank under the other
    strategies), with tensor or expert parallelism too (the ring runs over each tensor-parallel rank's heads; the
    routed experts split over ep of the data- and context-parallel GPUs, as torchtitan lends them). ``None`` for a
    layout the rank fit does not run (loss parallelism, offload, adapters, context parallelism at a degree the
    calibration's sequences do not split, sequence parallelism but beside FSDP2 or over every GPU of one replica):
    the rule stands there. With sequence parallelism, torchtitan's plan on top of transformers' split: the norms on
    the rank's seq/tp tokens, attention and the MLP or the experts' block gathering them (under DDP with every GPU
    tensor-parallel, the rank of that plan alone, as torchtitan runs it without FSDP)."""
    par = setup.parallel
    context = par.cp > 1
    # the rank of the replicated layout where the one-replica rule's activations are only a bound: expert beside tensor
    # parallelism, whose one-replica trace runs every token through the experts (each GPU of a tensor-parallel group
    # runs its share), and context parallelism, whose ring attention the one-replica trace does not run. DDP's ledger
    # is that rank's; the strategies not traced lay their states over its activations
    alone = one_replica_sequence_parallel(par)  # every GPU tensor-parallel: torchtitan's plan, no FSDP applied
    replicated = par.strategy != "fsdp2" and ((par.tp > 1 and par.ep > 1) or context) and not alone
    if not (par.strategy == "fsdp2" or replicated or alone) or par.pp > 1 or par.gpus < 2 \
            or (par.sp and par.strategy != "fsdp2" and not alone) \
            or par.loss_parallel or par.offload != "none" or setup.tuning.method != "full":
        return None
    if context and par.cp not in CONTEXT_DEGREES:
        return None
    if alone:
        return {"dp_shard": 1, "tp": par.tp, "ep": par.ep, "sp": True}
    if replicated:
        if context:  # every context-parallel rank holds the model whole (the strategy shards over dp × cp)
            return {"dp_replicate": par.dp, "tp": par.tp, "cp": par.cp, "replicate_context": True,
                    **({"ep": par.ep} if par.ep > 1 else {})}
        return {"dp_replicate": par.dp, "tp": par.tp, "ep": par.ep}
    return {"dp_shard": par.dp // par.dp_replicate, "tp": par.tp, "ep": par.ep,
            "reshard_after_forward": par.reshard_after_forward,
            **({"dp_replicate": par.dp_replicate} if par.dp_replicate > 1 else {}),  # FSDP2's hybrid sharding
            **({"cp": par.cp} if context else {}),  # FSDP2 over dp × cp, torchtitan's dp_shard_cp mesh
            **({"sp": True} if par.sp else {})}  # torchtitan's sequence-parallel plan on transformers' split


#: The context-parallel degrees whose rank a fit traces: the calibration's sequences (64, 128 and 96 tokens,
#: ``trace.fit.SHAPES`` and ``CHECK_SHAPE``) split into the 2·cp equal chunks of ring attention's balanced causal
#: split (``context.check_ring``). Other degrees take the one-replica rule.
CONTEXT_DEGREES = (2, 4, 8, 16)


def rank_signature(setup: TrainingSetup) -> dict[str, Any] | None:
    """The signature of the rank fit :func:`rank_layout` calls for, ``None`` where none is."""
    layout = rank_layout(setup)
    return None if layout is None else {**signature(setup), "ranks": layout}


def pipeline_microbatches(setup: TrainingSetup) -> int:
    """The micro-batches a fitted pipeline rank's traces run. Under 1F1B a rank's state repeats once its steady
    state has had a forward after a backward (``pp − r − 1`` warm-up forwards, then forward-backward pairs with the
    gradients in place): ``pp + 1`` micro-batches hold every moment a longer step holds
    (``tests/test_pipeline_fitted.py`` checks it against the step traced with every micro-batch).
    GPipe and the interleaved schedule run the step's own count."""
    par, m = setup.parallel, setup.grad_accum
    if par.schedule == "1f1b":
        return min(m, par.pp + 1)
    if m > MAX_PIPELINE_MICROBATCHES:
        raise InputError("grad_accum", f"the fitted method traces every micro-batch of the {par.schedule} schedule, at "
                                       f"most {MAX_PIPELINE_MICROBATCHES}; got {m:,} (1F1B repeats after pp + 1 and "
                                       "takes any count)")
    return m


def pipeline_layout(setup: TrainingSetup) -> dict[str, Any]:
    """What a fitted pipeline rank's calibration depends on besides the model: the schedule, its traced micro-batches
    and the strategy the stage runs under. Raises :class:`InputError` for a layout the schedule's trace does not
    run for a family without a block model."""
    par = setup.parallel
    if par.strategy not in PIPELINE_STRATEGIES:
        raise InputError("strategy", "pipeline stages of a family memcalc has no block model of are fitted under DDP "
                                     "or FSDP2 (PyTorch's schedule runs them) or Megatron-LM's optimizers (their "
                                     "states by rule); choose --strategy ddp, fsdp2, megatron or megatron-distopt")
    if par.strategy == "fsdp2" and par.dp * par.cp == 1:
        raise InputError("strategy", f"FSDP2 over one data-parallel GPU per stage shards nothing ({par.gpus:,} GPUs "
                                     f"in {par.pp} stages of {par.tp} tensor-parallel GPU(s)): choose DDP, or more "
                                     "GPUs")
    if par.ep > 1 and (par.dp * par.cp * par.tp) % par.ep:
        raise InputError("ep", f"expert parallelism in a pipeline stage splits the experts over {par.ep} of the "
                               f"stage's {par.dp * par.cp * par.tp} GPUs (Megatron-LM's and torchtitan's layout): ep "
                               "must divide them")
    if par.ep > 1 and par.tp > 1 and par.strategy not in TRACED_PIPELINE_STRATEGIES:
        raise InputError("strategy", "expert beside tensor parallelism in pipeline stages is fitted from the stage's "
                                     "own traces under DDP and FSDP2 (transformers' layout, each tensor-parallel "
                                     "group's ranks holding experts of one expert-parallel group); choose --strategy "
                                     "ddp or fsdp2")
    if par.cp > 1 and par.strategy != "fsdp2":
        raise InputError("strategy", "context parallelism in pipeline stages runs as torchtitan runs it, each stage "
                                     "fully_shard-ed over data parallel × context parallel: choose --strategy fsdp2")
    if par.cp > 1 and par.sp:
        raise InputError("cp", "context beside sequence parallelism in pipeline stages is not traced; without pipeline "
                               "stages it is")
    if par.cp > 1 and par.ep > 1 and par.tp > 1:
        raise InputError("cp", "context beside expert and tensor parallelism in pipeline stages is not traced (each "
                               "pairing of the three is); without pipeline stages it is")
    if par.cp > 1 and par.cp not in CONTEXT_DEGREES:
        raise InputError("cp", f"the pipeline stages of a family without a block model are fitted from traces of "
                               f"64 to 128 tokens, which split into 2·cp chunks for cp "
                               f"{', '.join(map(str, CONTEXT_DEGREES))}, not {par.cp}")
    fsdp2 = par.strategy == "fsdp2"
    # Megatron-LM's two optimizers run the same traced stage (one replica of the bf16 step, its states by rule): one
    # calibration serves both
    return {"pp": par.pp, "schedule": par.schedule, "virtual": par.virtual_stages,
            "microbatches": pipeline_microbatches(setup),
            "strategy": "megatron" if par.strategy.startswith("megatron") else par.strategy,
            "dp_shard": par.dp // par.dp_replicate if fsdp2 else 1,
            "reshard_after_forward": par.reshard_after_forward if fsdp2 else True,
            **({"dp_replicate": par.dp_replicate} if par.dp_replicate > 1 else {}),  # FSDP2's hybrid sharding
            # each stage's ring: its seq/cp tokens with ring attention, FSDP2 over dp × cp (torchtitan's dp_shard_cp)
            **({"cp": par.cp} if par.cp > 1 else {}),
            # beside expert parallelism the stage's tensor-parallel group runs for real (transformers' plan; the
            # tokens split over it before the all-to-all), and with sequence parallelism (torchtitan's plan on top),
            # not as the narrower model that stands for one of its ranks
            **({"tp": par.tp} if stage_group_runs(par) else {}),
            **({"sp": True} if par.sp else {}),
            # by rule, the experts are split by the states' rule too (expert_parallel_states): one replica traced
            **({"ep": par.ep} if par.ep > 1 and par.strategy in TRACED_PIPELINE_STRATEGIES else {})}


@dataclass(frozen=True)
class FitModel:
    """The calibrated moments of one config and setup signature.

    ``moments[phase]`` are the phase's candidate moments, each traced at the two layer counts ``layers`` (the
    same op in each: its live bytes at ``L`` layers are extrapolated linearly) in a step without gradient
    accumulation, ``accum_moments`` with it. Load and the optimizer step, whose ops repeat per parameter rather
    than per layer, keep each layer count's own candidates (``[moments at layers[0], moments at layers[1]]``):
    their largest moment is the same at every count (the largest tensor's, on top of states that grow with the
    layers), so the two peaks are extrapolated (the calibration traces two micro-batches: the first one's windows are
    a step without accumulation, both together one with it); ``num_layers`` is the config's own count;
    ``checked`` what the validation trace found (relative error per phase); ``structure`` the counts of the
    full-size model a per-GPU budget needs (:data:`STRUCTURE_KEYS`)."""

    model_type: str
    num_params: int
    num_layers: int
    signature: dict[str, Any]
    layers: tuple[int, int]
    moments: dict[str, list[list[Moment]]]
    accum_moments: dict[str, list[list[Moment]]]
    checked: dict[str, float] = field(default_factory=dict)
    calibration_s: float = 0.0
    notes: tuple[str, ...] = ()
    structure: dict[str, int] = field(default_factory=dict)
    #: Under pipeline parallelism, each checked rank's own fit (``core.pipeline.ranks_to_check``), by rank: its
    #: moments are those of the rank's step under the schedule (all its micro-batches), its layers a stage-chunk's.
    #: This fit's own moments are then the first rank's.
    stages: dict[int, FitModel] = field(default_factory=dict)
    #: The fit of one rank of the setup's FSDP2 layout (:func:`rank_layout`), calibrated beside this one-replica fit:
    #: its moments hold FSDP2's shards and gathered units as traced. The replica stays for the what-ifs and the GPU
    #: plan's other layouts (their states by rule).
    rank: FitModel | None = None
    #: The check trace's bytes the fit was checked against (``trace.fit``): ``{"layers", "batch", "seq"}`` and
    #: ``"bytes"`` per phase (load's live bytes, the others' peaks, accumulating). Kept so that a cached fit whose
    #: moments were changed after the check no longer agrees with it (:meth:`check`).
    anchor: dict[str, Any] = field(default_factory=dict)
    #: Each phase's candidate compositions at a shape, before any transform (:meth:`peak`): a layout search evaluates
    #: one fit at one shape for every layout, only the transform differs. A copy made by ``dataclasses.replace``
    #: starts empty (its layer count may differ).
    _evaluated: dict[tuple[str, int, int, bool], list[dict[str, float]]] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.layers) != 2 or self.layers[0] >= self.layers[1]:
            raise ValueError("a fit extrapolates between two increasing layer counts")
        for moments in (self.moments, self.accum_moments):
            if set(moments) != set(PHASES) or any(len(pair) != 2 for p, ms in moments.items() for pair in ms
                                                  if p not in SEPARATE) \
                    or any(len(moments[p]) != 2 for p in SEPARATE):
                raise ValueError("a fit holds every phase's moments at both layer counts")

    def peak(self, phase: str, b: int, s: int, accumulating: bool = False,
             transform: Transform | None = None) -> dict[str, int]:
        """The phase's peak composition at micro-batch ``b``, sequence ``s`` and the config's layer count: every
        candidate moment extrapolated to that count (and made per-GPU by ``transform``), then the largest."""
        best: dict[str, float] = {}
        best_total = -1.0
        for comp in self._candidates(phase, b, s, accumulating):
            if transform is not None:
                comp = transform(phase, dict(comp))  # (the kept composition stays as it is)
            total = sum(comp.values())
            if total > best_total:
                best, best_total = comp, total
        return {o: round(v) for o, v in best.items() if o in TENSOR_OBJECTS and round(v) > 0}

    def _candidates(self, phase: str, b: int, s: int, accumulating: bool) -> list[dict[str, float]]:
        """The phase's candidate compositions at ``(b, s)`` and the config's layer count, each moment extrapolated
        (for load and the optimizer step the one of each layer count's largest moment); computed once per shape."""
        key = (phase, b, s, accumulating)
        kept = self._evaluated.get(key)
        if kept is not None:
            return kept
        la, lb = self.layers
        k = (self.num_layers - la) / (lb - la)
        x = basis(b, s)
        candidates = (self.accum_moments if accumulating else self.moments)[phase]
        if phase in SEPARATE:
            lo, hi = (_largest(ms, x) for ms in candidates)
            comps = [{o: lo.get(o, 0.0) + k * (hi.get(o, 0.0) - lo.get(o, 0.0)) for o in set(lo) | set(hi)}]
        else:
            comps = []
            for first, second in candidates:
                comp: dict[str, float] = {}
                for obj in set(first) | set(second):
                    va = sum(c * v for c, v in zip(first.get(obj, _ZERO), x, strict=True))
                    vb = sum(c * v for c, v in zip(second.get(obj, _ZERO), x, strict=True))
                    comp[obj] = va + k * (vb - va)
                comps.append(comp)
        if len(self._evaluated) >= 1024:  # a long session's shapes: start again rather than grow
            self._evaluated.clear()
        self._evaluated[key] = comps
        return comps

    def to_json(self) -> dict[str, Any]:
        def dump(moments: dict[str, list[list[Moment]]]) -> dict[str, Any]:
            return {p: [[{o: list(c) for o, c in m.items()} for m in pair] for pair in ms]
                    for p, ms in moments.items()}

        return {"schema": FIT_SCHEMA, "model_type": self.model_type, "num_params": self.num_params,
                "num_layers": self.num_layers, "signature": self.signature, "layers": list(self.layers),
                "moments": dump(self.moments), "accum_moments": dump(self.accum_moments), "checked": self.checked,
                "calibration_s": self.calibration_s, "notes": list(self.notes), "structure": self.structure,
                **({"anchor": self.anchor} if self.anchor else {}),
                **({"stages": {str(r): f.to_json() for r, f in self.stages.items()}} if self.stages else {})}

    @staticmethod
    def from_json(data: Any) -> FitModel:
        """Read a cached fit; anything malformed raises ``ValueError`` (the caller calibrates again)."""
        if not isinstance(data, dict) or data.get("schema") != FIT_SCHEMA:
            raise ValueError("not a memcalc fit of this version")

        def load(raw: Any) -> dict[str, list[list[Moment]]]:
            return {str(p): [[{str(o): _poly(c) for o, c in m.items()} for m in pair] for pair in ms]
                    for p, ms in raw.items()}

        try:
            la, lb = (int(v) for v in data["layers"])
            return FitModel(str(data["model_type"]), int(data["num_params"]), int(data["num_layers"]),
                            dict(data["signature"]), (la, lb), load(data["moments"]), load(data["accum_moments"]),
                            {str(k): float(v) for k, v in data["checked"].items()},
                            float(data.get("calibration_s", 0.0)), tuple(str(n) for n in data.get("notes", ())),
                            {str(k): int(v) for k, v in data.get("structure", {}).items()},
                            {int(r): FitModel.from_json(f) for r, f in data.get("stages", {}).items()},
                            anchor=dict(data.get("anchor", {})))
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"malformed fit: {exc}") from None

    def check(self, shapes: Sequence[tuple[int, int]], tolerance: float) -> None:
        """Raise ``ValueError`` (one line) where this fit cannot be what a calibration made: a coefficient that is
        not finite or past 1 EiB; a moment below zero bytes, or past 1 EiB, at a calibration shape ``shapes`` and
        either traced layer count; a check error (``checked``) past ``tolerance`` or not finite; inconsistent
        structure counts; the fit evaluated at its check trace's shape off that trace's stored bytes
        (:attr:`anchor`) by more than ``tolerance``; the same for every pipeline stage. A cached fit that fails is
        damaged (``trace.fit``): a ×0.01 of the moments with the checksum recomputed still disagrees with the
        stored check trace; a ×0.01 of both together describes a smaller model consistently and is not
        detectable from the file alone."""
        if not self.model_type or not 1 <= self.num_params <= MAX_COUNT \
                or not 1 <= self.num_layers <= MAX_FIT_LAYERS_READ or not 1 <= self.layers[0] < self.layers[1] \
                or self.layers[1] > MAX_FIT_LAYERS_READ:
            raise ValueError("its model type, parameter count or layer counts are out of range")
        for name, moments in (("moments", self.moments), ("accum_moments", self.accum_moments)):
            for phase, candidates in moments.items():
                if phase not in PHASES:
                    raise ValueError(f"{name} names an unknown phase")
                _check_moments([m for group in candidates for m in group], shapes, phase)
        for key, value in self.checked.items():
            if not isinstance(value, float | int) or not math.isfinite(value) or value < 0:
                raise ValueError(f"its check error {str(key)[:40]!r} is not a finite, non-negative number")
            if key in PHASES and value > tolerance:
                raise ValueError(f"its {key} check error {value:.2%} is past the {tolerance:.1%} a fit may show")
        if not math.isfinite(self.calibration_s) or self.calibration_s < 0:
            raise ValueError("its calibration time is not a finite, non-negative number")
        if self.structure:
            problem = structure_problem(self.structure)
            if problem is not None:
                raise ValueError(f"its structure counts are inconsistent: {problem}")
        self._check_anchor(tolerance)
        for stage in self.stages.values():
            stage.check(shapes, tolerance)

    def _check_anchor(self, tolerance: float) -> None:
        """The fit at its check trace's shape and layer count against that trace's stored bytes (:meth:`check`)."""
        a = self.anchor
        ints = [a.get(k) for k in ("layers", "batch", "seq")]
        stored = a.get("bytes")
        if any(type(v) is not int or not 1 <= v <= MAX_FIT_LAYERS_READ for v in ints) \
                or not isinstance(stored, dict) or set(stored) != set(PHASES) \
                or any(type(v) is not int or not 0 <= v <= MAX_SIZE_BYTES for v in stored.values()):
            raise ValueError("it holds no check trace's bytes (or malformed ones)")
        layers, b, s = (int(v) for v in ints if isinstance(v, int))
        at_check = dataclasses.replace(self, num_layers=layers, stages={})
        for phase in PHASES:
            got = sum(at_check.peak(phase, b, s, accumulating=True).values())
            want = stored[phase]
            if abs(got - want) > tolerance * want + 1:
                raise ValueError(f"its {phase} moments give {got:,} bytes where its check trace measured {want:,} "
                                 f"(more than {tolerance:.1%} apart)")


_ZERO: Poly = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
#: Phases whose candidates are kept per layer count (their ops repeat per parameter, not per layer).
SEPARATE = ("load", "optimizer_step")


def _check_moments(moments: list[Moment], shapes: Sequence[tuple[int, int]], phase: str) -> None:
    """:meth:`FitModel.check` of a phase's moments: finite coefficients within 1 EiB, every object's bytes at least
    zero (up to a byte of rounding) and each moment's total within 1 EiB at each calibration shape. Each distinct
    polynomial is evaluated once (moments share most of theirs): a 50 KB fit checks in a few milliseconds."""
    xs = [basis(b, s) for b, s in shapes]
    values: dict[tuple[float, ...], list[float]] = {}
    for moment in moments:
        totals = [0.0] * len(xs)
        for poly in moment.values():
            found = values.get(poly)
            if found is None:
                size = sum(map(abs, poly))  # NaN or infinity stays so
                if not math.isfinite(size) or max(map(abs, poly)) > MAX_SIZE_BYTES:
                    raise ValueError(f"a {phase} moment holds a coefficient that is not finite or past 1 EiB")
                found = values[poly] = [sum(map(operator.mul, poly, x)) for x in xs]
                low = min(found)
                if low < -1.0:
                    b, s = shapes[found.index(low)]
                    raise ValueError(f"a {phase} moment is negative ({low:,.0f} bytes) at micro-batch {b} × {s}")
            for k, v in enumerate(found):
                totals[k] += v
        if max(totals, default=0.0) > MAX_SIZE_BYTES:
            raise ValueError(f"a {phase} moment is past 1 EiB at a calibration shape")


def _largest(moments: list[Moment], x: tuple[int, ...]) -> dict[str, float]:
    best: dict[str, float] = {}
    best_total = -1.0
    for moment in moments:
        comp = {o: sum(c * v for c, v in zip(poly, x, strict=True)) for o, poly in moment.items()}
        total = sum(comp.values())
        if total > best_total:
            best, best_total = comp, total
    return best


def _poly(values: Any) -> Poly:
    if not isinstance(values, list) or len(values) != len(BASIS) or any(type(v) not in (int, float) for v in values):
        raise ValueError("a moment needs six numbers")
    a, b, c, d, e, f = (float(v) for v in values)
    return a, b, c, d, e, f


def kept_layers(checkpointing: str, layers: int, in_flight: int = 1) -> int:
    """Of ``layers`` decoder layers run by each of ``in_flight`` micro-batches, how many keep their activations at
    the backward peak: every layer of every micro-batch without checkpointing (and with selective checkpointing,
    which recomputes attention, not the MLP's inputs); with full checkpointing only the layer recomputed for the
    micro-batch in backward; with ``every:N`` the layers not checkpointed of every micro-batch and that one."""
    every = None if checkpointing == "selective" else checkpoint_every(checkpointing)
    if every is None:
        return layers * in_flight
    return (layers - layers // every) * in_flight + min(1, layers)


def per_gpu_states(setup: TrainingSetup, fit: FitModel, traced_rank: bool = False,
                   in_flight: int = 1) -> tuple[Transform, ModelStates]:
    """The strategy's per-GPU model states for a fitted model, and the transform that puts them into each traced
    moment (the activations and temporaries of one micro-batch stay as traced). ``traced_rank``: the moments are
    those of a traced rank of the layout (:func:`rank_layout`), whose all-to-all buffers are traced where they live.

    The single-GPU optimizer state, step temporaries and autocast copies are read off the fit itself; the unit
    sizes (largest decoder layer, largest module, root unit) come from the full-size model on the meta device.
    Rules as ``distributed.model_states`` (DeepSpeed's and FSDP's sharding) and ``analytic.per_gpu_ledger``; context
    parallelism shards the states over the data- and context-parallel GPUs together (``core.context``)."""
    par = dataclasses.replace(setup.parallel, cp=1)  # the same GPUs: dp × cp of them share the states
    st = fit.structure
    if not all(k in st for k in STRUCTURE_KEYS):
        raise InputError("method", "this fit predates per-GPU budgets: calibrate again")
    if setup.tuning.method != "full":
        raise InputError("tuning", "a per-GPU budget of a fitted model covers full fine-tuning (the trace runs one "
                                   "replica of the adapters)")
    step = fit.peak("optimizer_step", 1, 1)
    load = sum(fit.peak("load", 1, 1).values())
    forward = fit.peak("forward", 1, 1)
    copies = max(0, forward.get("parameters", 0) - load) if setup.precision == "mixed" else 0
    state, temps = step.get("optimizer_state", 0), step.get("optimizer_temporaries", 0)
    if _bf16_fit(setup, fit) and setup.optimizer in STATE_IN_PARAM_DTYPE:  # the fp32 shards' state, not bf16's
        state, temps = 2 * state, 2 * temps
    traced_grads = step.get("gradients", 0)  # every gradient, at the step
    buffers = gathered = 0
    if par.expert_split > 1 or (par.strategy == "fsdp2" and st["num_experts"]):
        check_experts(fit.model_type, st["num_experts"], par.ep, par.etp)
        check_expert_placement(par, st["num_experts"], st.get("expert_dim1_gcd", 0))  # 0: a fit's older counts
        zero3 = par.strategy == "zero3"
        states = expert_parallel_states(
            par, st["num_params"], st["expert_params"],
            st["largest_dense_module"] if zero3 else st["layer_params"] - st["layer_expert_params"],
            st["largest_expert_module"] if zero3 else st["layer_expert_params"], setup.precision, state, temps,
            copies, st["root_unit"], st["num_experts"])
        # the all-to-all dispatch and combine buffers of one MoE layer: every token's top-k hidden states out and
        # back, balanced routing (transformers', torchtitan's and Megatron-LM's token dispatchers); beside tensor
        # parallelism each GPU of the group sends its share of the tokens (transformers' plan), with context
        # parallelism each GPU its share of every sequence
        a_bytes = 4 if setup.precision == "fp32" else 2
        routed = -(-setup.batch * (setup.seq // setup.parallel.cp) // par.tp) * st["top_k"] * st["hidden_size"]
        if par.ep > 1 and not traced_rank:
            buffers = 2 * routed * a_bytes
        # Megatron-LM's expert tensor parallelism gathers the tokens of its etp GPUs before each expert's slice
        # (MoEAlltoAllTokenDispatcher's all-gather): the dispatch buffers, and the experts' inputs each MoE layer
        # keeps for backward, hold etp times the GPU's share (the traced step holds its own share once)
        buffers += 2 * routed * a_bytes * (par.etp - 1)
        moe_layers = st["expert_params"] // max(1, st["layer_expert_params"]) // setup.parallel.virtual_stages
        gathered = (par.etp - 1) * routed * a_bytes * kept_layers(setup.checkpointing, moe_layers, in_flight)
        if par.etp > 1:
            states = dataclasses.replace(states, notes=(*states.notes, (
                f"Megatron-LM's expert tensor parallelism gathers the tokens of its {par.etp} GPUs before each "
                "expert's slice: the experts' inputs each kept MoE layer saves for backward and the dispatch buffers "
                f"hold {par.etp} times the GPU's share (added to the traced step); the slices' own activations "
                f"({par.etp} times the tokens, 1/{par.etp} of the width) weigh as the traced step's")))
    else:
        unit = st["largest_module"] if par.strategy == "zero3" else st["layer_params"]
        states = model_states(par, st["num_params"], unit, setup.precision, state, temps, copies, st["root_unit"])
    keep = (st["num_params"] - st["expert_params"] + st["expert_params"] // par.ep) / st["num_params"]

    def transform(phase: str, comp: dict[str, float]) -> dict[str, float]:
        out = dict(comp)
        if phase in ("forward", "backward") and buffers:
            out["temporaries"] = out.get("temporaries", 0.0) + buffers
        if phase in ("forward", "backward") and gathered:
            out["activations"] = out.get("activations", 0.0) + gathered
        if par.strategy == "ddp":  # replicated: the traced states (the experts' share of them with EP) + buckets
            for obj in ("gradients", "optimizer_state", "optimizer_temporaries"):
                if obj in out:
                    out[obj] *= keep
            if "parameters" in out:
                # the weights split; autocast's bf16 copies live at this moment are of the dense matrices (the
                # experts' kernel casts as it goes; traced), which every rank keeps whole
                out["parameters"] = load * keep + max(0.0, out["parameters"] - load)
            out["gradients"] = out.get("gradients", 0.0) + states.gradients["forward"]  # DDP's buckets (from load)
            return out
        if phase == "load":  # the weights, and what the strategy holds of gradients from the start (Megatron-LM's
            # fp32 main-grad buffer)
            return {"parameters": float(states.parameters["load"]),
                    **({"gradients": float(states.gradients["load"])} if states.gradients.get("load") else {})}
        out["parameters"] = float(states.parameters[phase])
        out["gradients"] = float(states.gradients[phase])
        if par.strategy == "fsdp2" and phase in ("forward", "backward") and traced_grads:
            # FSDP2 reduce-scatters each unit's gradients as its backward ends: at this moment the shards of the
            # gradients the trace holds so far, plus one unit's unsharded gradients while the backward is under way
            done = min(1.0, comp.get("gradients", 0.0) / traced_grads)
            final = states.gradients["optimizer_step"]
            unit = max(0, states.gradients["backward"] - final)
            out["gradients"] = done * final + (unit if 0 < done < 1 else 0)
        out["optimizer_state"] = float(states.optimizer_state)
        if phase == "optimizer_step":
            out["optimizer_temporaries"] = float(states.optimizer_temporaries)
        return out

    return transform, states


def _bf16_fit(setup: TrainingSetup, fit: FitModel) -> bool:
    return setup.precision == "mixed" and fit.signature.get("precision") == "bf16"


def _autocast_stand_in(setup: TrainingSetup, fit: FitModel) -> bool:
    """``fit`` is the autocast calibration of a setup whose strategy computes in bf16: it stands in, as an upper
    bound (autocast keeps fp32 activations the bf16 step does not), until the bf16 step is calibrated."""
    return bf16_compute(setup) and fit.signature == {**signature(setup), "precision": "mixed"}


def estimate_fitted(setup: TrainingSetup, fit: FitModel) -> Estimate:
    """The ledger of ``setup`` from ``fit`` (a calibration of the same config and signature); per GPU under a
    data-parallel strategy (:func:`per_gpu_states`)."""
    stand_in = _autocast_stand_in(setup, fit)
    if signature(setup) != fit.signature and not stand_in:
        raise InputError("method", "this change needs its own calibration (a few seconds of tracing)")
    transform: Transform | None = None
    parallel_notes: tuple[str, ...] = ()
    if stand_in:
        parallel_notes = ("An upper bound: the autocast step's calibration stands in for the bf16 step this strategy "
                          "runs, until that is calibrated",)
    if setup.parallel.pp > 1:
        return _pipeline_fitted(setup, fit)
    ranked = fit.rank is not None and fit.rank.signature == rank_signature(setup)
    if ranked and setup.parallel.strategy in ("fsdp2", "ddp"):
        assert fit.rank is not None
        return _rank_fitted(setup, fit.rank)
    # a strategy not traced (ZeRO, FSDP1, Megatron-LM's) beside expert and tensor parallelism: the activations of the
    # layout's traced rank (replicated, as DDP's), its model states by the strategy's rule
    source = fit.rank if ranked and fit.rank is not None else fit
    cp = setup.parallel.cp
    # a traced rank's fit is of the whole sequence (the rank runs its seq/cp tokens); one replica stands for a rank of
    # the ring at seq/cp tokens
    seq = setup.seq if ranked or cp == 1 else setup.seq // cp
    host_bytes = 0
    if setup.parallel.is_distributed:
        transform, states = per_gpu_states(setup, fit, traced_rank=ranked)
        parallel_notes, host_bytes = parallel_notes + states.notes, states.host_bytes
        if ranked:
            tp = setup.parallel.tp
            plans = ((f"transformers' tensor-parallel plan over {tp} GPUs, " if tp > 1 else "")
                     + f"PyTorch's ring attention over {cp} context-parallel GPUs, each its {setup.seq // cp:,} tokens "
                     "of every sequence" if cp > 1 else
                     "transformers' tensor- and expert-parallel plans, balanced routing")
            parallel_notes += (f"The activations and temporaries of one traced rank of the layout ({plans}, on the "
                               "fake process group), the model states laid over them by the strategy's rule",)
        elif cp > 1:
            parallel_notes += (f"Context parallelism over {cp} GPUs: one replica's step at {seq:,} tokens of each "
                               "sequence stands for a rank of the ring, an approximation: it leaves out the key/value "
                               "chunks ring attention gathers (on toy models up to 4.5 % under with DDP, up to 20 % "
                               "off with FSDP2's rule for the units it gathers). "
                               + ("The traced rank's fit replaces it once calibrated" if rank_layout(setup) is not None
                                  else f"A rank of this layout is not traced ({_context_untraced(setup)})"),)
        elif setup.parallel.ep > 1:
            parallel_notes += ("Expert parallelism assumes balanced routing: every GPU's experts get their share of "
                               "the tokens. One MoE layer's all-to-all dispatch and combine buffers (tokens × top-k "
                               "× hidden, each way) are counted at the peaks, a small bound: traced, they live "
                               "inside the layer",)
            if setup.parallel.tp > 1:
                parallel_notes += (f"Beside tensor parallelism the experts' activations are a bound: the one-replica "
                                   f"trace runs every token through them, where each of the {setup.parallel.tp} "
                                   "tensor-parallel GPUs runs its share (transformers' plan). "
                                   + ("The traced rank's fit replaces it once calibrated"
                                      if rank_layout(setup) is not None else
                                      "--method trace runs the rank itself"),)
    # sequence parallelism beside a family without a block model is the traced rank's alone: the one-replica rule
    # keeps a tensor-parallel rank's norms and residual stream whole, more than the rank holds
    sp_bound = setup.parallel.sp and not ranked
    if sp_bound:
        parallel_notes += ("An upper bound: sequence parallelism is not in this rule (one replica of a "
                           "tensor-parallel rank, its norms and residual stream whole). "
                           + ("The traced rank's fit replaces it once calibrated" if rank_layout(setup) is not None
                              else "No rank of this layout is traced for the fit"
                              + ("; the analytic method models it" if setup.model is not None else "")),)
    phases = {}
    for phase in PHASES:
        objects = source.peak(phase, setup.batch, seq, setup.grad_accum > 1, transform)
        if phase == "load":  # the model, and DDP's buckets made as it wraps the model
            objects = _resident(objects)
        phases[phase] = with_overheads(objects, phase, setup)
    worst = max((v for k, v in source.checked.items() if k in PHASES), default=0.0)
    assumptions = (
        f"Fitted from fake-tensor traces of the real {fit.model_type} model (transformers) at "
        f"{' and '.join(str(k) for k in fit.layers)} layers: every moment's live bytes as "
        f"{' + '.join(BASIS)} terms per object, the layers extrapolated to {fit.num_layers}; checked on a further "
        f"trace within {worst:.2%}",
        *fit.notes,
        *parallel_notes,
        *_overheads_said(setup),
    )
    return Estimate(setup=setup, method="fitted", phases=phases, assumptions=assumptions,
                    details={"host_bytes": host_bytes, "fit_checked": dict(fit.checked),
                             "upper_bound": stand_in or sp_bound,
                             "parallel_notes": parallel_notes})


def _context_untraced(setup: TrainingSetup) -> str:
    """Why no rank of ``setup``'s context-parallel layout is traced for its fit (:func:`rank_layout`)."""
    par = setup.parallel
    if par.cp not in CONTEXT_DEGREES:
        return (f"the calibration's sequences split into 2·cp chunks for cp {', '.join(map(str, CONTEXT_DEGREES))}, "
                f"not {par.cp}")
    return "the traced rank runs without offload, sequence or loss parallelism, adapters or pipeline stages"


def _ddp_buckets(setup: TrainingSetup, fit: FitModel) -> float:
    """DDP's buckets beside a traced rank (which does not run DDP): every gradient once more, from the moment DDP
    wraps the model, of what has replicas to reduce with; the routed experts' share (whole, 1/ep of them: the rank's
    weights at load tell the rest) only where other GPUs hold the same ones (distributed.expert_parallel_states)."""
    par = setup.parallel
    grads = fit.peak("optimizer_step", 1, 1).get("gradients", 0)
    weights = sum(fit.peak("load", 1, 1).values())
    per_param = precision_bytes(setup)[0]  # the weights' bytes
    experts = min(1.0, fit.structure.get("expert_params", 0) // par.ep * per_param / weights) if weights else 0.0
    replicas = par.dp * par.cp  # the context-parallel ranks reduce their gradients with the data-parallel ones
    copies = replicas * par.tp // par.ep
    return grads * ((1 - experts) * (replicas > 1) + experts * (copies > 1))


def _rank_fitted(setup: TrainingSetup, fit: FitModel) -> Estimate:
    """The ledger of one rank of ``setup``'s FSDP2 or DDP layout from its own fit (:func:`rank_layout`): the moments
    as traced, nothing laid out by rule but DDP's buckets."""
    par = setup.parallel
    # one replica (every GPU tensor-parallel): no DDP to wrap the model, as torchtitan runs it
    buckets = _ddp_buckets(setup, fit) if par.strategy == "ddp" and not one_replica_sequence_parallel(par) else 0

    def with_buckets(_phase: str, comp: dict[str, float]) -> dict[str, float]:
        return {**comp, "gradients": comp.get("gradients", 0.0) + buckets}

    phases = {}
    for phase in PHASES:
        objects = fit.peak(phase, setup.batch, setup.seq, setup.grad_accum > 1, with_buckets if buckets else None)
        phases[phase] = with_overheads(_resident(objects) if phase == "load" else objects, phase, setup)
    worst = max((v for k, v in fit.checked.items() if k in PHASES), default=0.0)
    sharded = par.dp * par.cp > 1 and par.strategy == "fsdp2"
    ddp = ("One replica: every GPU tensor-parallel, no data-parallel GPUs for DDP to reduce over (torchtitan applies "
           "no FSDP there either, and no DDP buckets are added); one rank traced on the fake process group"
           if one_replica_sequence_parallel(par) else
           f"DDP over {par.dp * par.cp} {'data- and context-parallel ranks' if par.cp > 1 else 'replicas'}, one rank "
           "traced on the fake process group; DDP's buckets (every gradient once more) added by its rule"
           if par.strategy == "ddp" else "")
    fsdp2 = (f"FSDP2 as PyTorch runs it: fully_shard over {par.fsdp2_ranks} data-"
             f"{' and context-' if par.cp > 1 else ''}parallel GPUs{par.hybrid_text} (each decoder layer a unit, "
             "the root the rest; torchtitan's wrapping) on the fake process group"
             + ("" if par.reshard_after_forward else ", not resharded after forward")
             if sharded else "One data-parallel GPU: FSDP2 has nothing to shard and is not applied (as torchtitan "
                             "skips it); one rank traced on the fake process group")
    notes = ((ddp or fsdp2)
             + (f", each layer split over {par.tp} tensor-parallel GPUs by transformers' plan" if par.tp > 1 else "")
             + (" with torchtitan's sequence-parallel plan on top (the norms on the rank's "
                f"{setup.seq // par.cp // par.tp:,} tokens, attention and the MLP or experts gathering them)"
                if par.sp else "")
             + (f", each sequence split over {par.cp} context-parallel GPUs (PyTorch's ring attention, the rank's "
                f"{setup.seq // par.cp:,} tokens)" if par.cp > 1 else "")
             + (f", the routed experts split over {par.ep} GPUs (transformers' expert-parallel plan and all-to-all, "
                "balanced routing: every GPU's experts get their share of the tokens"
                + (", each expert whole and each GPU of a tensor-parallel group sending its share of the group's "
                   "tokens" if par.tp > 1 else "") + ")" if par.ep > 1 else "")
             + ((", mixed precision as its MixedPrecisionPolicy (bf16 compute over fp32 shards)" if sharded
                 else ", mixed precision as autocast") if setup.precision == "mixed" else "")
             + ("; gradients reduce-scattered every micro-batch (torchtitan's way)"
                if setup.grad_accum > 1 and sharded else ""),)
    assumptions = (
        f"Fitted from fake-tensor traces of one rank of the real {fit.model_type} model (transformers) at "
        f"{' and '.join(str(k) for k in fit.layers)} layers: every moment's live bytes as {' + '.join(BASIS)} terms "
        f"per object, the layers extrapolated to {fit.num_layers}; checked on a further trace within {worst:.2%}",
        *fit.notes, *notes,
        *_overheads_said(setup),
    )
    return Estimate(setup=setup, method="fitted", phases=phases, assumptions=assumptions,
                    details={"host_bytes": 0, "fit_checked": dict(fit.checked), "parallel_notes": notes,
                             "rank_fit": True})


def _overheads_said(setup: TrainingSetup) -> tuple[str, str]:
    """What every fitted ledger's assumptions say of what the traces leave out and the overheads added."""
    return ("CUDA's 512-byte rounding of each allocation is not included (well under 0.1 % at training sizes)",
            f"CUDA context {setup.cuda_context_bytes / 2**20:.0f} MiB and allocator reserve "
            f"{setup.allocator_reserve:.0%}")


def _resident(objects: dict[str, int]) -> dict[str, int]:
    """The load phase's objects: what stays resident counts as parameters, but for the gradients the strategy
    holds from the start (DDP's buckets, Megatron-LM's main-grad buffer)."""
    grads = objects.get("gradients", 0)
    return {"parameters": sum(objects.values()) - grads, **({"gradients": grads} if grads else {})}


def _pipeline_fitted(setup: TrainingSetup, fit: FitModel) -> Estimate:
    """The most loaded checked pipeline rank, each from its own fit (:attr:`FitModel.stages`): the rank's step under
    the schedule as traced (FSDP2's sharding in it), with DDP's buckets (every gradient of the stage once more, from
    the moment DDP wraps it) where the stage has data-parallel replicas. ``details["pipeline_ranks"]`` as
    ``core.pipeline.pipeline_estimate`` gives them."""
    from .pipeline import in_flight

    par = setup.parallel
    if not fit.stages:
        raise InputError("method", "this change needs its own calibration (a few seconds of tracing)")
    rows: list[dict[str, Any]] = []
    best: tuple[int, int, dict[str, Any]] | None = None
    traced = pipeline_microbatches(setup)
    by_rule = par.strategy not in TRACED_PIPELINE_STRATEGIES
    rule_notes: tuple[str, ...] = ()
    for rank, stage in sorted(fit.stages.items()):
        buckets = stage.peak("optimizer_step", 1, 1).get("gradients", 0) \
            if par.strategy == "ddp" and par.dp > 1 else 0
        untraced = _untraced_microbatches(setup, fit, rank, traced)
        states: Transform | None = None
        flight = in_flight(par.schedule, par.pp, rank, setup.grad_accum, par.virtual_stages)
        if by_rule:  # the stage's per-GPU model states by the strategy's rule, as for a whole model on one GPU
            states, laid_out = per_gpu_states(setup, dataclasses.replace(
                stage, structure=_stage_structure(setup, fit, stage)), in_flight=flight)
            rule_notes = laid_out.notes

        def transform(phase: str, comp: dict[str, float], extra: int = buckets, more: dict[str, int] = untraced,
                      rule: Transform | None = states) -> dict[str, float]:
            out = rule(phase, comp) if rule is not None else \
                {**comp, "gradients": comp.get("gradients", 0.0) + extra}
            if phase != "load":
                for obj, nbytes in more.items():
                    out[obj] = out.get(obj, 0.0) + nbytes
            return out

        phases = {}
        for phase in PHASES:
            objects = stage.peak(phase, setup.batch, setup.seq, True, transform)
            if phase == "load":  # the stage's weights, and DDP's buckets made as it wraps the stage
                objects = _resident(objects)
            phases[phase] = with_overheads(objects, phase, setup)
        peak = max(ph.total_bytes for ph in phases.values())
        rows.append({"rank": rank, "in_flight": flight,
                     "peak_bytes": peak, "phases": {p: ph.total_bytes for p, ph in phases.items()},
                     "tensor_bytes": {p: ph.tensor_bytes for p, ph in phases.items()}})
        if best is None or peak > best[1]:
            best = (rank, peak, {"phases": phases, "checked": stage.checked, "buckets": buckets})
    assert best is not None
    rank, _, chosen = best
    worst = max((v for f in fit.stages.values() for k, v in f.checked.items() if k in PHASES), default=0.0)
    layers = fit.stages[rank].layers
    notes = (f"Pipeline rank {rank + 1} of {par.pp} (ranks {', '.join(str(r + 1) for r in sorted(fit.stages))} "
             f"checked): PyTorch's {par.schedule} schedule over {traced} of the {setup.grad_accum:,} micro-batch(es) "
             "traced on the fake process group"
             + (" (1F1B repeats after pp + 1)" if traced < setup.grad_accum else "")
             + (f", each stage fully_shard-ed over its {par.fsdp2_ranks} data- and context-parallel GPUs (FSDP2)"
                f"{par.hybrid_text}, each sequence split over {par.cp} of them (PyTorch's ring attention, the rank's "
                f"{setup.seq // par.cp:,} tokens)" if par.strategy == "fsdp2" and par.cp > 1
                else f", each stage fully_shard-ed over its {par.fsdp2_ranks} data-parallel GPUs (FSDP2)"
                f"{par.hybrid_text}"
                if par.strategy == "fsdp2"
                else f", one replica of each stage traced and its model states laid out over its {par.dp} "
                     "data-parallel GPUs by the strategy's rule" if by_rule
                else f", each stage over its {par.dp} data-parallel GPUs" if par.ep > 1 else "")
             + (f", the routed experts split over {par.ep} of them (transformers' expert-parallel plan and all-to-all, "
                "balanced routing)" if par.ep > 1 and not by_rule else "")
             + (f", each stage's layers split over {par.tp} tensor-parallel GPUs by transformers' plan with "
                f"torchtitan's sequence-parallel plan on top (the stages send the rank's {setup.seq // par.tp:,} "
                "tokens)" if par.sp else "")
             + "; the embedding on the first stage, the final norm, the head and the loss on the last",
             *(("DDP keeps every gradient of the stage once more in its communication buckets "
                "(gradient_as_bucket_view=False, the default)",) if chosen["buckets"] else ()),
             *rule_notes)
    assumptions = (
        f"Fitted from fake-tensor traces of the real {fit.model_type} model (transformers) cut into pipeline stages "
        f"of {' and '.join(str(k) for k in layers)} layers: every moment's live bytes as {' + '.join(BASIS)} terms "
        f"per object, the layers extrapolated to {fit.stages[rank].num_layers} a stage"
        + (" chunk" if par.virtual_stages > 1 else "") + f"; checked on a further trace within {worst:.2%}",
        *fit.notes, *notes,
        *_overheads_said(setup),
    )
    return Estimate(setup=setup, method="fitted", phases=chosen["phases"], assumptions=assumptions,
                    details={"host_bytes": 0, "fit_checked": dict(chosen["checked"]), "parallel_notes": notes,
                             "pipeline_ranks": rows, "pipeline_rank": rank})


def _stage_structure(setup: TrainingSetup, fit: FitModel, stage: FitModel) -> dict[str, int]:
    """The counts :func:`per_gpu_states` lays a pipeline rank's model states out by: the whole model's per-layer
    counts, with the rank's own parameters (its traced weights, at the stage's depth), its layers' routed experts and
    what it holds besides its layers (the embedding on the first stage, the final norm and the head on the last) as
    its root unit."""
    st = dict(fit.structure)
    width = 2 if stage.signature.get("precision") in ("bf16", "bf16-autocast") else 4
    params = round(sum(stage.peak("load", 1, 1).values()) / width)
    layers = stage.num_layers * setup.parallel.virtual_stages
    st.update(num_params=params, expert_params=layers * st["layer_expert_params"],
              root_unit=max(0, params - layers * st["layer_params"]))
    return st


def _untraced_microbatches(setup: TrainingSetup, fit: FitModel, rank: int, traced: int) -> dict[str, int]:
    """What the micro-batches a 1F1B rank's traces leave out (:func:`pipeline_microbatches`) add at every moment
    after load: ``torch.distributed.pipelining`` makes one receive buffer per micro-batch at the first step and
    keeps it (the activations a later stage receives, the gradients an earlier one receives, one hidden state each),
    every rank holds the whole batch's token ids (as torchtitan's loop loads the batch on every rank; the first stage
    reads them as inputs, the last as targets), and the last stage keeps each micro-batch's loss. Traced: each
    micro-batch more adds exactly these bytes."""
    par = setup.parallel
    extra = setup.grad_accum - traced
    if extra <= 0:
        return {}
    first, last = rank == 0, rank == par.pp - 1
    half = setup.precision in ("bf16", "bf16-autocast") or (setup.precision == "mixed" and par.strategy in BF16_COMPUTE)
    seq = setup.seq // par.cp  # a context-parallel stage sends, receives and reads its share of each sequence
    # under sequence parallelism a stage sends and receives its rank's seq/tp tokens of the hidden states
    hidden = setup.batch * (seq // par.tp if par.sp else seq) * fit.structure.get("hidden_size", 0) * (2 if half else 4)
    out = {"temporaries": extra * hidden * ((not first) + (not last)),
           "inputs": extra * setup.batch * seq * 8,
           "activations": extra * 4 * last}
    return {k: v for k, v in out.items() if v}


def evaluate_fitted(setup: TrainingSetup, fit: FitModel,
                    more: Callable[[TrainingSetup], FitModel | None] | None = None) -> Result:
    """Estimate and verdict from ``fit``. What-ifs that change only the shape or the GPU layout use ``fit``; those
    that change the calibration's signature (precision, checkpointing, the optimizer…) use the fit ``more`` returns
    for them, and are left out of the suggestions where it returns ``None``."""
    setup.extras["fitted"] = True  # sharding, offload and checkpointing what-ifs apply (core.solver.levers)
    fits = {_signature_key(fit.signature): fit}

    def estimator(s: TrainingSetup) -> Estimate:
        key = _signature_key(signature(s))
        if key not in fits and more is not None:
            found = more(s)
            if found is not None:
                fits[key] = found
        return estimate_fitted(s, fits.get(key, fit))

    est = estimator(setup)
    plan = gpu_plan(setup, estimator) if setup.parallel.is_distributed else None
    return Result(est, solve(setup, estimator, est), plan)


def worth_calibrating(base: dict[str, Any], changed: TrainingSetup) -> bool:
    """Whether a what-if's own calibration is worth its seconds: it changes only checkpointing (the lever that
    matters most when activations do not fit; under pipeline parallelism full checkpointing only) or the traced
    precision (a strategy that computes in bf16)."""
    other = signature(changed)
    if "pipeline" in base and other["checkpointing"] not in ("none", "full"):
        # a pipeline calibration traces each checked rank's schedule (tens of seconds for a large mixture of
        # experts): of the checkpointing what-ifs only full checkpointing, the one that saves most
        return False
    return all(other[k] == base.get(k) for k in other if k not in ("checkpointing", "precision")) and \
        sum(other[k] != base.get(k) for k in ("checkpointing", "precision")) == 1


def _signature_key(sig: dict[str, Any]) -> str:
    return repr(sorted(sig.items()))


def search_layouts(setup: TrainingSetup, fit: FitModel, fit_for: Callable[[TrainingSetup], FitModel | None],
                   min_gpus_for: int = MIN_GPUS_FOR, config: dict[str, Any] | None = None) -> Search:
    """The layout search (:func:`memcalc_gui.core.layouts.search`) of a family without a block model: each layout's
    ledger from the fit ``fit_for`` gives for its signature (the one-replica fit, its states by rule; a cached FSDP2
    rank fit where it has one; a pipeline layout's own calibration of its schedule), ``fit`` (a one-replica fit of
    ``setup``'s config, ``config``) its shape. A layout ``fit_for`` has no fit for (``None``: a tensor-parallel degree
    or a pipeline layout not calibrated) is left out and counted, never guessed; a strategy that computes in bf16
    without its own calibration is bounded by the autocast one, as in the ledger (without pipeline stages: a stage's
    fit is of its strategy's own schedule). Pipeline stages are searched under :data:`PIPELINE_STRATEGIES` where a
    stage's fit can stand for it (not a config whose first layers are dense, nor checkpointing every N-th layer:
    ``trace.fit.pipeline_chunk_layers``). Sequence parallelism (torchtitan's plan, where :func:`rank_layout` traces
    it) is weighed from its rank's own fit alone, each layout a calibration of its own as a pipeline layout is."""
    st = fit.structure
    staged = not (config is not None and dense_prefix_layers(config)) and \
        checkpoint_every(setup.checkpointing) in (None, 1)
    pipe = fit.signature.get("pipeline")  # a pipeline fit's layers are one stage-chunk's
    layers = fit.num_layers * (int(pipe["pp"]) * int(pipe["virtual"]) if isinstance(pipe, dict) else 1)
    shape = ModelShape(fit.num_params, int(st.get("hidden_size", 0)), layers,
                       int(st.get("num_experts", 0)), block_model=False, expert_params=int(st.get("expert_params", 0)),
                       top_k=int(st.get("top_k", 0)), active_params=int(st.get("active_params", 0)),
                       pipeline_strategies=PIPELINE_STRATEGIES if staged else (), rank_sequence_parallel=True)

    def estimator(s: TrainingSetup) -> Estimate:
        found = fit_for(s)
        if s.parallel.sp and s.parallel.pp == 1 and (found is None or found.rank is None
                                                     or found.rank.signature != rank_signature(s)):
            # the one-replica rule only bounds sequence parallelism (norms and residual stream whole): weighed from
            # its traced rank alone, never as a bound beside the layout without it
            raise InputError("method", f"sequence parallelism over {s.parallel.tp} GPUs {NOT_CALIBRATED}")
        if found is None and s.parallel.pp == 1:
            # the autocast step stands in for the bf16 one, as a bound (estimate_fitted says so)
            # (each expert whole: the fits are of etp 1, which only Megatron-LM's strategies split further)
            found = fit_for(s.with_changes(parallel=dataclasses.replace(s.parallel, strategy="ddp", etp=1))) \
                if bf16_compute(s) else None
        if found is None:
            what = f"a layout of {s.parallel.pp} pipeline stages" if s.parallel.pp > 1 else \
                f"tensor parallelism over {s.parallel.tp} GPUs" if s.parallel.tp > 1 else "this layout"
            raise InputError("method", f"{what} {NOT_CALIBRATED}")
        return estimate_fitted(s, found)

    return search(setup, estimator, min_gpus_for=min_gpus_for, shape=shape)
