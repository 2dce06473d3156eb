"""Method ``trace``: run the real training step on fake tensors and read its exact tensor ledger.

The model is built from its config with transformers under ``FakeTensorMode`` on device "cpu" (not the
meta device, which changes the attention kernel), in the target dtype, with the setup's attention
implementation, the setup's ``use_cache``, checkpointing and optimizer implementation. Two iterations of
forward, backward and step run under the live-storage tracker: nothing is allocated or computed, so a
70B model traces on a laptop. The CUDA rules a CPU trace cannot see are applied on top and listed:
512-byte rounding of every allocation, the CUDA context and the allocator reserve.

torch and transformers are imported inside functions only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .. import install_hint
from ..core.analytic import per_gpu_ledger, states_for
from ..core.configfile import transformers_kwargs
from ..core.distributed import BF16_COMPUTE, check_experts, expert_parallel_states, model_states
from ..core.errors import InputError, MemcalcError, one_line
from ..core.estimate import estimate
from ..core.layout import tensor_parallel_spec
from ..core.layouts import stage_group_runs
from ..core.ledger import Estimate, with_overheads
from ..core.optimizer import optimizer_cost
from ..core.pipeline import ranks_to_check, stage_spec
from ..core.result import Result
from ..core.setup import TrainingSetup, one_replica_sequence_parallel
from ..core.solver import Verdict, gpu_plan, solve
from ..core.timeline import Timeline
from ..core.vocab import PHASES

#: The CUDA caching allocator rounds every block up to 512 bytes (PyTorch memory notes, NOTES.md).
CUDA_ROUNDING = 512
TOP_MODULES = 10
#: The trace builds and runs every layer: ~0.15 s per layer on a 2-core machine, so 128 layers (past every
#: published model: Llama 3.1 405B has 126) trace in about 20 s; deeper configs are refused with the reason.
MAX_TRACE_LAYERS = 128
#: Micro-batches after the second repeat its memory exactly (gradients already exist, same tensors): the trace
#: runs at most this many per iteration, so a huge accumulation count costs nothing.
TRACED_MICRO_BATCHES = 2


class TraceError(MemcalcError):
    """The trace could not run; the analytic estimate stays valid."""


class TraceCancelled(MemcalcError):
    """The user cancelled the trace."""


@dataclass
class TraceResult:
    estimate: Estimate
    modules: list[tuple[str, int]]  # activations alive at the forward peak, by module, largest first
    seconds: float
    analytic: Estimate | None = None
    rules: list[str] = field(default_factory=list)
    #: Every allocation and free of the two traced iterations (sizes rounded as the CUDA allocator rounds them).
    timeline: Timeline | None = None

    def result(self, basis: Result | None = None) -> Result:
        """The trace's ledger with a verdict; what-ifs (max micro-batch, suggestions, GPU plan) use the analytic
        method. A family without a block model has none: its what-ifs come from ``basis`` (the fitted result of
        the same setup) when given, else the verdict stands alone."""
        setup = self.estimate.setup
        if setup.model is None or self.analytic is None:  # (or a layout the analytic ledger refuses)
            cap, peak = setup.capacity_bytes, self.estimate.peak_bytes
            fits = None if cap is None else peak <= cap
            headroom = None if cap is None else cap - peak
            if basis is None:
                return Result(self.estimate, Verdict(cap, fits, headroom, None), None)
            v = basis.verdict
            return Result(self.estimate, Verdict(cap, fits, headroom, v.max_micro_batch, v.suggestions,
                                                 v.uncalibrated), basis.plan)
        plan = gpu_plan(setup, estimate) if setup.parallel.is_distributed else None
        return Result(self.estimate, solve(setup, estimate, self.estimate), plan)

    def difference_pct(self) -> dict[str, float]:
        """(trace − analytic) / analytic per phase, tensor bytes."""
        if self.analytic is None:
            return {}
        out = {}
        for p in PHASES:
            a = self.analytic.phases[p].tensor_bytes
            if a:
                out[p] = (self.estimate.phases[p].tensor_bytes - a) / a * 100
        return out


@contextlib.contextmanager
def unpacked_sequences() -> Iterator[None]:
    """Tell transformers the batch holds no packed sequences, as a real run finds from the data.

    Under fake tensors transformers cannot read ``position_ids`` and assumes packing, which materialises
    a 4D mask and turns GQA into repeated k/v copies; real steps on unpacked batches do neither.
    """
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def trace_available() -> bool:
    """PyTorch is importable (transformers too, or the built-in reference modules stand in for llama-like families)."""
    return importlib.util.find_spec("torch") is not None


def refusal(setup: TrainingSetup) -> str:
    """Why the trace does not run ``setup`` ("" when it does): what fake tensors on a CPU cannot run, said once for
    the CLI's error and the window's "not traced" note."""
    par = setup.parallel
    if par.sp and par.strategy != "fsdp2" and not (setup.model is None and one_replica_sequence_parallel(par)):
        return ("sequence parallelism is traced as PyTorch runs it, torchtitan's plan beside FSDP2 (--strategy fsdp2); "
                "beside DDP, ZeRO or Megatron-LM's optimizers it is Megatron-LM's, whose split linear inputs the "
                "formulas follow")
    if par.cp > 1 and par.pp > 1 and par.strategy != "fsdp2":
        return ("context parallelism in pipeline stages is traced as torchtitan runs it, each stage fully_shard-ed "
                "over data parallel × context parallel (--strategy fsdp2); here the formulas hold")
    if setup.tuning.method == "qlora":
        return ("the trace does not run QLoRA: transformers quantizes the base through bitsandbytes while loading "
                "real weights, which fake tensors do not have; the analytic ledger, checked against real bitsandbytes "
                "steps within 3.4 %, holds")
    if par.etp > 1:
        return ("expert tensor parallelism is Megatron-LM's: transformers keeps every expert whole, so a trace cannot "
                "split them; the fitted method lays their states out by Megatron-LM's rule")
    if (par.ep > 1 or (setup.model is None and par.is_distributed)) and (
            par.strategy not in ("ddp", "fsdp2") or par.offload != "none"):
        return ("a layout of a family without a block model, or with experts split, is traced as transformers lays "
                "it out: the model replicated (DDP) or fully_shard-ed (FSDP2), its experts and heads split as the "
                "expert- and tensor-parallel sizes say, without offload; the fitted method covers the other "
                "strategies")
    return ""


def trace_estimate(
    setup: TrainingSetup,
    config: dict[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> TraceResult:
    """The ``trace`` ledger of ``setup`` (``config`` overrides the setup's model config)."""
    if config is None:
        if setup.model is None:
            raise InputError("model", "the trace needs an architecture: a preset or a config.json")
        config = dict(setup.model.raw)
    if not trace_available():
        raise TraceError(f"the trace needs PyTorch: {install_hint()}")
    refused = refusal(setup)
    if refused:
        raise TraceError(refused)
    model_type, kwargs = transformers_kwargs(config)
    cfg = {"model_type": model_type, **kwargs}
    layers = setup.model.num_layers if setup.model is not None else _layer_count(cfg)
    if layers > MAX_TRACE_LAYERS:
        raise TraceError(f"the trace builds and runs all {layers:,} layers, which would take minutes; it traces "
                         f"at most {MAX_TRACE_LAYERS} (the analytic estimate still holds)")
    if setup.tuning.uses_adapters and importlib.util.find_spec("peft") is None:
        raise TraceError(f"tracing LoRA needs peft: {install_hint('lora')}; the analytic ledger holds")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ..measure import exclusive_torch_job
    from ..measure.cpu_step import measure_training_step

    def on_phase(phase: str, it: int, micro: int) -> None:
        if should_stop is not None and should_stop():
            raise TraceCancelled("trace cancelled")
        if progress is not None:
            progress("building the model on fake tensors" if phase == "load"
                     else f"iteration {it} of 2: {phase.replace('_', ' ')}")

    # FSDP2 under mixed precision computes in bf16 (its MixedPrecisionPolicy) over fp32 shards: trace the bf16 step,
    # and take the fp32 state the strategy shards from the optimizer's rule
    # (Megatron-LM's bf16 model likewise)
    fsdp2_mixed = setup.parallel.strategy in BF16_COMPUTE and setup.precision == "mixed"
    compute = "bf16" if fsdp2_mixed else setup.precision
    fsdp2_pipeline = setup.parallel.pp > 1 and setup.parallel.strategy == "fsdp2" \
        and setup.parallel.dp * setup.parallel.cp > 1
    sharded_rank = fsdp2_rank(setup)
    t0 = time.perf_counter()
    try:
        # packed documents: under fake tensors transformers takes the batch as packed, as a real run finds it
        sequences = contextlib.nullcontext() if setup.packing else unpacked_sequences()
        step: Any = measure_training_step
        par = setup.parallel
        pipe_rank = 0
        pipe_ranks: tuple[int, ...] = (0,)
        if par.pp > 1:  # the most loaded pipeline rank, run by PyTorch's schedule on the fake process group
            from .pipeline import PipeRank, trace_pipeline_rank

            guided = setup.model is not None and not analytic_refusal(setup)
            if guided:
                pipe_rank = int(estimate(setup).details.get("pipeline_rank", 0))
            if fsdp2_pipeline:  # each stage fully_shard-ed over its data- (and context-) parallel ranks, in the trace
                compute = setup.precision
            # interleaved under FSDP2 the ranks the ledger checks can be closer to each other than its accuracy
            # (each chunk's units are gathered and resharded on their own): they are all traced, and the most loaded
            # one reported; so are a family's without a block model (no ledger to pick one)
            unguided = (fsdp2_pipeline and par.virtual_stages > 1) or not guided
            pipe_ranks = ranks_to_check(par.pp) if unguided else (pipe_rank,)

            # the stage's tensor-parallel group run for real: torchtitan's sequence-parallel plan, or transformers'
            # layout of the experts beside it (the tokens split over the group before the all-to-all); under FSDP2 the
            # vocabulary-split plan too, whose DTensor embedding gradient the ledger counts
            # (core.pipeline.whole_vocabulary_gradient) and the narrower model has not
            real_tp = stage_group_runs(par) or (fsdp2_pipeline and par.loss_parallel)

            def pipe_layout(r: int) -> Any:
                return PipeRank(par.pp, r, par.schedule, par.virtual_stages, setup.grad_accum,
                                dp_shard=par.dp // par.dp_replicate if fsdp2_pipeline else 1,
                                dp_replicate=par.dp_replicate, tp=par.tp if real_tp else 1, sp=par.sp,
                                reshard_after_forward=par.reshard_after_forward, ep=par.ep, cp=par.cp,
                                loss_parallel=par.loss_parallel and real_tp)

            step = functools.partial(trace_pipeline_rank, layout=pipe_layout(pipe_rank))
            if par.tp > 1 and not real_tp:
                # one tensor-parallel rank runs the narrower model (core.layout; tests/test_layout.py); with sequence
                # parallelism the stage's layers are split for real, torchtitan's plan on top
                from .ranks import tensor_parallel_config

                cfg = tensor_parallel_config(cfg, par.tp, par.loss_parallel)
        elif par.ep > 1 or (setup.model is None and par.is_distributed):
            # one rank of transformers' expert- or tensor-parallel layout of a family without a block model, the
            # data-parallel strategy applied in the trace too, on the fake process group
            from .ranks import RankLayout, trace_rank

            fsdp2 = par.strategy == "fsdp2"
            compute = setup.precision  # under FSDP2, its MixedPrecisionPolicy in the trace itself
            # (context parallelism: the rank runs its seq/cp tokens with ring attention, FSDP2 over dp × cp or every
            # context-parallel rank holding the model whole under DDP)
            step = functools.partial(trace_rank, layout=RankLayout(
                dp_shard=par.dp // par.dp_replicate if fsdp2 else 1, dp_replicate=par.dp_replicate if fsdp2 else par.dp,
                tp=par.tp, ep=par.ep,
                cp=par.cp, replicate_context=not fsdp2 and par.cp > 1, sp=par.sp,
                reshard_after_forward=par.reshard_after_forward))
        elif sharded_rank:  # FSDP2 itself: fully_shard over the data- (and context-) parallel ranks
            from .ranks import RankLayout, trace_rank

            compute = setup.precision  # its MixedPrecisionPolicy in the trace itself
            step = functools.partial(trace_rank, layout=RankLayout(
                dp_shard=par.dp // par.dp_replicate, dp_replicate=par.dp_replicate, tp=par.tp, cp=par.cp,
                loss_parallel=par.loss_parallel, sp=par.sp,
                reshard_after_forward=par.reshard_after_forward))
        elif par.tp > 1 or par.cp > 1:
            # one rank of the tensor-parallel group and of the context-parallel ring (its seq/cp tokens, attention as
            # PyTorch's ring attention), parallelized on the fake process group; the model states by rule below
            from .ranks import RankLayout, trace_rank

            step = functools.partial(trace_rank, layout=RankLayout(
                1, par.tp, loss_parallel=par.loss_parallel, cp=par.cp, replicate_context=True, sp=par.sp))
        kwargs = dict(
            batch=setup.rows, seq=setup.row_len, documents=setup.batch if setup.packing else None,
            precision=compute, optimizer=setup.optimizer,
            optimizer_impl=setup.optimizer_impl, attention=setup.attention, checkpointing=setup.checkpointing,
            use_cache=setup.use_cache, grad_accum=min(setup.grad_accum, TRACED_MICRO_BATCHES), iterations=2,
            fake=True, round_to=CUDA_ROUNDING, module_names=True, on_phase=on_phase,
            tuning=setup.tuning if setup.tuning.method != "full" else None, loss=setup.loss,
            loss_chunk=setup.loss_chunk, optimizer_in_backward=setup.optimizer_in_backward,
            activation_offload=setup.activation_offload, galore_rank=setup.galore_rank,
            galore_gap=1,  # GaLore: the second iteration refreshes the projection, as every 200th step does
            keep_tracker=True,
        )
        with exclusive_torch_job(should_stop, TraceCancelled), sequences:
            if len(pipe_ranks) == 1:
                m = step(cfg, **kwargs)
            else:  # each rank in turn (the last one's event log only kept while it is the most loaded)
                m = None
                for r in pipe_ranks:
                    run = trace_pipeline_rank(cfg, layout=pipe_layout(r), **kwargs)
                    if m is None or max(p.peak_bytes for p in run.phases.values()) > \
                            max(p.peak_bytes for p in m.phases.values()):
                        pipe_rank, m = r, run
    except (TraceCancelled, MemcalcError):
        raise
    except NotImplementedError as exc:  # an optimizer torch lacks, or a family without a reference module
        raise TraceError(str(exc)) from None
    except (ValueError, KeyError) as exc:
        raise TraceError(f"transformers cannot build model_type {cfg.get('model_type')!r}: {one_line(exc, 240)}") \
            from None
    except RecursionError:
        raise TraceError("the trace failed: the model nests too deeply; the analytic estimate still holds") from None
    except Exception as exc:  # an op fake tensors cannot run, or a model that fails to build
        raise TraceError(f"the trace failed ({type(exc).__name__}: {one_line(exc, 240)}); the analytic estimate "
                         "still holds") from None
    from ..measure.cpu_step import timeline_from_tracker

    timeline = timeline_from_tracker(m.tracker, "trace", CUDA_ROUNDING) if m.tracker is not None else None
    m = dataclasses.replace(m, tracker=None)  # the event log is in the timeline now
    seconds = time.perf_counter() - t0

    objects: dict[str, dict[str, int]] = {}
    for name in PHASES:
        ph = m.phases[name]
        if name == "load":
            # resident parameters (a tied model briefly builds an untied head while loading)
            objects[name] = {"parameters": -(-ph.live_bytes // CUDA_ROUNDING) * CUDA_ROUNDING}
        else:
            objects[name] = {k: v for k, v in ph.objects.items() if v}
    notes: tuple[str, ...] = ()
    offloaded = m.host_bytes  # the most offloaded activations the step held in host memory
    host_bytes = offloaded
    if setup.parallel.pp > 1 and setup.model is None:
        # the traced stage is the rank's own (FSDP2 in the trace); DDP's buckets hold every gradient of the stage once
        # more, from the moment DDP wraps it
        buckets = objects["optimizer_step"].get("gradients", 0) \
            if setup.parallel.strategy == "ddp" and setup.parallel.dp > 1 else 0
        for name in PHASES:
            objects[name]["gradients"] = objects[name].get("gradients", 0) + buckets
        if buckets:
            notes = ("DDP keeps every gradient of the stage once more in its communication buckets "
                     "(gradient_as_bucket_view=False, the default)",)
    elif setup.parallel.ep > 1 or (setup.model is None and setup.parallel.is_distributed) or sharded_rank:
        # the traced rank is the layout's own; DDP's buckets are what it does not run
        notes, buckets = _rank_rules(cfg, setup)
        for name in PHASES:  # (DDP makes its buckets as it wraps the model)
            objects[name]["gradients"] = objects[name].get("gradients", 0) + buckets
    elif setup.parallel.is_distributed and setup.model is not None and not fsdp2_pipeline:
        # The trace runs one replica; the strategy's per-GPU model states replace the traced ones. Sharded
        # strategies hold their state throughout, so each phase peaks where the transient memory does.
        if setup.parallel.strategy != "ddp":
            for name in ("forward", "backward"):
                objects[name] = {k: v for k, v in m.phases[name].transient_objects.items() if v}
        step = objects["optimizer_step"]
        state, temps = step.get("optimizer_state", 0), step.get("optimizer_temporaries", 0)
        # the model one rank runs
        rank = tensor_parallel_spec(setup.model, setup.parallel.tp, setup.parallel.loss_parallel)
        if setup.parallel.pp > 1:
            rank = stage_spec(rank, setup.parallel.pp, pipe_rank, setup.parallel.schedule)
        if fsdp2_mixed:
            cost = optimizer_cost(setup.optimizer, setup.optimizer_impl, rank.param_layout(), rank.num_layers, 4)
            state, temps = cost.state_bytes + cost.paged_bytes, cost.step_temporary_bytes
        # context parallelism shards the model states over data parallel × context parallel (core.context)
        sharded = dataclasses.replace(setup, parallel=dataclasses.replace(setup.parallel, cp=1))
        states = states_for(rank, sharded, state, temps, m.phases["forward"].compute_copy_bytes)
        load, fwd, (bwd,), stp = per_gpu_ledger(states, sharded.parallel, objects["load"], objects["forward"],
                                               [objects["backward"]], step)
        objects = {"load": load, "forward": fwd, "backward": bwd, "optimizer_step": stp}
        notes, host_bytes = states.notes, states.host_bytes + offloaded * setup.parallel.gpus_per_node
    phases = {name: with_overheads(objects[name], name, setup) for name in PHASES}
    rules = [
        "Traced on fake tensors (device cpu): every tensor storage of two real training iterations, "
        "the second reported",
        *([f"Traced {TRACED_MICRO_BATCHES} of the {setup.grad_accum:,} accumulation micro-batches per iteration: "
           "every later one repeats the second's tensors exactly"]
          if setup.grad_accum > TRACED_MICRO_BATCHES and setup.parallel.pp == 1
          else []),
        *([f"Traced one rank of {setup.parallel.gpus} with the routed experts split over {setup.parallel.ep} "
           "(transformers' expert-parallel plan and all-to-all, on the fake process group), balanced routing"]
          if setup.parallel.ep > 1 else []),
        *([f"Traced one rank of a {setup.parallel.tp}-way tensor-parallel group with transformers' plan for "
           f"{cfg.get('model_type')} (PyTorch's column- and row-wise styles, "
           + ("the experts whole beside expert parallelism" if setup.parallel.ep > 1 else
              "transformers' own for the experts") + ")"
           + (", torchtitan's sequence-parallel plan on top (the norms on the rank's "
              f"{setup.row_len // setup.parallel.cp // setup.parallel.tp:,} tokens)" if setup.parallel.sp else "")
           + ", on the fake process group"]
          if setup.parallel.tp > 1 and setup.model is None else []),
        *([f"Traced pipeline rank {pipe_rank + 1} of {setup.parallel.pp} ("
           + ("the analytic ledger's most loaded" if len(pipe_ranks) == 1 else
              "the most loaded of ranks " + ", ".join(str(r + 1) for r in pipe_ranks) + ", each traced")
           + ") under "
           f"PyTorch's {setup.parallel.schedule} schedule over {setup.grad_accum} micro-batch(es), on the fake process "
           "group"
           + (f"; each stage fully_shard-ed over {setup.parallel.fsdp2_ranks} ranks{setup.parallel.hybrid_text}"
              if fsdp2_pipeline and setup.parallel.dp_replicate > 1 else "")
           + (f"; its layers split over {setup.parallel.tp} tensor-parallel ranks with torchtitan's "
                      "sequence-parallel plan" if setup.parallel.sp else
                      f"; its tensor-parallel rank as the model with a {setup.parallel.tp}th of the heads and MLP"
                      if setup.parallel.tp > 1 else "")] if setup.parallel.pp > 1 else []),
        *([f"Traced one rank of FSDP2 itself: fully_shard over {setup.parallel.fsdp2_ranks} data-"
           f"{' and context-' if setup.parallel.cp > 1 else ''}parallel ranks{setup.parallel.hybrid_text} of the fake "
           "process group"
           + (f", each layer split {setup.parallel.tp} ways by tensor parallelism" if setup.parallel.tp > 1 else "")]
          if sharded_rank else []),
        *([f"Traced rank 1 of a {setup.parallel.cp}-way context-parallel ring: {setup.row_len // setup.parallel.cp:,} "
           f"of each sequence's {setup.row_len:,} tokens, SDPA run as PyTorch's ring attention (all-gathered "
           "key/value chunks, the CPU attention kernel standing in for the CUDA one), on the fake process group"
           ] if setup.parallel.cp > 1 else []),
        f"CUDA allocator rounding: each allocation rounded up to {CUDA_ROUNDING} B",
        f"CUDA context {setup.cuda_context_bytes / 2**20:.0f} MiB and allocator reserve "
        f"{setup.allocator_reserve:.0%} added (a CPU trace cannot see them)",
    ]
    modules = group_modules(m.phases["forward"].modules)[:TOP_MODULES]
    est = Estimate(setup=setup, method="trace", phases=phases, assumptions=tuple(rules) + notes,
                   details={"seconds": seconds, "modules": modules, "host_bytes": host_bytes,
                            "offloaded_activation_bytes": offloaded, "parallel_notes": notes})
    analytic = estimate(setup) if setup.model is not None and not analytic_refusal(setup) else None
    return TraceResult(est, modules, seconds, analytic, rules, timeline)


def analytic_refusal(setup: TrainingSetup) -> str:
    """Why the analytic ledger has no rule for a setup the trace runs ("" when it has one): the zero-bubble
    schedules with checkpointing (``core.pipeline.check_zero_bubble_ledger``)."""
    from ..core.pipeline import check_zero_bubble_ledger

    try:
        check_zero_bubble_ledger(setup)
    except InputError as exc:
        return exc.reason
    return ""


def fsdp2_rank(setup: TrainingSetup) -> bool:
    """Whether the trace runs FSDP2 itself on a dense model (``fully_shard`` over the data- and context-parallel ranks
    of the fake process group), rather than one replica with the strategy's model states by rule: the replica's rule
    counted a whole unit's fp32 gradients at the backward peak, 8–19 % over FSDP2's own step on Llama-3.2-1B
    (docs/parallelism.md)."""
    par = setup.parallel
    return (setup.model is not None and par.strategy == "fsdp2" and par.pp == 1 and par.ep == 1
            and par.dp * par.cp > 1 and par.offload == "none" and setup.tuning.method == "full"
            and setup.optimizer in ("adamw", "adam", "sgd") and not setup.optimizer_in_backward
            and setup.activation_offload == "none" and setup.loss == "full" and not setup.packing)


def _rank_rules(cfg: dict[str, Any], setup: TrainingSetup) -> tuple[tuple[str, ...], int]:
    """The layout's notes, and the bytes of DDP's buckets (``distributed.expert_parallel_states``: the gradients of
    what is replicated, which the trace's replicated parameters do not keep twice); no buckets under FSDP2."""
    from .meta import structure_on_meta
    from .ranks import tensor_parallel_config

    par = setup.parallel
    st = structure_on_meta(tensor_parallel_config(cfg, par.tp, experts_whole=par.ep > 1) if par.tp > 1 else cfg)
    # context parallelism shards the states with the data-parallel ranks (core.context)
    if setup.parallel.expert_split == 1:
        states = model_states(dataclasses.replace(setup.parallel, cp=1), st["num_params"], st["layer_params"],
                              setup.precision, 0, 0, 0, st["root_unit"])
        return states.notes, states.gradients["forward"] if setup.parallel.strategy == "ddp" else 0
    check_experts(str(cfg.get("model_type")), st["num_experts"], setup.parallel.ep, setup.parallel.etp)
    # (context parallelism: the experts' copies over the data- and context-parallel ranks together)
    states = expert_parallel_states(dataclasses.replace(setup.parallel, cp=1), st["num_params"], st["expert_params"],
                                    st["layer_params"] - st["layer_expert_params"], st["layer_expert_params"],
                                    setup.precision, 0, 0, 0, st["root_unit"], st["num_experts"])
    buckets = states.gradients["forward"] if setup.parallel.strategy == "ddp" else 0
    return states.notes, buckets


def _layer_count(cfg: dict[str, Any]) -> int:
    """Decoder layers a config asks for (0 when it names none), without trusting its types."""
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        value = cfg.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
            return int(min(value, 2**62))
    return 0


def group_modules(modules: tuple[tuple[str, int], ...] | list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Sum a module's activations over the repeated layers (``layers.3.mlp`` → ``layers.*.mlp``).

    The root module's own tensors are the logits and the loss (the causal-LM head computes them).
    """
    grouped: dict[str, int] = {}
    for name, nbytes in modules:
        if "." not in name and name[:1].isupper():
            key = f"loss and logits ({name})"
        else:
            key = re.sub(r"\.\d+(?=\.|$)", ".*", name)
        grouped[key] = grouped.get(key, 0) + nbytes
    return sorted(grouped.items(), key=lambda kv: -kv[1])
