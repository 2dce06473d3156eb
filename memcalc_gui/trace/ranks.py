"""One rank of a parallel layout, traced: the real model parallelized with PyTorch's own APIs and run on fake tensors
with the fake process group, in this one process.

The layout's device mesh (``dp_replicate × dp_shard × cp × tp``) is built over PyTorch's "fake" backend
(``FakeStore``: every collective returns at once, nothing is sent). The model is built on the meta device,
tensor-parallelized with ``parallelize_module`` from the model family's own plan in transformers
(``config.base_model_tp_plan``: each ``colwise`` linear a ``ColwiseParallel``, each ``rowwise`` one a
``RowwiseParallel``, as torchtitan's Llama plan does), then sharded with FSDP2's ``fully_shard`` (each decoder layer,
then the root) over the data-parallel mesh dimension (with the context-parallel ranks, flattened as torchtitan's
``dp_shard_cp``), and made real on fake storage. The step then runs as
:func:`~memcalc_gui.measure.cpu_step.measure_training_step` runs it, under the live-storage tracker: the ledger of one
rank, with DTensor's and FSDP2's own buffers.

This is what torchtitan's memory estimation does for FSDP/HSDP (its ``scripts/estimate``), extended to tensor
parallelism: the mesh and its sub-meshes are built, and the parallelism applied, outside the fake mode (their
coordinates are computed with real tensors), which is why torchtitan's estimator refuses TP.

Expert parallelism is transformers' own (``transformers.distributed.expert_parallel``): the family's
``base_model_ep_plan`` splits each MoE layer's experts over the ``ep`` ranks, and its all-to-all implementation sends
every (token, expert) pair to the expert's rank and back. FSDP2 then shards the experts over the ranks that hold the
same ones (transformers' ``efsdp``: ``world / ep``) and the rest over all. One adaptation, stated: the all-to-all's
split sizes are the one value a step reads back from the routing (``.tolist()``), which fake tensors do not hold;
the trace takes balanced routing (every rank sends and receives ``tokens × top-k / ep`` pairs), the assumption the
ledger makes and the one random router weights give.

Context parallelism runs PyTorch's own ring attention (:mod:`.context`) over the mesh's ``cp`` dimension, the rank
fed its ``seq/cp`` tokens. Sequence parallelism is torchtitan's plan on transformers' own layers (:class:`RankLayout`),
a mixture-of-experts block gathering the rank's tokens and its whole output cut back to them (:func:`_split_layer`).
Pipeline stages are traced by :mod:`.pipeline`. Expert parallelism is traced beside tensor, sequence and context
parallelism. torch is imported inside functions only.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..core.errors import InputError
from .meta import routed_name

#: Plan styles of transformers' ``base_model_tp_plan`` this trace applies, and what they are in PyTorch.
STYLES = {"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel"}
#: The mixture-of-experts styles of transformers' plans, applied with transformers' own ``apply_tensor_parallelism``:
#: each expert's fused gate/up projection split column-wise, its down projection row-wise, the experts' outputs
#: summed over the ranks.
EXPERT_STYLES = ("packed_colwise", "moe_tp_experts")
#: Styles that leave a module replicated (its gradients all-reduced): the memory of one rank is unchanged.
REPLICATED = ("replicated_with_grad_allreduce",)


@dataclass(frozen=True)
class RankLayout:
    """The mesh of a traced rank: ``dp_replicate`` replicas (whole, or FSDP2's hybrid sharding where ``dp_shard``
    > 1) × ``dp_shard`` FSDP2 shards × ``tp`` tensor-parallel ranks, with the routed experts split over ``ep`` of
    them (transformers' expert view of the same ranks: ``world / ep`` copies of each expert, FSDP2-sharded over those
    copies when ``dp_shard`` > 1)."""

    dp_shard: int = 1
    tp: int = 1
    reshard_after_forward: bool = True
    #: The vocabulary split too (torchtitan's loss parallel): the embedding ``RowwiseParallel``, the head
    #: ``ColwiseParallel`` with sharded logits, the loss under ``loss_parallel()``.
    loss_parallel: bool = False
    ep: int = 1
    #: Replicas of the model that are not sharded (each parameter whole on every rank, as under DDP): the ranks
    #: expert parallelism spreads over without FSDP.
    dp_replicate: int = 1
    #: Ranks each sequence is split over (PyTorch's context parallelism, :mod:`.context`): the rank runs ``seq/cp``
    #: tokens with ring attention, and FSDP2 shards over ``dp_shard × cp`` (torchtitan's ``dp_shard_cp`` mesh).
    cp: int = 1
    #: The context-parallel ranks hold the model whole (no FSDP2 over them): one replica's step, the strategy's model
    #: states then taken by rule (``trace.fake``).
    replicate_context: bool = False
    #: Sequence parallelism beside tensor parallelism, PyTorch's way (torchtitan's plan): the norms run on the rank's
    #: ``seq/tp`` tokens (``SequenceParallel``), attention and the MLP gather them (``PrepareModuleInput``), the
    #: row-wise projections reduce-scatter back (``RowwiseParallel(output_layouts=Shard(1))``); a mixture-of-experts
    #: block's whole output is cut back to the rank's tokens (``PrepareModuleInputOutput``).
    sp: bool = False

    def __post_init__(self) -> None:
        for name in ("dp_shard", "tp", "ep", "dp_replicate", "cp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
                raise InputError(name, f"must be an integer from 1 to 4096, got {value!r}")
        if self.ep > 1 and self.tp > 1 and self.ep % self.tp:
            raise InputError("ep", f"expert parallelism beside tensor parallelism needs ep a multiple of tp "
                                   f"(transformers' DistributedConfig: a tensor-parallel group's ranks hold experts of "
                                   f"one expert-parallel group), got ep {self.ep}, tp {self.tp}")
        if not isinstance(self.sp, bool) or (self.sp and self.tp == 1):
            raise InputError("sp", "sequence parallelism splits what tensor parallelism leaves whole: it needs tp 2 or "
                                   "more")
        if not isinstance(self.replicate_context, bool):
            raise InputError("cp", f"replicate_context must be true or false, got {self.replicate_context!r}")
        if self.replicate_context and self.dp_shard > 1:
            raise InputError("cp", "the context-parallel ranks are sharded with the data-parallel ones")
        if self.world % self.ep:
            raise InputError("ep", f"expert parallelism over {self.ep} ranks needs a world it divides, got "
                                   f"{self.world}")

    @property
    def hybrid(self) -> bool:
        """FSDP2's hybrid sharding: ``dp_replicate`` replicas, each ``fully_shard``-ed over its own ranks."""
        return self.dp_replicate > 1 and self.fsdp_ranks > 1

    @property
    def fsdp_ranks(self) -> int:
        """The ranks FSDP2 shards each parameter over (1: not applied)."""
        return self.dp_shard * (1 if self.replicate_context else self.cp)

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp


def tensor_parallel_config(config: dict[str, Any], tp: int, vocab: bool = False,
                           experts_whole: bool = False) -> dict[str, Any]:
    """The config of the model one rank of a ``tp``-way group runs (``core.layout``: a tp-th of the heads, key/value
    heads and MLP features at the same head size; ``vocab``: a tp-th of the vocabulary), for families whose config
    takes ``head_dim``. ``experts_whole``: the routed experts keep their width, as beside expert parallelism
    (:func:`without_expert_rules`)."""
    from ..core.errors import UnsupportedFamilyError
    from ..core.layout import check_tensor_parallel
    from ..core.model import spec_from_config

    try:
        spec = spec_from_config(config)
    except UnsupportedFamilyError:  # a family without a block model (a mixture of experts): from its config
        return _narrower_config_memo(config, tp, experts_whole)
    check_tensor_parallel(spec, tp)
    if spec.family not in ("llama", "mistral", "qwen2", "qwen3", "gemma"):
        raise InputError("tp", f"the narrower-model trace of a tensor-parallel rank needs a config with head_dim; "
                               f"{spec.family}'s has none")
    return dict(config, num_attention_heads=spec.num_heads // tp, num_key_value_heads=spec.num_kv_heads // tp,
                intermediate_size=spec.intermediate_size // tp, head_dim=spec.head_dim,
                vocab_size=-(-spec.vocab_size // tp) if vocab else spec.vocab_size)




#: :func:`_narrower_config`'s answers by (config, tp, experts whole): the config or the InputError (a layout search
#: asks for the same few hundreds of times, each asking transformers' config class twice).
_NARROWER: dict[str, dict[str, Any] | InputError] = {}
_NARROWER_KEPT = 256
_NARROWER_LOCK = threading.Lock()


def _narrower_config_memo(config: dict[str, Any], tp: int, experts_whole: bool) -> dict[str, Any]:
    try:
        key = json.dumps([config, tp, experts_whole], sort_keys=True)
    except (TypeError, ValueError):
        return _narrower_config(config, tp, experts_whole)
    with _NARROWER_LOCK:
        found = _NARROWER.get(key)
    if found is None:
        found = _stored_narrower(key)
    if found is None:
        try:
            found = _narrower_config(config, tp, experts_whole)
        except InputError as exc:
            found = exc
        from .meta import store_answer

        store_answer("narrower:" + key, {"error": [found.field, found.reason]}
                     if isinstance(found, InputError) else {"config": found},
                     lambda payload: _check_narrower(key, payload))
        with _NARROWER_LOCK:
            if len(_NARROWER) >= _NARROWER_KEPT:
                _NARROWER.pop(next(iter(_NARROWER)))
            _NARROWER[key] = found
    if isinstance(found, InputError):
        raise found.with_traceback(None)
    return dict(found)


def _stored_narrower(key: str) -> dict[str, Any] | InputError | None:
    """The answer kept on disk for ``key`` (beside the meta-device counts, keyed with the installed transformers):
    a warm layout search imports no transformers for it. Sealed and checked (:func:`_check_narrower`): anything else
    there is asked again (a damaged file set aside with one notice)."""
    from .meta import stored_answer

    data = stored_answer("narrower:" + key, lambda payload: _check_narrower(key, payload), _legacy_narrower)
    if data is None:
        return None
    if "config" in data:
        return dict(data["config"])
    return InputError(data["error"][0], data["error"][1])


#: The keys a narrower config may change or add (:func:`_narrower_config`): the heads, the head size, the widths
#: the plan splits.
_NARROWED = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size",
             "shared_expert_intermediate_size")


def _check_narrower(key: str, payload: Any) -> None:
    """``ValueError`` where a kept answer for ``key`` (``[config, tp, experts_whole]``) cannot be
    :func:`_narrower_config`'s: a refusal is a field and a reason of bounded length; a config keeps every other key
    of the asked config as it is, and each width it changes is the asked one over ``tp``."""
    if not isinstance(payload, dict) or len(payload) != 1:
        raise ValueError("it holds no narrower config or refusal")
    if "error" in payload:
        error = payload["error"]
        if not (isinstance(error, list) and len(error) == 2 and all(isinstance(e, str) for e in error)
                and len(error[1]) <= 2000):
            raise ValueError("its refusal is not a field and a reason")
        return
    out = payload.get("config")
    asked, tp, _whole = json.loads(key)
    if not isinstance(out, dict) or not isinstance(asked, dict) or type(tp) is not int or tp < 1:
        raise ValueError("it holds no narrower config")
    for name in set(asked) | set(out):
        if name not in out:
            raise ValueError(f"its config lost the key {name[:40]!r}")
        if name in _NARROWED:
            value, was = out[name], asked.get(name)
            if type(value) is not int or value < 1:
                raise ValueError(f"its {name} is not a positive whole number")
            if type(was) is int and name != "head_dim":  # the heads are always split, a width where the plan does
                split = (was // tp,) if name in ("num_attention_heads", "num_key_value_heads") else (was, was // tp)
                if value not in split:
                    raise ValueError(f"its {name} is not the asked one over the tensor-parallel degree")
        elif name not in asked or out[name] != asked[name]:
            raise ValueError(f"its config changed {name[:40]!r}, which a tensor-parallel rank keeps")


def _legacy_narrower(data: dict[str, Any]) -> bool:
    return len(data) == 1 and ("config" in data or "error" in data)


def _narrower_config(config: dict[str, Any], tp: int, experts_whole: bool = False) -> dict[str, Any]:
    """The rank's config of a family without a block model: a tp-th of the heads, key/value heads and every width
    transformers' plan splits, at the same head size. Equal to the rank transformers' plan makes, byte for byte
    (tests/test_expert.py), for the families whose plan holds only the styles this trace applies."""
    from ..core.configfile import transformers_kwargs
    from .meta import auto_config

    plan = tp_plan(config)  # a plan of styles the narrower model stands for, or InputError
    if experts_whole:
        plan = without_expert_rules(config, plan)
    model_type, kwargs = transformers_kwargs(config)
    full = auto_config(model_type, kwargs)
    heads = int(full.num_attention_heads)
    kv = int(getattr(full, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(full, "head_dim", None) or full.hidden_size // heads)
    out = dict(config, num_attention_heads=heads // tp, num_key_value_heads=kv // tp, head_dim=head_dim)
    split = {"attention heads": heads, "key/value heads": kv}
    # the widths the plan splits: the experts' (their own width, or the MLP's), a dense MLP's, the shared experts'
    # (Qwen2-MoE's plan leaves its shared expert whole)
    expert_key = "moe_intermediate_size" if isinstance(getattr(full, "moe_intermediate_size", None), int) \
        else "intermediate_size"
    widths = {"intermediate_size": any(k in ("mlp.gate_proj", "mlp.up_proj", "mlp.fc1") for k in plan),
              "shared_expert_intermediate_size": any("shared_expert" in k for k in plan)}
    widths[expert_key] = widths.get(expert_key, False) or any(k.startswith("mlp.experts.") for k in plan)
    for key in ("moe_intermediate_size", "intermediate_size", "shared_expert_intermediate_size"):
        value = getattr(full, key, None)
        if widths.get(key) and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[key] = value // tp
            split[key.replace("_", " ")] = value
    for what, n in split.items():
        if n % tp:
            raise InputError("tp", f"{model_type} has {n:,} {what}, which {tp} tensor-parallel ranks cannot split "
                                   "evenly")
    rank = auto_config(model_type, transformers_kwargs(out)[1])
    if int(getattr(rank, "head_dim", 0) or 0) != head_dim:
        raise InputError("tp", f"{model_type}'s config takes no head_dim: its tensor-parallel rank cannot be built "
                               "as a narrower model")
    return out


def tp_plan(config: dict[str, Any]) -> dict[str, str]:
    """The decoder layer's tensor-parallel plan from transformers' config class (``base_model_tp_plan``), as
    ``{submodule path: style}``; :class:`InputError` naming ``tp`` for a family whose plan this trace cannot apply."""
    from ..core.configfile import transformers_kwargs
    from .meta import auto_config

    model_type, kwargs = transformers_kwargs(config)
    plan = getattr(auto_config(model_type, kwargs), "base_model_tp_plan", None) or {}
    out: dict[str, str] = {}
    for key, style in plan.items():
        if not key.startswith("layers.*."):
            continue  # embeddings: replicated here, as transformers' own plans mostly leave them
        if style in REPLICATED:
            continue
        if style not in STYLES and style not in EXPERT_STYLES:
            raise InputError("tp", f"transformers' tensor-parallel plan for {model_type} uses {style!r} "
                                   f"({key}), which the per-rank trace does not apply; estimate it with the formulas")
        out[key.removeprefix("layers.*.")] = style
    if not out:
        raise InputError("tp", f"transformers has no tensor-parallel plan for {model_type}")
    return out


def without_expert_rules(config: dict[str, Any], plan: dict[str, str]) -> dict[str, str]:
    """``plan`` (:func:`tp_plan`) less the rules on the modules the family's expert-parallel plan splits and their
    children, as transformers resolves a tensor- beside an expert-parallel plan: the routed experts run whole on their
    GPU (Megatron-LM's expert tensor parallelism of 1), the rest of the layer split over the tensor-parallel GPUs."""
    from ..core.configfile import transformers_kwargs
    from .meta import auto_config

    model_type, kwargs = transformers_kwargs(config)
    experts = [k.removeprefix("layers.*.") for k in getattr(auto_config(model_type, kwargs), "base_model_ep_plan",
                                                                   None) or {}]
    return {k: v for k, v in plan.items() if not any(k == e or k.startswith(e + ".") for e in experts)}


def process_group(kind: str, world: int, rank: int = 0) -> contextlib.AbstractContextManager[None]:
    """``fake``: :func:`fake_process_group` for the duration; ``current``: the process group this process runs in,
    which must span ``world`` ranks."""
    if kind == "fake":
        return fake_process_group(world, rank)
    import torch.distributed as dist

    if kind != "current" or not dist.is_initialized() or dist.get_world_size() != world:
        raise RuntimeError(f"a {world}-rank step needs the fake process group or a current one of {world} ranks")
    return contextlib.nullcontext()


@contextlib.contextmanager
def fake_process_group(world: int, rank: int = 0) -> Iterator[None]:
    """PyTorch's fake backend as the default process group for the duration (one process, no communication)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized in this process")
    hook = sys.excepthook  # init_process_group wraps it with a "[rank0]" prefix, and every later one wraps again
    _forget_sharding_plans()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
        _forget_sharding_plans()


def _forget_sharding_plans() -> None:
    """Empty DTensor's caches of sharding and redistribution plans (the Python and the fast-path one, as
    ``torch.distributed.tensor.debug._clear_sharding_prop_cache`` does, and the redistribution planner's). They are
    keyed by device meshes, which compare by their shape: a later trace's mesh of the same shape on another rank found
    the plans of an earlier one, which name that trace's destroyed process groups ("Could not resolve the process group
    registered under the name 8")."""
    import contextlib

    with contextlib.suppress(ImportError, AttributeError):
        from torch.distributed.tensor import debug

        debug._clear_sharding_prop_cache()  # type: ignore[no-untyped-call]
    with contextlib.suppress(ImportError, AttributeError):
        from torch.distributed.tensor import _redistribute

        _redistribute._gen_transform_infos.cache_clear()


def device_mesh(layout: RankLayout) -> Any:
    """The layout's mesh ``dp_replicate × dp_shard × cp × tp`` on the fake process group, built outside any fake
    mode."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp),
                            mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))


def parallelizer(config: dict[str, Any], layout: RankLayout, precision: str, mesh: Any, ddp: bool = False) -> Any:
    """The ``parallelize(model)`` callback over ``mesh`` (:func:`device_mesh`): apply the TP plan to every decoder
    layer, then FSDP2 over the data-parallel ranks, with the context-parallel ones (mixed precision: bf16 gathers,
    fp32 reduction, as torchtitan's defaults). ``ddp``: context-parallel ranks that hold the model whole
    (``replicate_context``) are wrapped in ``DistributedDataParallel`` over the data- and context-parallel ranks, which
    all-reduces their gradients (a real run; a trace takes DDP's buckets by rule, ``core.fitted``)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers.modeling_layers import GradientCheckpointingLayer

    plan = tp_plan(config) if layout.tp > 1 else {}
    if layout.ep > 1:  # transformers' rule: a module with an expert-parallel rule keeps no tensor-parallel one
        plan = without_expert_rules(config, plan)
    sharded_context = layout.cp > 1 and not layout.replicate_context
    dp_mesh = mesh["dp_shard", "cp"]._flatten("dp_shard_cp") if sharded_context else mesh["dp_shard"]
    if layout.hybrid:  # FSDP2's hybrid sharding: its 2-D mesh, replicas × shards (torchtitan's HSDP)
        import warnings

        with warnings.catch_warnings():  # torchtitan's slice of the flattened dim (torch 2.10 says it will change)
            warnings.filterwarnings("ignore", "Slicing a flattened dim", UserWarning)
            dp_mesh = mesh["dp_replicate", "dp_shard_cp" if sharded_context else "dp_shard"]
    tp_mesh, replicas = mesh["tp"], mesh["dp_replicate"]
    meshes = [dp_mesh, tp_mesh, replicas, mesh["cp"]]
    if layout.ep > 1:  # transformers' expert view of the same ranks: (efsdp, ep)
        r = layout.dp_replicate if layout.hybrid else 1  # FSDP2's hybrid sharding: (replicas, efsdp, ep)
        experts_mesh = init_device_mesh("cpu", (r, layout.world // (r * layout.ep), layout.ep),
                                        mesh_dim_names=("erep", "efsdp", "ep"))
        meshes += [experts_mesh["efsdp"], experts_mesh["ep"]]
        experts_dp = experts_mesh["erep", "efsdp"] if layout.hybrid else experts_mesh["efsdp"]
        meshes.append(experts_dp)
    # DDP's ranks beside a ring whose ranks hold the model whole: the data- and context-parallel ones
    ring_replicas = mesh["dp_replicate", "cp"]._flatten("dp_replicate_cp") \
        if ddp and layout.replicate_context and layout.cp > 1 else None
    if ring_replicas is not None:
        meshes.append(ring_replicas)
    for m in meshes:
        m.get_coordinate()  # computed now, with real tensors

    def apply(model: Any) -> Any:
        layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        experts: list[Any] = []
        if layout.ep > 1:  # first: the tensor-parallel split makes every parameter left whole a replicated DTensor
            experts = _split_experts(model, experts_mesh["ep"], tp_mesh)
        if plan:
            split_tensor_parallel(model, plan, tp_mesh, sequence=layout.sp, vocab=layout.loss_parallel)
        elif layout.ep > 1 and layout.fsdp_ranks == 1:
            _replicate_the_rest(model, replicas)  # one kind of parameter for the optimizer, as FSDP2 makes it
        if layout.fsdp_ranks > 1:
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
                if precision == "mixed" else MixedPrecisionPolicy()
            # torchtitan's placement of the routed experts: beside expert parallelism over their copies' ranks
            # (efsdp), else over the data-parallel ranks with the rest of each layer
            efsdp = layout.world // ((layout.dp_replicate if layout.hybrid else 1) * layout.ep)
            place = experts_placement(model, efsdp if layout.ep > 1 else dp_mesh.size(dp_mesh.ndim - 1), layout.ep)
            for module in experts:  # transformers' order: the experts over their copies first
                fully_shard(module, mesh=experts_dp, mp_policy=policy, reshard_after_forward=True,
                            shard_placement_fn=place)
            for layer in layers:
                fully_shard(layer, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=layout.reshard_after_forward,
                            shard_placement_fn=None if layout.ep > 1 else place)
            # the root as torchtitan wraps it: PyTorch's default, which keeps it gathered from its forward into the
            # backward that needs it at once (an explicit True would reshard it and gather it again)
            fully_shard(model, mesh=dp_mesh, mp_policy=policy,
                        reshard_after_forward=root_reshard(layout.reshard_after_forward))
        if ring_replicas is not None:
            from ..measure.distributed import ddp_parallelize

            if plan:  # DDP over plain tensors: PyTorch's step for DDP beside tensor parallelism
                from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform

                _pre_dp_module_transform(model)
            return ddp_parallelize(ring_replicas.get_group())(model)
        return None

    return apply


def experts_placement(model: Any, shards: int, ep: int = 1) -> Any:
    """torchtitan's placement of the routed experts' fused weights under FSDP2 (``torchtitan/distributed/fsdp.py``),
    ``fully_shard``'s ``shard_placement_fn``: along the first dimension (the expert, PyTorch's default) unless the
    GPUs that shard them times ``ep`` outnumber the experts; then along the second, ``Shard(1)``, where the first
    would leave whole experts on the first GPUs and nothing on the rest (Mixtral-8x7B under FSDP2 over 64 GPUs: 1/8 of
    the experts on the first GPU, not 1/64). ``None`` where the default holds. Call it once the model is split (its
    parameters are the ones ``fully_shard`` is then given)."""
    from torch.distributed.tensor import Shard

    from ..core.configfile import routed_experts
    from ..core.distributed import check_expert_shards

    text = getattr(model.config, "get_text_config", lambda: model.config)()
    experts = routed_experts(text.to_dict())
    if not experts or shards * ep <= experts:
        return None
    routed = {id(p) for name, p in model.named_parameters() if routed_name(name) and p.dim() >= 2}
    if not routed:
        return None
    # what fully_shard splits: each weight's local tensor (a tensor-parallel DTensor's own shard)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters() if id(p) in routed]
    check_expert_shards(shards, ep, experts, math.gcd(*(t.shape[1] for t in local)))

    def place(param: Any) -> Any:
        return Shard(1) if id(param) in routed else None

    return place


def root_reshard(reshard_after_forward: bool) -> bool | None:
    """``fully_shard``'s ``reshard_after_forward`` for the root module: ``None`` (PyTorch's default, torchtitan's: the
    root stays gathered after its forward, since the backward gathers it at once) where the layers reshard."""
    return None if reshard_after_forward else False


#: The trace's defaults for :func:`trace_rank` (two iterations, as the single-GPU trace runs).
STEP_DEFAULTS: dict[str, Any] = {"batch": 1, "seq": 128, "precision": "fp32", "optimizer": "adamw",
                                 "optimizer_impl": "foreach", "checkpointing": "none", "grad_accum": 1,
                                 "iterations": 2}


def _split_vocabulary(model: Any, mesh: Any, sequence: bool = False, first: bool = True, last: bool = True) -> None:
    """torchtitan's loss-parallel plan on a transformers model (or a pipeline stage of it: ``first`` holds the
    embedding, ``last`` the final norm and the head): the embedding's rows and the head's columns split, the logits
    left sharded for the loss (a tied head is tied again to the split embedding: both shard dim 0). With sequence
    parallelism the embedding reduce-scatters its output over the sequence and the head gathers its input, as
    torchtitan's plan does."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel as tp_api

    embed = model.get_input_embeddings() if first else None
    head = model.get_output_embeddings() if last else None
    tied = head is not None and embed is not None and head.weight is embed.weight
    stream = Shard(1) if sequence else Replicate()
    if embed is not None:
        tp_api.parallelize_module(embed, mesh, tp_api.RowwiseParallel(input_layouts=Replicate(),
                                                                      output_layouts=stream))
    if sequence and last:
        _final_norm_on_the_split(model, mesh)
    if head is None:
        return
    if tied:
        head.weight = embed.weight
        tp_api.parallelize_module(head, mesh, tp_api.PrepareModuleInputOutput(
            input_layouts=stream, desired_input_layouts=Replicate(), output_layouts=Shard(-1),
            desired_output_layouts=Shard(-1), use_local_output=False))
        return
    tp_api.parallelize_module(head, mesh, tp_api.ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1),
                                                                 use_local_output=False))


def split_tensor_parallel(model: Any, plan: dict[str, str], mesh: Any, *, sequence: bool = False, vocab: bool = False,
                          first: bool = True, last: bool = True, seq: int | None = None) -> None:
    """Tensor parallelism over ``mesh`` on a transformers model (or one pipeline stage of it: ``first`` holds the
    embedding, ``last`` the final norm and the head): every decoder layer split by ``plan`` (:func:`tp_plan`), the
    vocabulary too when ``vocab`` (torchtitan's loss parallel), torchtitan's sequence-parallel plan on top when
    ``sequence`` (the sequence ``seq`` tokens long, or as long as the input ids), everything else a replicated
    DTensor."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    for layer in [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]:
        _split_layer(layer, mesh, plan, sequence=sequence)
    if vocab:
        _split_vocabulary(model, mesh, sequence=sequence, first=first, last=last)
    elif sequence and last:
        _sequence_split_ends(model, mesh)
    _replicate_the_rest(model, mesh)
    if sequence and first and not vocab:
        _split_embedding_output(model, mesh)
    if sequence:
        _whole_sequence_positions(model, seq)


def _final_norm_on_the_split(model: Any, mesh: Any) -> None:
    from torch.distributed.tensor import parallel as tp_api

    norm = getattr(model.base_model, "norm", None)
    if norm is None:
        raise InputError("sp", f"the sequence-parallel trace needs a final norm named norm; "
                               f"{type(model.base_model).__name__} has none")
    tp_api.parallelize_module(norm, mesh, tp_api.SequenceParallel())


def _sequence_split_ends(model: Any, mesh: Any) -> None:
    """Sequence parallelism with the vocabulary whole (transformers' plans keep the embedding and head on every
    rank): the final norm on the rank's tokens, the head gathering them first."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel as tp_api

    _final_norm_on_the_split(model, mesh)
    head = model.get_output_embeddings()
    if head is not None:
        tp_api.parallelize_module(head, mesh, tp_api.PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True))


def _whole_sequence_positions(model: Any, seq: int | None = None) -> None:
    """The one adaptation sequence parallelism needs in transformers' models: they number the positions from the
    embedding's output, which is the rank's share of the sequence; the base model is given the positions of the
    whole sequence (``position_ids``, ``cache_position``: what it computes without sequence parallelism), so the
    rotary tables, the mask and the attention see every token, as torchtitan's model computes them."""
    import torch

    def positions(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        ids = kwargs.get("input_ids", args[0] if args else None)
        # a later pipeline stage gets the hidden states of the rank's tokens: the length is the layout's
        length = seq if seq is not None else ids.shape[1] if ids is not None else None
        source = ids if ids is not None else kwargs.get("inputs_embeds")
        if length is not None and source is not None and kwargs.get("position_ids") is None:
            kwargs["cache_position"] = torch.arange(length, device=source.device)
            kwargs["position_ids"] = kwargs["cache_position"].unsqueeze(0)
        return args, kwargs

    model.base_model.register_forward_pre_hook(positions, with_kwargs=True)


def _split_embedding_output(model: Any, mesh: Any) -> None:
    """The whole embedding's output cut to the rank's share of the sequence (a local slice: every rank has it all),
    PyTorch's ``PrepareModuleOutput`` from replicated to sequence-sharded."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel as tp_api

    tp_api.parallelize_module(model.get_input_embeddings(), mesh, tp_api.PrepareModuleOutput(
        output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True))


#: A decoder layer's modules under sequence parallelism: its two norms run on the rank's tokens, attention and the MLP
#: gather them (the names of transformers' llama-like layers).
SP_NORMS = ("input_layernorm", "post_attention_layernorm")
SP_BLOCKS = ("self_attn", "mlp")


def _split_layer(layer: Any, mesh: Any, plan: dict[str, str], sequence: bool = False) -> None:
    """One decoder layer split by its family's plan: its linear layers with PyTorch's ``ColwiseParallel`` and
    ``RowwiseParallel``, its experts (fused weights, which are parameters, not modules) with transformers' own
    styles; a plan entry the layer lacks (a dense MLP's, in an MoE layer) is skipped. ``sequence``: torchtitan's
    sequence-parallel plan on top (:class:`RankLayout`'s ``sp``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel as tp_api
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    modules, params = dict(layer.named_modules()), dict(layer.named_parameters())
    theirs = {k: v for k, v in plan.items() if k in params or v in EXPERT_STYLES}
    if sequence and not all(name in modules for name in SP_NORMS + SP_BLOCKS):
        raise InputError("sp", f"the sequence-parallel trace needs a llama-like decoder layer "
                               f"({', '.join(SP_NORMS + SP_BLOCKS)}); {type(layer).__name__} differs")
    # a mixture of experts (its routed experts split by transformers' tensor- or expert-parallel styles): its block
    # gives every rank the whole output (their all-reduce or all-gather), which sequence parallelism then cuts
    moe = sequence and any(name.split(".")[-1] == "experts" for name in modules if name.startswith("mlp."))
    for key, style in plan.items():
        if key not in theirs and key in modules:
            inside_moe = moe and key.startswith("mlp.")  # a shared expert's projection: the block's output is cut
            split = tp_api.RowwiseParallel(output_layouts=Shard(1)) if sequence and style == "rowwise" \
                and not inside_moe else getattr(tp_api, STYLES[style])()
            tp_api.parallelize_module(modules[key], mesh, split)
    if theirs:
        apply_tensor_parallelism(layer, mesh, {k: v for k, v in theirs.items() if k in params or k in modules})
    if sequence:
        for name in SP_NORMS:
            tp_api.parallelize_module(modules[name], mesh, tp_api.SequenceParallel())
        # attention takes its input by keyword in transformers' layers, the MLP by position
        tp_api.parallelize_module(modules["self_attn"], mesh, tp_api.PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=True))
        if moe:  # gathered in, as torchtitan's MoE plan; the whole output cut to the rank's tokens (a local slice)
            tp_api.parallelize_module(modules["mlp"], mesh, tp_api.PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True))
        else:
            tp_api.parallelize_module(modules["mlp"], mesh, tp_api.PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True))


#: The name this trace's balanced all-to-all is registered under in transformers' ``EPImplementationInterface``.
BALANCED_EP = "memcalc-balanced-all-to-all"


def _split_experts(model: Any, ep_mesh: Any, tp_mesh: Any) -> list[Any]:
    """Apply the family's ``base_model_ep_plan`` with transformers' ``apply_expert_parallelism``, the tokens reaching
    the experts through its all-to-all with balanced split sizes (see the module's docstring); the experts modules
    it split."""
    from transformers.distributed.expert_parallel import (
        AllToAllEP,
        EPImplementationInterface,
        apply_expert_parallelism,
    )

    plan_of_layer = getattr(model.config, "base_model_ep_plan", None) or {}
    if not plan_of_layer:
        raise InputError("ep", f"transformers has no expert-parallel plan for {model.config.model_type}")

    class BalancedAllToAll(AllToAllEP):  # type: ignore[misc]
        """transformers' all-to-all, its split sizes those of balanced routing (fake tensors hold no routing)."""

        def _dispatch_tokens(self, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
            from torch._subclasses.fake_tensor import FakeTensor

            ranks = self.ep_mesh.size()
            pairs = -(-hidden_states.size(0) // self.tp_mesh.size()) * top_k_index.size(-1)
            split = [pairs // ranks + (r < pairs % ranks) for r in range(ranks)]
            original = FakeTensor.tolist

            def sizes(t: Any) -> Any:  # the (sent, received) pairs per rank: the one read-back of the layer
                return [split, split] if tuple(t.shape) == (2, ranks) else original(t)

            FakeTensor.tolist = sizes  # type: ignore[method-assign]
            try:
                return super()._dispatch_tokens(hidden_states, top_k_index, top_k_weights)
            finally:
                FakeTensor.tolist = original  # type: ignore[method-assign]

    EPImplementationInterface.register(BALANCED_EP, BalancedAllToAll)
    prefix = model.base_model_prefix
    modules = dict(model.named_modules())
    plan: dict[str, str] = {}
    for key, style in plan_of_layer.items():
        head, _, tail = key.partition("*")  # "layers.*.mlp.experts" → every decoder layer's experts
        index = 0
        while f"{prefix}.{head}{index}" in modules:
            plan[f"{prefix}.{head}{index}{tail}"] = style
            index += 1
    apply_expert_parallelism(model, ep_mesh, tp_mesh, plan, ep_implementation=BALANCED_EP)
    return [modules[name] for name, style in plan.items() if style == "ep_dispatch_experts"]


def _replicate_the_rest(model: Any, mesh: Any) -> None:
    """Make every parameter the plan leaves whole (embeddings, norms, the head) a replicated DTensor, its module's
    tensor inputs and outputs converted at the boundary (``distribute_module``; no copy, no communication): one
    kind of parameter, so that foreach and fused optimizers take them all in one group, as on torchtitan's fully
    DTensor models."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor

    made: dict[int, Any] = {}  # a tied parameter stays one parameter

    def partition(_name: str, module: Any, device_mesh: Any) -> None:
        for key, param in list(module._parameters.items()):
            if param is not None and not isinstance(param, DTensor):
                if id(param) not in made:
                    made[id(param)] = torch.nn.Parameter(distribute_tensor(param.data, device_mesh, [Replicate()]),
                                                         requires_grad=param.requires_grad)
                module.register_parameter(key, made[id(param)])

    def inputs(_module: Any, args: Any, device_mesh: Any) -> Any:
        return tuple(DTensor.from_local(a, device_mesh, [Replicate()], run_check=False)
                     if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a for a in args)

    def outputs(_module: Any, out: Any, _mesh: Any) -> Any:
        if isinstance(out, tuple):  # a router's (logits, weights, indices)
            return tuple(o.to_local() if isinstance(o, DTensor) else o for o in out)
        return out.to_local() if isinstance(out, DTensor) else out

    for module in list(model.modules()):
        own = [p for p in module._parameters.values() if p is not None and not isinstance(p, DTensor)]
        if own:
            distribute_module(module, mesh, partition, inputs, outputs)


def trace_rank(config: dict[str, Any], layout: RankLayout, **step: Any) -> Any:
    """The step of ``config`` (``step``: :func:`~memcalc_gui.measure.cpu_step.measure_training_step`'s keywords) on
    rank 0 of ``layout``, traced on fake tensors; a :class:`~memcalc_gui.measure.cpu_step.StepMeasurement`. Under
    FSDP2, mixed precision is its ``MixedPrecisionPolicy`` (no autocast), as torchtitan runs it. Under context
    parallelism ``seq`` is the whole sequence, of which the rank runs ``seq/cp`` tokens with ring attention."""
    return run_rank(config, layout, **step)


def run_rank(config: dict[str, Any], layout: RankLayout, *, fake: bool = True, group: str = "fake",
             **step: Any) -> Any:
    """One rank of ``layout`` stepped, on fake tensors (``fake``) or real ones, over the fake process group
    (``group="fake"``) or the one this process already belongs to (``"current"``: one of the real ranks
    :mod:`memcalc_gui.measure.distributed` launches). The traced and the measured rank are the same code: the same
    mesh, the same parallelization, the same step; only a real ring whose ranks hold the model whole is wrapped in
    DDP as well, whose buckets the trace's ledger adds by rule (``core.fitted``, ``core.distributed``)."""
    from ..core.context import check_ring
    from ..measure import exclusive_torch_job
    from ..measure.cpu_step import measure_training_step
    from .context import RingNotRun, ring_attention
    from .fake import unpacked_sequences

    kw = STEP_DEFAULTS | {k: v for k, v in step.items() if k != "fake"}
    if layout.cp > 1:
        check_ring(int(kw["seq"]), layout.cp, str(kw.get("attention", "sdpa")))
        kw.update(seq=int(kw["seq"]) // layout.cp, attention="sdpa")  # the fused kernel the ring runs (flash too)
    with exclusive_torch_job(), process_group(group, layout.world), unpacked_sequences(), warnings.catch_warnings():
        # the causal LM returns a view of its logits; the step does no in-place op on it (not the user's concern)
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        mesh = device_mesh(layout)
        apply = parallelizer(config, layout, kw["precision"], mesh, ddp=not fake)
        ring = ring_attention(mesh["cp"]) if layout.cp > 1 else contextlib.nullcontext([1])
        with _loss_parallel(layout.loss_parallel), ring as calls:
            m = measure_training_step(config, fake=fake, parallelize=apply, autocast=layout.fsdp_ranks == 1, **kw)
    if not calls[0]:
        raise RingNotRun("cp", "the step never ran ring attention (its attention did not reach SDPA's fused "
                               "kernel); the formula stands alone")
    return m


def _loss_parallel(on: bool) -> contextlib.AbstractContextManager[None]:
    if not on:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()  # type: ignore[no-any-return]
