"""One pipeline-parallel rank, traced: the real transformers model cut into stages and run by PyTorch's own pipeline
schedules (``torch.distributed.pipelining``) on the fake process group, in this one process.

The model is built (on the meta device in a fake run), checkpointed as asked, and cut to what rank ``rank`` of a
``pp``-stage pipeline holds: its decoder layers, the embedding on the first stage, the final norm and the LM head on
the last (transformers' ``base_model_pp_plan`` names the same split: embed_tokens, layers, norm). Each stage is the
family's own base-model forward over its slice of layers (the base model shallow-copied with its ``layers``
replaced: no model code is rewritten), wrapped in a :class:`~torch.distributed.pipelining.PipelineStage` with static
shapes, and driven by ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B`` or the zero-bubble
``ScheduleInterleavedZeroBubble`` and ``ScheduleZBVZeroBubble`` (their deferred weight-gradient steps each a backward
window of their own): the schedule decides
how many micro-batches' activations the rank keeps at once, as on a real cluster. The fake backend returns every
send and receive at once; the received activations and gradients are the stage's own preallocated buffers.

One adaptation, said here: the schedules open with a vote between the ranks (does every stage have static
shapes?), whose result they read with ``.item()``; on the fake process group no peer answers, so the rank's own
vote, static, is its result. torch is imported inside functions only.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..core.distributed import ZERO_BUBBLE
from ..core.errors import InputError

#: Schedules this trace runs, by the names the CLI uses, and PyTorch's class for each.
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
             "interleaved-zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"}
#: The schedules that run a list of stages per rank (PyTorch's ``PipelineScheduleMulti``).
MULTI = ("interleaved-1f1b", *ZERO_BUBBLE)


@dataclass(frozen=True)
class PipeRank:
    """Rank ``rank`` of a ``pp``-rank pipeline, ``virtual`` stages per rank (interleaved), ``microbatches`` per step."""

    pp: int
    rank: int = 0
    schedule: str = "1f1b"
    virtual: int = 1
    microbatches: int = 1
    #: FSDP2 (``fully_shard``) over this many data-parallel ranks of each stage (mesh ``pp × dp_shard × tp``).
    dp_shard: int = 1
    #: Tensor parallelism inside each stage: its layers split by transformers' plan with ``parallelize_module``
    #: (:mod:`.ranks`), with torchtitan's sequence-parallel plan on top when ``sp``; the stages then send the rank's
    #: ``seq/tp`` tokens.
    tp: int = 1
    sp: bool = False
    #: FSDP2's ``reshard_after_forward`` for every unit of the stage (torchtitan's "always" when on, "never" off).
    reshard_after_forward: bool = True
    #: Expert parallelism inside each stage: its MoE layers' routed experts split over ``ep`` of the stage's
    #: data-parallel ranks by transformers' plan and all-to-all (:mod:`.ranks`), as Megatron-LM and torchtitan carve
    #: the expert-parallel group out of the data-parallel one; under FSDP2 the experts sharded over the
    #: ``dp_shard / ep`` ranks that hold the same ones.
    ep: int = 1
    #: Context parallelism inside each stage: the stage runs ``seq/cp`` tokens of each sequence with PyTorch's ring
    #: attention (:mod:`.context`) over the mesh's ``cp`` ranks, and sends and receives that share; under FSDP2 its
    #: units are sharded over ``dp_shard × cp`` (torchtitan's ``dp_shard_cp``).
    cp: int = 1
    #: Loss parallelism (with ``tp``): the first stage's embedding and the last stage's head split over the vocabulary
    #: (torchtitan's plan), the logits left sharded and the loss computed under ``loss_parallel()``.
    loss_parallel: bool = False
    #: FSDP2's hybrid sharding of each stage: ``dp_replicate`` replicas of its ``dp_shard`` (× ``cp``) FSDP2 ranks, on
    #: the 2-D mesh (mesh ``pp × dp_replicate × dp_shard × cp × tp``, torchtitan's order).
    dp_replicate: int = 1

    def __post_init__(self) -> None:
        for name in ("pp", "virtual", "microbatches", "dp_shard", "tp", "ep", "cp", "dp_replicate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
                raise InputError(name, f"must be an integer from 1 to 4096, got {value!r}")
        if not 0 <= self.rank < self.pp:
            raise InputError("stage", f"must be a rank from 0 to {self.pp - 1}, got {self.rank!r}")
        if self.schedule not in SCHEDULES:
            raise InputError("schedule", f"must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.schedule == "zbv" and self.virtual != 2:
            raise InputError("virtual_stages", "the zero-bubble V schedule runs exactly two stages per rank")
        if self.virtual > 1 and self.schedule not in MULTI:
            raise InputError("virtual_stages", "more than one stage per rank is the interleaved and zero-bubble "
                                               "schedules'")
        if self.schedule == "interleaved-1f1b" and self.virtual == 1:
            raise InputError("virtual_stages", "the interleaved 1F1B schedule needs more than one stage per rank")
        if not isinstance(self.reshard_after_forward, bool):
            raise InputError("reshard_after_forward", f"must be true or false, got {self.reshard_after_forward!r}")
        if self.schedule in ZERO_BUBBLE and self.dp_shard * self.cp > 1 and self.reshard_after_forward:
            raise InputError("reshard_after_forward", "a zero-bubble stage under FSDP2 runs without resharding after "
                                                      "forward (with it PyTorch's W leaves the weight gradients wrong)")
        if not isinstance(self.sp, bool) or (self.sp and self.tp == 1):
            raise InputError("sp", "sequence parallelism splits what tensor parallelism leaves whole: it needs tp 2 or "
                                   "more")
        if self.ep > 1 and self.tp > 1 and (self.ep % self.tp or self.cp > 1):
            raise InputError("ep", "expert beside tensor parallelism in a pipeline stage is traced as transformers "
                                   "lays it out, ep a multiple of tp (a tensor-parallel group's ranks hold experts of "
                                   "one expert-parallel group), without context parallelism")
        ranks = self.dp_shard * self.cp * self.tp  # the stage's ranks, which the experts are split over
        if self.ep > 1 and self.dp_shard * self.cp > 1 and ranks % self.ep:
            raise InputError("ep", "expert parallelism in a pipeline stage splits the experts over a number of the "
                                   "stage's data-, context- and tensor-parallel ranks that divides them")
        if self.dp_replicate > 1 and (self.dp_shard * self.cp == 1 or self.ep > 1):
            raise InputError("dp_replicate", "a stage's hybrid replicas are of FSDP2 groups with something to shard, "
                                             "without expert parallelism")
        if not isinstance(self.loss_parallel, bool) or (self.loss_parallel and self.tp == 1):
            raise InputError("loss_parallel", "loss parallelism splits the vocabulary over the tensor-parallel ranks: "
                                              "it needs tp 2 or more")

    @property
    def stages(self) -> tuple[int, ...]:
        """The global stage indices this rank runs (interleaved: ``rank``, ``rank + pp``, …, loop order; zero-bubble
        V: ``rank`` and ``2·pp − 1 − rank``, PyTorch's "v" placement, so rank 0 holds the first and the last)."""
        if self.schedule == "zbv":
            return (self.rank, 2 * self.pp - 1 - self.rank)
        return tuple(self.rank + i * self.pp for i in range(self.virtual))

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual

    @property
    def data(self) -> int:
        """The data-parallel ranks of a stage the trace's mesh holds: FSDP2's, else the expert-parallel ones (one
        replica of DDP's, each holding ep/tp of the experts' groups beside tensor parallelism); beside context
        parallelism FSDP2's (the experts split over dp_shard × cp)."""
        return max(self.dp_shard, self.ep // self.tp) if self.cp == 1 else self.dp_shard

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.data * self.cp * self.tp

    @property
    def global_rank(self) -> int:
        """This rank in the ``pp × dp_replicate × data × cp × tp`` mesh (the first of its stage's data-, context- and
        tensor-parallel ranks)."""
        return self.rank * self.dp_replicate * self.data * self.cp * self.tp


def stage_layers(num_layers: int, num_stages: int, stage: int) -> range:
    """The decoder layers of ``stage`` when ``num_stages`` split ``num_layers`` evenly (as torchtitan's default)."""
    if num_layers % num_stages:
        raise InputError("pp", f"{num_layers} decoder layers cannot be split evenly into {num_stages} pipeline stages")
    per = num_layers // num_stages
    return range(stage * per, (stage + 1) * per)


def _base(model: Any) -> Any:
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, k) for k in ("layers", "embed_tokens", "norm")):
        raise InputError("pp", f"the pipeline trace cuts models with a llama-style decoder (model.layers); "
                               f"{type(model).__name__} has none")
    return inner


def _meshes(layout: PipeRank) -> tuple[Any, Any, Any, tuple[Any, ...], Any]:
    """The pipeline's process group, the data-parallel mesh (with context parallelism FSDP2's ``dp_shard × cp``),
    the tensor-parallel mesh, with expert parallelism the experts' view of the stage's data-parallel ranks
    (``efsdp × ep``, transformers' names) and the tensor-parallel mesh its all-to-all reads, and the context-parallel
    mesh (built now, outside any fake mode)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (layout.pp, layout.dp_replicate, layout.data, layout.cp, layout.tp),
                            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp"):
        mesh[name].get_coordinate()
    data = mesh["dp_shard", "cp"]._flatten("dp_shard_cp") if layout.cp > 1 else mesh["dp_shard"]
    if layout.dp_replicate > 1:  # FSDP2's hybrid sharding: the stage's 2-D mesh, replicas × shards
        import warnings

        with warnings.catch_warnings():  # torchtitan's slice of the flattened dim (torch 2.10 says it will change)
            warnings.filterwarnings("ignore", "Slicing a flattened dim", UserWarning)
            data = mesh["dp_replicate", "dp_shard_cp" if layout.cp > 1 else "dp_shard"]
    data.get_coordinate()
    experts: tuple[Any, ...] = ()
    if layout.ep > 1:  # the same ranks, a stage's seen as (copies of each expert, ep): torchtitan lends the
        # expert-parallel ranks from dp_shard × cp; beside tensor parallelism ep runs over consecutive ranks, a
        # tensor-parallel group's holding experts of one expert-parallel group (transformers' layout, trace.ranks)
        view = init_device_mesh("cpu", (layout.pp, layout.data * layout.cp * layout.tp // layout.ep, layout.ep),
                                mesh_dim_names=("pp", "efsdp", "ep"))
        experts = (view["efsdp"], view["ep"], mesh["tp"])
        for m in experts:
            m.get_coordinate()
    return mesh["pp"].get_group(), data, mesh["tp"], experts, mesh["cp"]


def cutter(layout: PipeRank, dp_mesh: Any = None, precision: str = "fp32", tp_mesh: Any = None,
           config: dict[str, Any] | None = None, seq: int = 0, experts: tuple[Any, ...] = (),
           replicas: Any = None) -> Callable[[Any], None]:
    """The ``parallelize(model)`` callback: keep only what ``layout``'s rank holds (in place, before the model is
    made real): its layers, the embedding on stage 0, the final norm and the head on the last stage; with a
    tensor-parallel mesh, its layers split as :mod:`.ranks` splits them (``config``'s plan; sequence parallelism over
    ``seq`` tokens when the layout says so); with a data-parallel mesh, each layer, the embedding and the norm with
    the head sharded by ``fully_shard`` (torchtitan's units; mixed precision: bf16 gathers, fp32 reduction); with
    the experts' meshes (:func:`_meshes`), the stage's routed experts split over ``ep`` ranks first (transformers'
    plan, :func:`.ranks._split_experts`), under FSDP2 sharded over their copies, else the rest made replicated
    DTensors over ``replicas`` (one kind of parameter for the optimizer, as in :mod:`.ranks`)."""
    import torch

    def cut(model: Any) -> None:
        inner = _base(model)
        n = len(inner.layers)
        keep = [j for s in layout.stages for j in stage_layers(n, layout.num_stages, s)]
        inner.layers = torch.nn.ModuleList(inner.layers[j] for j in keep)
        if {0, layout.num_stages - 1} - set(layout.stages):
            # a tied head on the last stage is that stage's own copy (Megatron-LM's layout): nothing left to tie
            model.config.tie_word_embeddings = False
            getattr(model.config, "get_text_config", lambda: model.config)().tie_word_embeddings = False
        if 0 not in layout.stages:
            inner.embed_tokens = None
        if layout.num_stages - 1 not in layout.stages:
            inner.norm = torch.nn.Identity()
            model.lm_head = torch.nn.Identity()
        split: list[Any] = []
        if experts:  # first, as trace.ranks: the tensor-parallel split makes every parameter left whole a DTensor
            from .ranks import _replicate_the_rest, _split_experts

            efsdp, ep_mesh, ep_tp = experts
            split = _split_experts(model, ep_mesh, ep_tp)
            if dp_mesh is None and tp_mesh is None:
                _replicate_the_rest(model, replicas)
        if tp_mesh is not None:  # the stage's layers split as one rank of its tensor-parallel group
            from .ranks import split_tensor_parallel, tp_plan, without_expert_rules

            assert config is not None
            plan = without_expert_rules(config, tp_plan(config)) if experts else tp_plan(config)
            split_tensor_parallel(model, plan, tp_mesh, sequence=layout.sp, vocab=layout.loss_parallel,
                                  first=0 in layout.stages, last=layout.num_stages - 1 in layout.stages, seq=seq)
        if dp_mesh is not None:
            from torch.distributed.fsdp import fully_shard

            from .ranks import experts_placement

            policy = _policy(precision)
            # torchtitan's placement of the routed experts (over their copies beside expert parallelism)
            place = experts_placement(model, efsdp.size() if split else dp_mesh.size(dp_mesh.ndim - 1),
                                      layout.ep if split else 1)
            for module in split:  # transformers' order: the experts over their copies first
                fully_shard(module, mesh=efsdp, mp_policy=policy, reshard_after_forward=True, shard_placement_fn=place)
            for i, unit in enumerate([inner.embed_tokens, *inner.layers, [inner.norm, model.lm_head]]):
                if unit is not None and any(True for m in (unit if isinstance(unit, list) else [unit])
                                            for _ in m.parameters()):
                    layer = 0 < i <= len(inner.layers)
                    fully_shard(unit, mesh=dp_mesh, mp_policy=policy,
                                reshard_after_forward=layout.reshard_after_forward,
                                shard_placement_fn=place if layer and not split else None)

    return cut


def _policy(precision: str) -> Any:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "mixed" \
        else MixedPrecisionPolicy()


class _Stage:
    """Factory of the stage modules (a class so that torch is imported lazily)."""

    @staticmethod
    def make(model: Any, layers: list[Any], first: bool, last: bool, autocast: Any) -> Any:
        import torch

        inner = _base(model)
        body = copy.copy(inner)  # the family's own forward over this stage's layers
        body._modules = dict(inner._modules)
        body._parameters = dict(inner._parameters)
        body._buffers = dict(inner._buffers)
        body.layers = torch.nn.ModuleList(layers)
        if not first:
            body.embed_tokens = None
        if not last:
            body.norm = torch.nn.Identity()

        class Stage(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.body = body
                self.head = model.lm_head if last else None

            def forward(self, x: Any) -> Any:
                with autocast():
                    out = self.body(input_ids=x) if first else self.body(inputs_embeds=x)
                    hidden = out.last_hidden_state
                    return self.head(hidden) if self.head is not None else hidden

        return Stage()


def driver(layout: PipeRank, *, batch: int, seq: int, precision: str, group: Any = None,
           dp_mesh: Any = None) -> Callable[[Any], Any]:
    """The ``pipeline(model)`` callback of :func:`~memcalc_gui.measure.cpu_step.measure_training_step`: the rank's
    stages and schedule over the cut model; its ``step(input_ids, phase)`` runs one step of the schedule with each
    forward, loss and backward of a micro-batch in its own phase window."""
    import torch
    from torch.distributed import pipelining
    from transformers.loss.loss_utils import ForCausalLMLoss

    # FSDP2 runs mixed precision through its policy (bf16 gathered weights, no autocast), as torchtitan does
    half = precision in ("mixed", "bf16-autocast") and dp_mesh is None
    bf16_compute = precision == "mixed" and dp_mesh is not None

    def autocast() -> Any:
        return torch.autocast("cpu", dtype=torch.bfloat16) if half else contextlib.nullcontext()

    def make(model: Any) -> Any:
        inner = _base(model)
        per = len(inner.layers) // layout.virtual
        h, v = int(model.config.hidden_size), int(model.config.vocab_size)
        dtype = torch.bfloat16 if bf16_compute else next(model.parameters()).dtype
        stages = []
        for i, s in enumerate(layout.stages):
            first, last = s == 0, s == layout.num_stages - 1
            module = _Stage.make(model, list(inner.layers[i * per:(i + 1) * per]), first, last, autocast)
            if dp_mesh is not None:  # the stage's root unit (its units sharded in the cut)
                from torch.distributed.fsdp import fully_shard

                fully_shard(module, mesh=dp_mesh, mp_policy=_policy(precision))
            # the hidden states a stage sends: the rank's share of the sequence under sequence parallelism
            hidden = torch.empty(batch, seq // layout.tp if layout.sp else seq, h, dtype=dtype, device="meta")
            out = torch.empty(batch, seq, v, dtype=torch.bfloat16 if half or bf16_compute else dtype, device="meta") \
                if last \
                else hidden
            # a received activation requires grad, so that the stage's backward makes the gradient it sends back (the
            # static shapes given here are what PyTorch's stage builds its receive buffers from, requires_grad too)
            inp = torch.empty(batch, seq, dtype=torch.long, device="meta") if first \
                else torch.empty_like(hidden).requires_grad_()
            stage = pipelining.PipelineStage(
                module, s, layout.num_stages, torch.device("cpu"), input_args=(inp,), output_args=(out,),
                output_grads=None if last else (hidden,), input_grads=None if first else (hidden,), group=group)
            # the opening vote: no peer answers on the fake process group; every stage is static (module docstring)
            stage._warmup_forward_vote = _static_vote
            stage._warmup_backward_result = _static_vote
            stages.append(stage)

        def loss_fn(logits: Any, target: Any) -> Any:
            return ForCausalLMLoss(logits, target, v)

        cls = getattr(pipelining, SCHEDULES[traced_schedule(layout)])
        schedule = cls(stages if layout.schedule in MULTI else stages[0], n_microbatches=layout.microbatches,
                       loss_fn=loss_fn)
        return _Driver(schedule, stages, layout)

    return make


def traced_schedule(layout: PipeRank) -> str:
    """The schedule the trace runs: PyTorch's Schedule1F1B wants at least as many micro-batches as stages; with
    fewer, the first rank runs all its forwards before its first backward (1F1B's warm-up covers its step), which
    is GPipe's order, so the trace runs GPipe. A later rank keeps fewer in flight under 1F1B (Megatron-LM runs it:
    ``min(m, pp − r)``), so there the GPipe trace holds more than the ledger; the first rank, the most loaded one,
    is the same under both."""
    if layout.schedule == "1f1b" and layout.microbatches < layout.pp:
        return "gpipe"
    return layout.schedule


def _static_vote(*_args: Any, **_kwargs: Any) -> Any:
    import torch

    return torch.ones(1, dtype=torch.int32)


class _Driver:
    """Runs the schedule's step, each chunk's forward, loss and backward in its own phase window."""

    def __init__(self, schedule: Any, stages: list[Any], layout: PipeRank) -> None:
        self.schedule, self.stages, self.layout = schedule, stages, layout
        self._phase: Callable[[str, int], contextlib.AbstractContextManager[None]] | None = None
        self.count = {"forward": 0, "backward": 0}
        #: The tracker's ``track(tensor, category)``, set by the step that measures this driver's steps.
        self.track: Callable[[Any, str], Any] | None = None
        for stage in stages:
            stage.forward_one_chunk = self._windowed("forward", stage.forward_one_chunk)
            stage.backward_one_chunk = self._windowed("backward", stage.backward_one_chunk)
            # a zero-bubble schedule's deferred weight-gradient step (its "W"), a backward window of its own
            stage.backward_weight_one_chunk = self._windowed("backward", stage.backward_weight_one_chunk)
        schedule._compute_loss = self._windowed("forward", schedule._compute_loss)

    def _windowed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if self._phase is None:
                return fn(*args, **kwargs)
            micro = self.count[name]
            self.count[name] += 1
            with self._phase(name, micro):
                out = fn(*args, **kwargs)
                if name == "backward":
                    self._tag_unsynced_gradients()
                return out
        return run

    def _tag_unsynced_gradients(self) -> None:
        """Count FSDP2's unsharded gradients as gradients: under the schedule a stage's backwards run without
        gradient sync, so each unit accumulates its gradients unsharded (the policy's fp32 accumulator, or the
        unsharded parameter's own ``.grad``) until the last backward reduce-scatters them, never in the sharded
        parameter's ``.grad`` the step sees. (FSDP2's own attributes; a torch without them leaves them as
        temporaries, as before.)"""
        if self.track is None:
            return
        if self.layout.schedule in ZERO_BUBBLE:
            # a zero-bubble W sets each weight's .grad itself (``stage_backward_weight``), not through autograd's
            # accumulation the tracker sees: they are the step's gradients all the same
            for stage in self.stages:
                for param in stage.submod.parameters():
                    if param.grad is not None:
                        self.track(param.grad, "gradients")
        for stage in self.stages:
            for module in stage.submod.modules():
                state = getattr(module, "_get_fsdp_state", None)
                group = getattr(state(), "_fsdp_param_group", None) if callable(state) else None
                for fsdp_param in getattr(group, "fsdp_params", ()) if group is not None else ():
                    unsharded = getattr(fsdp_param, "_unsharded_param", None)
                    for grad in (getattr(fsdp_param, "unsharded_accumulated_grad", None),
                                 getattr(unsharded, "grad", None)):
                        if grad is not None:
                            self.track(grad, "gradients")

    @contextlib.contextmanager
    def _windows(self, phase: Callable[[str, int], contextlib.AbstractContextManager[None]]) -> Iterator[None]:
        self._phase, self.count = phase, {"forward": 0, "backward": 0}
        try:
            yield
        finally:
            self._phase = None

    def step(self, input_ids: Any, phase: Callable[[str, int], contextlib.AbstractContextManager[None]]) -> int:
        """One step; the number of windows of the busier phase (the step's 'micro-batches' for the summary)."""
        with self._windows(phase):
            first = 0 in self.layout.stages
            last = self.layout.num_stages - 1 in self.layout.stages
            args = (input_ids,) if first else ()
            # return_outputs=False: no micro-batch's logits kept to be returned (torchtitan's call)
            self.schedule.step(*args, target=input_ids if last else None, return_outputs=False)
        return max(self.count.values())


def trace_pipeline_rank(config: dict[str, Any], layout: PipeRank, *, fake: bool = True, group: str = "fake",
                        **step: Any) -> Any:
    """The step of ``config`` on ``layout``'s rank, its schedule over ``layout.microbatches`` micro-batches of
    ``batch`` rows (``step``: :func:`~memcalc_gui.measure.cpu_step.measure_training_step`'s keywords); a
    :class:`~memcalc_gui.measure.cpu_step.StepMeasurement`. ``fake`` (the default) traces on fake tensors; ``group``
    is the fake process group (``"fake"``) or the real one this process is a rank of (``"current"``). Under context
    parallelism ``seq`` is the whole sequence, of which the stage runs ``seq/cp`` tokens with ring attention."""
    from ..core.context import check_ring
    from ..measure import exclusive_torch_job
    from ..measure.cpu_step import measure_training_step
    from .context import RingNotRun, ring_attention
    from .fake import unpacked_sequences
    from .ranks import STEP_DEFAULTS, _loss_parallel, process_group

    kw = STEP_DEFAULTS | step | {"grad_accum": layout.microbatches}
    if layout.cp > 1:  # the stage runs, sends and receives the rank's share of each sequence
        check_ring(int(kw["seq"]), layout.cp, str(kw.get("attention", "sdpa")))
        kw.update(seq=int(kw["seq"]) // layout.cp, attention="sdpa")  # the fused kernel the ring runs
    with exclusive_torch_job(), process_group(group, layout.world, layout.global_rank), unpacked_sequences():
        group, data_mesh, tp_mesh, experts, cp_mesh = _meshes(layout)
        # FSDP2 over the stage's data-parallel ranks, and with context parallelism over dp_shard × cp even where
        # dp_shard is 1, as torchtitan applies it whenever context parallelism is on
        dp_mesh = data_mesh if layout.dp_shard * layout.cp > 1 else None
        tp_mesh = tp_mesh if layout.tp > 1 else None
        make = driver(layout, batch=kw["batch"], seq=kw["seq"], precision=kw["precision"], group=group,
                      dp_mesh=dp_mesh)
        cut = cutter(layout, dp_mesh, kw["precision"], tp_mesh, config, int(kw["seq"]), experts, data_mesh)
        ring = ring_attention(cp_mesh) if layout.cp > 1 else contextlib.nullcontext([1])
        with _loss_parallel(layout.loss_parallel), ring as calls:
            measured = measure_training_step(config, fake=fake, parallelize=cut, pipeline=make,
                                             autocast=dp_mesh is None, **kw)
    if not calls[0]:
        raise RingNotRun("cp", "the stage never ran ring attention (its attention did not reach SDPA's fused "
                               "kernel); the formula stands alone")
    return measured
