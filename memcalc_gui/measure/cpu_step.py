"""Measure one training step of a Hugging Face causal LM on CPU, phase by phase, to the byte.

The model is built from a config dict with random weights, run for a few iterations under a
:class:`~memcalc_gui.measure.tracker.LiveStorageTracker`, and the last (steady-state) iteration is
reported: per phase the peak of live tensor bytes, the live bytes at the end of the phase and the
composition at the peak moment in the ledger's object names (``vocab.TENSOR_OBJECTS``).

Measurement conventions (decisions, keep them in mind when comparing with an estimate):

* Train mode, but every dropout probability in the config (keys containing ``drop``, e.g. gpt2's
  ``resid_pdrop``/``embd_pdrop``/``attn_pdrop``) is set to 0, so no dropout masks are stored.
* ``use_cache=False`` unless asked; input_ids are random in the vocabulary and ``labels = input_ids`` (same tensor).
* ``loss = model(...).loss`` (the output object is dropped at once); ``loss`` is deleted after
  backward; ``optimizer.zero_grad(set_to_none=True)`` ends the optimizer-step phase.
* Categories: ``parameters`` = parameter storages plus *all* module buffers (e.g. rotary
  ``inv_freq``, persistent or not: they are model state that does not scale with the batch) plus,
  under autocast, the 16-bit copies of weights (``_to_copy`` of a parameter, also reported as
  ``compute_copy_bytes``); ``gradients`` = storages that were some ``param.grad`` in the run;
  ``optimizer_state`` = tensors in ``optimizer.state`` (including the 4-byte ``step`` counters, which
  on CUDA live on the host unless fused/capturable); ``inputs`` = input_ids/labels; everything else
  by the phase that allocated it: forward → ``activations``, backward → ``temporaries``,
  optimizer step → ``optimizer_temporaries``, load → ``parameters``.
* Kernel-internal scratch buffers that never become an op output (e.g. inside a CPU attention
  kernel) are invisible to a dispatch mode and are not counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from memcalc_gui.core.finetune import FineTuning
from memcalc_gui.core.timeline import Timeline
from memcalc_gui.core.vocab import PHASES, TENSOR_OBJECTS
from memcalc_gui.measure import collect_garbage, frozen_heap
from memcalc_gui.measure.tracker import LiveStorageTracker, StorageRecord

if TYPE_CHECKING:
    import torch

PRECISIONS = ("fp32", "mixed", "bf16", "bf16-autocast")
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "adafactor", "lion", "adamw-8bit", "paged-adamw-8bit",
              "paged-adamw-32bit", "galore-adamw", "adamw-bf16-states")
OPTIMIZER_IMPLS = ("foreach", "single-tensor", "fused")
CHECKPOINTING = ("none", "full", "selective")
LOSSES = ("full", "chunked")
OFFLOADS = ("none", "checkpoint-inputs", "all")
#: torchtune's OffloadActivations leaves tensors under this many bytes on the device (``min_offload_size``).
OFFLOAD_MIN_BYTES = 1024
BUILDERS = ("auto", "transformers", "reference")
_PHASE_CATEGORY = {
    "load": "parameters",
    "forward": "activations",
    "backward": "temporaries",
    "optimizer_step": "optimizer_temporaries",
}
_TAGS = ("gradients", "optimizer_state", "parameters", "inputs")
_STATE_CATEGORIES = frozenset(_TAGS)
_TOP_N = 20


class UnsupportedOptimizerError(NotImplementedError):
    """The optimizer is known to the ledger but cannot be measured here yet."""


@dataclass(frozen=True)
class LiveStorage:
    """One storage alive at a phase peak (for debugging the analytic model)."""

    nbytes: int
    category: str
    op: str
    phase: str | None
    iteration: int
    micro: int
    dtype: str
    shape: tuple[int, ...]
    compute_copy: bool = False


@dataclass(frozen=True)
class PhaseMeasurement:
    """Peak and end-of-phase live bytes of one phase and the composition at the peak."""

    peak_bytes: int
    live_bytes: int
    objects: dict[str, int]
    compute_copy_bytes: int = 0
    #: Activations alive at the peak by the module that created them, largest first (when tracked).
    modules: tuple[tuple[str, int], ...] = ()
    #: Composition at the peak of everything but the model state (parameters with their 16-bit copies,
    #: gradients, optimizer state, inputs): what a sharded multi-GPU ledger adds to its own model state.
    transient_objects: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class IterationRecord:
    """Totals of one iteration, for the leak check."""

    index: int
    live_bytes_end: int
    peak_bytes: int
    phase_peaks: dict[str, int]


@dataclass(frozen=True)
class StepMeasurement:
    """The measured steady-state step: per phase, plus per-iteration totals."""

    device: str
    phases: dict[str, PhaseMeasurement]
    iterations: list[IterationRecord]
    params: int
    top_storages: dict[str, tuple[LiveStorage, ...]] = field(default_factory=dict)
    #: The most host memory the step held at once (offloaded activations); 0 without offloading.
    host_bytes: int = 0
    #: The live-storage tracker itself (records and event log), when asked for (``keep_tracker=True``).
    tracker: Any = field(default=None, compare=False, repr=False)

    @property
    def peak_bytes(self) -> int:
        """The highest phase peak."""
        return max(p.peak_bytes for p in self.phases.values())

    @property
    def peak_phase(self) -> str:
        """The phase holding the highest peak."""
        return max(self.phases, key=lambda name: self.phases[name].peak_bytes)


def measure_training_step(
    config: dict[str, Any],
    *,
    batch: int,
    seq: int,
    precision: str,
    optimizer: str = "adamw",
    optimizer_impl: str = "single-tensor",
    attention: str = "sdpa",
    checkpointing: str = "none",
    grad_accum: int = 1,
    iterations: int = 2,
    seed: int = 0,
    num_threads: int | None = 1,
    on_phase: Callable[[str, int, int], None] | None = None,
    fake: bool = False,
    round_to: int = 1,
    module_names: bool = False,
    builder: str = "auto",
    use_cache: bool = False,
    tuning: FineTuning | None = None,
    keep_tracker: bool = False,
    loss: str = "full",
    loss_chunk: int | None = None,
    optimizer_in_backward: bool = False,
    activation_offload: str = "none",
    parallelize: Callable[[Any], Any] | None = None,
    autocast: bool = True,
    documents: int | None = None,
    galore_rank: int = 128,
    galore_gap: int = 200,
    premade: Any = None,
    pipeline: Callable[[Any], Any] | None = None,
    settle: Callable[[], None] | None = None,
    settled: bool | tuple[str, ...] = False,
    warmup_micro_batches: int | None = None,
) -> StepMeasurement:
    """Build the model from ``config`` and measure ``iterations`` training steps on CPU.

    ``num_threads`` sets torch's intra-op threads for the run (restored after; ``None`` keeps
    the current value): byte counts do not depend on it and tiny models run fastest on one.
    ``on_phase(phase, iteration, micro)`` is called before each phase (progress; it may raise to cancel).
    ``fake=True`` runs everything under ``FakeTensorMode`` (device "cpu"): the same ledger without
    allocating or computing. ``round_to`` rounds every storage up (512 for the CUDA allocator) in the
    reported compositions; ``module_names`` attributes each storage to the module that created it.
    ``builder`` chooses how the model is built (see :func:`build_model`); ``use_cache`` keeps transformers'
    DynamicCache on in forward (a loop that leaves the config's default); ``tuning`` trains LoRA adapters (peft)
    or some parts only (see :func:`apply_tuning`). ``loss="chunked"`` computes the loss with the chunked fused
    linear cross-entropy (:mod:`.chunked_loss`, Liger's algorithm; ``loss_chunk`` rows per chunk, default Liger's).
    ``optimizer_in_backward`` steps each parameter as soon as its gradient is accumulated and frees the gradient
    (one optimizer per parameter, run from ``register_post_accumulate_grad_hook``: PyTorch's "optimizer step in
    backward" recipe, torchtune's ``optimizer_in_bwd``); the optimizer phase then has nothing left to do.
    ``activation_offload`` moves what the decoder body saves for backward to host memory (see :func:`offload_hooks`):
    ``all`` as ``torch.autograd.graph.save_on_cpu`` does, ``checkpoint-inputs`` as torchtune's OffloadActivations.
    ``parallelize(model)`` shards the built model in place, or returns the wrapper the step calls instead (DDP), one
    rank of :mod:`.distributed`; ``autocast=False`` runs
    mixed precision without autocast (FSDP2's MixedPrecisionPolicy casts the gathered weights instead). In a fake run
    the model is built and parallelized on the meta device first, outside the fake mode (a ``DeviceMesh`` computes its
    coordinates with real tensors), and materialized on fake storage in the load phase (``premade``).
    ``pipeline(model)`` makes the driver of a pipeline rank (:mod:`memcalc_gui.trace.pipeline`; ``parallelize`` has
    cut the model to the rank's stages): each step is then its schedule over ``grad_accum`` micro-batches of ``batch``
    rows, each forward, loss and backward of a micro-batch a window of its phase.
    ``settle()`` runs after each iteration's backward, outside every phase: a real rank's barrier, after which the
    collectives' worker threads have let go of the buffers of finished collectives (otherwise freed a moment later,
    now and then inside the step). ``settled``: each phase's peak is its lowest over the steady iterations (the second
    on), not the last one's: a real rank's gloo worker threads free a finished collective's buffers a moment after
    the step lets go of them, now and then inside the next phase (seen once in about twenty 2-rank FSDP2 steps of a
    small Mixtral, +9.5 % on one rank's optimizer step), while the steady iterations of a step otherwise agree. A
    tuple of phases: those only (the others differ between iterations, as a router's tokens do).
    ``warmup_micro_batches=n`` runs only the first n micro-batches in the first iteration (at least one): it creates
    the optimizer's state and whatever the step makes lazily, but its peaks are not the steady ones, which the later
    iterations give with all ``grad_accum`` micro-batches (a calibration's traces read the second iteration only,
    :mod:`memcalc_gui.trace.fit`; one micro-batch fewer there is about a fifth of a trace's ops).
    ``documents=n`` packs n documents into each row (``batch`` must be 1; padding-free packing as transformers'
    ``DataCollatorWithFlattening`` does it): ``position_ids`` restart at every document, from which transformers
    limits attention to each document. ``attention="flash"`` runs FlashAttention-2's variable-length attention as
    :mod:`.varlen_attention` reproduces it on CPU.
    """
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        if parallelize is not None:
            premade = _meta_parallelized(config, parallelize, precision=precision, attention=attention,
                                         builder=builder, use_cache=use_cache, checkpointing=checkpointing,
                                         tuning=tuning)
            parallelize = None
        with frozen_heap(collect=False), FakeTensorMode(allow_non_fake_inputs=True), _fake_module_moves(), \
                _fake_grouped_mm():
            return measure_training_step(
                config, batch=batch, seq=seq, precision=precision, optimizer=optimizer,
                optimizer_impl=optimizer_impl, attention=attention, checkpointing=checkpointing,
                grad_accum=grad_accum, iterations=iterations, seed=seed, num_threads=None,
                on_phase=on_phase, fake=False, round_to=round_to, module_names=module_names,
                builder=builder, use_cache=use_cache, tuning=tuning, keep_tracker=keep_tracker, loss=loss,
                loss_chunk=loss_chunk, optimizer_in_backward=optimizer_in_backward,
                activation_offload=activation_offload, parallelize=parallelize, autocast=autocast,
                documents=documents, galore_rank=galore_rank, galore_gap=galore_gap, premade=premade,
                pipeline=pipeline, settle=settle, warmup_micro_batches=warmup_micro_batches,
            )

    def announce(phase: str, it: int, micro: int = 0) -> None:
        if on_phase is not None:
            on_phase(phase, it, micro)

    _check_args(
        precision,
        optimizer,
        optimizer_impl,
        checkpointing,
        loss,
        grad_accum,
        iterations,
        batch,
        seq,
    )
    if activation_offload not in OFFLOADS:
        raise ValueError(f"activation_offload must be one of {OFFLOADS}, not {activation_offload!r}")
    if documents is not None and (batch != 1 or not 1 <= documents <= seq):
        raise ValueError(f"packed documents go in one row (batch 1) of at least as many tokens, not {documents} in "
                         f"{batch} × {seq}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from . import varlen_attention
    from .half_gemm import fast_half_gemm

    torch.manual_seed(seed)
    tracker = LiveStorageTracker()
    hooks: list[Any] = []
    threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    freeze = contextlib.ExitStack()
    if premade is not None:
        # to_empty makes each module's parameters anew, tied ones twice: tied again before the tracker starts, the
        # load phase holds the parameters once
        premade = premade.to_empty(device="cpu")
        if callable(getattr(premade, "tie_weights", None)):
            premade.tie_weights()
    try:
        if precision != "fp32":  # 16-bit products in fp32 where this CPU lacks them: same memory, faster
            freeze.enter_context(fast_half_gemm())
        with tracker:
            announce("load", 0)
            with tracker.phase("load", 0):
                runner = None  # what the step calls: the model, or the wrapper a parallelize callback returns (DDP)
                if premade is not None:  # built, checkpointed, tuned, parallelized and made real on fake storage
                    model = premade
                else:
                    model = build_model(config, precision=precision, attention=attention, builder=builder,
                                        use_cache=use_cache)
                    if checkpointing != "none":
                        enable_checkpointing(model, every=int(checkpointing[6:]) if checkpointing.startswith(
                            "every:") else 1, selective=checkpointing == "selective")
                    if tuning is not None and tuning.method != "full":
                        model = apply_tuning(model, tuning, config)
                    if parallelize is not None:
                        runner = parallelize(model)
                runner = runner if runner is not None else model
                stepper = pipeline(model) if pipeline is not None else None
                if stepper is not None and hasattr(stepper, "track"):
                    stepper.track = tracker.track  # gradients the schedule's stages hold outside .grad
                for p in model.parameters():
                    tracker.track(p, "parameters")
                for b in model.buffers():
                    tracker.track(b, "parameters")
                params = [p for p in model.parameters() if p.requires_grad]
            n_params = sum(p.numel() for p in model.parameters())
            if optimizer_in_backward and grad_accum > 1:
                raise ValueError("the optimizer step in backward cannot accumulate gradients (grad_accum must be 1)")
            per_param = {p: make_optimizer([p], optimizer, optimizer_impl) for p in params} \
                if optimizer_in_backward else {}
            opt = make_optimizer(params, optimizer, optimizer_impl, model, galore_rank, galore_gap) \
                if not optimizer_in_backward else None

            def tag_grad(param: torch.Tensor) -> None:
                if param.grad is not None:
                    tracker.track(param.grad, "gradients")
                if optimizer_in_backward:  # the step of this parameter, now; its gradient freed
                    step = per_param[param]
                    step.step()
                    for value in step.state[param].values():
                        if isinstance(value, torch.Tensor):
                            tracker.track(value, "optimizer_state")
                    step.zero_grad(set_to_none=True)

            hooks.extend(p.register_post_accumulate_grad_hook(tag_grad) for p in params)
            if module_names:
                hooks.extend(_module_hooks(model, tracker))
            if activation_offload != "none":
                hooks.extend(offload_hooks(model, tracker, activation_offload))
            vocab_size = int(model.config.vocab_size)
            rows = batch * grad_accum if stepper is not None else batch  # the schedule splits the step's rows
            input_ids = torch.randint(0, vocab_size, (rows, seq), dtype=torch.long)
            tracker.track(input_ids, "inputs")
            lengths = varlen_attention.document_lengths(seq, documents or 1)
            position_ids = None
            if documents is not None:
                position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
                tracker.track(position_ids, "inputs")

            def packed() -> contextlib.AbstractContextManager[None]:
                return varlen_attention.documents(lengths) if documents is not None else contextlib.nullcontext()
            collect_garbage()
            # what exists now (imports, the model, the optimizer) lives through the step: the per-iteration
            # collections then scan only what the step makes (a tenth of the time on a transformers model). Inside
            # a caller's freeze (measure.frozen_heap, a calibration's traces) that one stays.
            from torch._subclasses.fake_tensor import FakeTensor

            freeze.enter_context(frozen_heap(collect=False, again=isinstance(input_ids, FakeTensor)))  # collected above

            live_end: list[int] = []
            windows = grad_accum
            for it in range(1, iterations + 1):
                if stepper is not None:
                    announce("forward", it)
                    windows = stepper.step(input_ids, lambda name, micro, it=it: tracker.phase(name, it, micro))
                first = grad_accum if warmup_micro_batches is None or it > 1 else max(1, min(warmup_micro_batches,
                                                                                             grad_accum))
                for micro in range(first if stepper is None else 0):
                    announce("forward", it, micro)
                    with tracker.phase("forward", it, micro), packed():
                        value = step_forward(runner, input_ids, precision if autocast else "fp32", loss, loss_chunk,
                                             position_ids=position_ids)
                        if grad_accum > 1:
                            value = value / grad_accum
                    announce("backward", it, micro)
                    with tracker.phase("backward", it, micro), packed():
                        value.backward()  # type: ignore[no-untyped-call]
                        del value
                        for p in params:
                            if p.grad is not None:
                                tracker.track(p.grad, "gradients")
                if settle is not None:  # between the backward and the step (a real rank's collectives let go)
                    settle()
                announce("optimizer_step", it)
                with tracker.phase("optimizer_step", it):
                    if opt is not None:  # else each parameter was stepped in backward
                        opt.step()
                        for state in opt.state.values():
                            for value in optimizer_state_tensors(state):
                                tracker.track(value, "optimizer_state")
                        opt.zero_grad(set_to_none=True)
                collect_garbage()
                live_end.append(tracker.live_bytes)
        summary = _summarize(tracker, iterations, windows, n_params, live_end, round_to, settled)
        summary = dataclasses.replace(summary, host_bytes=tracker.host_peak_bytes)
        return dataclasses.replace(summary, tracker=tracker) if keep_tracker else summary
    finally:
        freeze.close()
        torch.set_num_threads(threads)
        for h in hooks:
            h.remove()
        tracker.close()


@contextlib.contextmanager
def _fake_module_moves() -> Iterator[None]:
    """Let ``Module.to`` convert fake parameters, as peft does when it moves adapters to the base layer's dtype.

    ``Module._apply`` always swaps fake parameters with ``torch.utils.swap_tensors``, which fake tensors refuse
    (torch 2.13: "Cannot swap t1 because it has weakref associated with it"). Inside a fake run the swap becomes
    ``param.data = new``: the same parameter object with the new dtype and storage, which is what the swap would
    leave for every reference the tracker and the optimizer hold. Real tensors keep torch's swap.
    """
    import torch

    original = torch.utils.swap_tensors

    def swap(t1: Any, t2: Any) -> None:
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(t1, FakeTensor) and isinstance(t2, torch.Tensor) and t1.shape == t2.shape:
            t1.data = t2.data
            return
        original(t1, t2)

    torch.utils.swap_tensors = swap  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.utils.swap_tensors = original  # type: ignore[assignment]


@contextlib.contextmanager
def _fake_grouped_mm() -> Iterator[None]:
    """Let fake tensors run ``torch._grouped_mm`` (transformers' default experts kernel) on fp32 weights.

    Its meta kernel accepts bf16 only ("Expected inputs of BF16 type"), while the CPU and CUDA fallback kernels run
    fp32 and fp16 too (checked on CPU, torch 2.13): inside a fake run the output is made as the meta kernel makes
    it (``_create_grouped_mm_output_tensor``: tokens × N in the input dtype) for those dtypes as well.
    """
    import torch
    from torch import _meta_registrations as meta

    original = getattr(meta, "_meta_grouped_mm_common", None)
    create = getattr(meta, "_create_grouped_mm_output_tensor", None)
    if original is None or create is None:  # another torch: leave it as it is
        yield
        return

    def relaxed(mat_a: Any, mat_b: Any, scale_a: Any, scale_b: Any, offs: Any = None, *args: Any,
                **kwargs: Any) -> Any:
        if scale_a is None and scale_b is None and mat_a.dtype == mat_b.dtype and \
                mat_a.dtype in (torch.float32, torch.float16):
            return create(mat_a, mat_b, offs, kwargs.get("out_dtype"))
        return original(mat_a, mat_b, scale_a, scale_b, offs, *args, **kwargs)

    meta._meta_grouped_mm_common = relaxed
    try:
        yield
    finally:
        meta._meta_grouped_mm_common = original


def _meta_parallelized(config: dict[str, Any], parallelize: Callable[[Any], Any], *, precision: str, attention: str,
                       builder: str, use_cache: bool, checkpointing: str, tuning: FineTuning | None) -> Any:
    """The model built on the meta device, checkpointed, tuned and parallelized there (for a fake run's ``premade``)."""
    import torch

    with torch.device("meta"):
        model = build_model(config, precision=precision, attention=attention, builder=builder, use_cache=use_cache)
    if checkpointing != "none":
        enable_checkpointing(model, every=int(checkpointing[6:]) if checkpointing.startswith("every:") else 1,
                             selective=checkpointing == "selective")
    if tuning is not None and tuning.method != "full":
        model = apply_tuning(model, tuning, config, device="meta")
    parallelize(model)
    return model


def build_model(
    config: dict[str, Any], *, precision: str = "fp32", attention: str = "sdpa", builder: str = "auto",
    use_cache: bool = False,
) -> Any:
    """A randomly initialised causal LM from a HF config dict, dropout 0, train mode, on CPU.

    ``builder``: ``"transformers"`` (``AutoModelForCausalLM.from_config``), ``"reference"`` (the built-in
    modules of :mod:`memcalc_gui.measure.reference`, llama-like families only) or ``"auto"``
    (transformers when it is importable, else the reference modules).
    """
    if builder not in BUILDERS:
        raise ValueError(f"builder must be one of {BUILDERS}, not {builder!r}")
    if builder == "reference" or (builder == "auto" and importlib.util.find_spec("transformers") is None):
        from memcalc_gui.measure.reference import build_reference_model

        return build_reference_model(config, precision=precision, attention=attention, dropout=0.0)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from ..core.configfile import transformers_kwargs
    from ..trace.meta import auto_config

    transformers.logging.set_verbosity_error()  # its warnings about a config's odd keys are not the user's output
    model_type, kwargs = transformers_kwargs(config)  # no auto_map or location keys: nothing a config names runs
    cfg = auto_config(model_type, kwargs)
    cfg.use_cache = use_cache
    for key, value in cfg.to_dict().items():
        if (
            "drop" in key
            and isinstance(value, int | float)
            and not isinstance(value, bool)
        ):
            setattr(cfg, key, 0.0)
    dtype = torch.bfloat16 if precision in ("bf16", "bf16-autocast") else torch.float32
    if attention == "flash":  # FlashAttention-2 needs CUDA: its CPU stand-in (same saved tensors)
        from .varlen_attention import register

        attention = register()
    try:
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            cfg, attn_implementation=attention, dtype=dtype, trust_remote_code=False
        )
    except ValueError as exc:
        if "scaled_dot_product_attention" in str(exc) and attention == "sdpa":
            from ..core.errors import InputError

            raise InputError("attention", f"transformers has no SDPA attention for model_type {cfg.model_type!r}: "
                                          "choose eager") from None
        raise
    model.train()
    return model


#: What the ledger of a mixture-of-experts model assumes about the experts' kernel.
EXPERTS_NOTE = ("Mixture of experts: transformers' default experts kernel (torch._grouped_mm: one output of "
                "tokens × top-k rows per projection), balanced routing as the random weights give it")
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def is_moe_config(cfg: dict[str, Any]) -> bool:
    """A mixture-of-experts config (any of the expert-count keys transformers' MoE configs use, above 1)."""
    return any(isinstance(cfg.get(k), int) and not isinstance(cfg.get(k), bool) and cfg[k] > 1 for k in _MOE_KEYS)


def quantize_model(model: Any, tuning: FineTuning, checkpointing: bool, device: str = "cpu") -> Any:
    """The QLoRA base as users build it: transformers loads the weights through bitsandbytes
    (``BitsAndBytesConfig``: 4-bit NF4/FP4 with or without double quantization, bf16 compute, or LLM.int8) and
    peft's ``prepare_model_for_kbit_training`` casts the rest to fp32 (unless ``tuning.prepare_kbit`` is off).
    The random model goes through a temporary folder, since transformers quantizes while loading."""
    import shutil
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    try:
        from peft import prepare_model_for_kbit_training
    except ImportError:
        raise NotImplementedError("QLoRA measurement needs peft and bitsandbytes: pip install 'memcalc-gui[lora]'") \
            from None
    if importlib.util.find_spec("bitsandbytes") is None:
        raise NotImplementedError("QLoRA measurement needs bitsandbytes: pip install 'memcalc-gui[lora]'")
    if tuning.quant == "int8":
        quant = BitsAndBytesConfig(load_in_8bit=True)
    else:
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=tuning.quant,
                                   bnb_4bit_use_double_quant=tuning.double_quant,
                                   bnb_4bit_compute_dtype=torch.bfloat16)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards", "Loading weights": not the user's output
    folder = tempfile.mkdtemp(prefix="memcalc-qlora-")
    try:
        model.save_pretrained(folder)
        del model
        collect_garbage()
        loaded = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant, trust_remote_code=False,
                                                      device_map="cpu" if device == "cpu" else {"": 0})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    loaded.train()
    if not tuning.prepare_kbit:  # the unquantized weights keep the checkpoint's dtype
        if checkpointing:
            enable_checkpointing(loaded)
        return loaded
    return prepare_model_for_kbit_training(loaded, use_gradient_checkpointing=checkpointing)


def apply_tuning(model: Any, tuning: FineTuning, config: dict[str, Any], device: str = "cpu") -> Any:
    """Freeze what ``tuning`` does not train: LoRA adds peft adapters (``get_peft_model``, adapters in fp32 as
    peft keeps them, or bf16 when asked); QLoRA first quantizes the base (:func:`quantize_model`); ``frozen``
    leaves only the named parts trainable."""
    from ..core.model import spec_from_config

    spec = spec_from_config(config)
    if tuning.method == "qlora":
        model = quantize_model(model, tuning, _checkpointing_on(model), device)
    if tuning.uses_adapters:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise NotImplementedError("LoRA measurement needs peft: pip install 'memcalc-gui[lora]'") from None
        names = sorted({lin.name.rsplit(".", 1)[-1] for lin in tuning.adapted(spec)})
        lora = LoraConfig(r=tuning.rank, lora_alpha=2 * tuning.rank, target_modules=names,
                          lora_dropout=tuning.dropout, task_type="CAUSAL_LM")
        wrapped = get_peft_model(model, lora, autocast_adapter_dtype=tuning.adapter_dtype == "fp32")
        if tuning.adapter_dtype == "bf16":
            import torch

            for name, param in wrapped.named_parameters():
                if "lora_" in name:
                    param.data = param.data.to(torch.bfloat16)
        return wrapped
    import torch

    for param in model.parameters():
        param.requires_grad_(False)
    n_layers = int(getattr(model.config, "num_hidden_layers", 0) or 0)
    layers = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n_layers), None)
    for part in tuning.trainable:
        text = part.strip().lower()
        if text.startswith("last:") and layers is not None:
            for layer in list(layers)[-int(text[5:]):]:
                layer.requires_grad_(True)
        elif text == "lm_head":
            model.get_output_embeddings().requires_grad_(True)
        elif text == "embeddings":
            model.get_input_embeddings().requires_grad_(True)
        elif text == "norms":
            for name, module in model.named_modules():
                if "norm" in type(module).__name__.lower() or name.endswith(("_layernorm", ".norm", "ln_f")):
                    module.requires_grad_(True)
    return model


def _checkpointing_on(model: Any) -> bool:
    """Whether activation checkpointing is on (transformers 5 renames ``is_gradient_checkpointing``)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name) or name in vars(model):
            return bool(getattr(model, name))
    return False


def enable_checkpointing(model: Any, every: int = 1, selective: bool = False) -> None:
    """Activation checkpointing (non-reentrant) of every decoder layer, or of every ``every``-th one (layers N, 2N, …
    counted from the first, as torchtitan's selective layer checkpointing picks them): transformers checkpoints a
    layer whose ``gradient_checkpointing`` is set, so the others are switched back off. ``selective``: torchtitan's
    per-op policy inside each checkpointed layer (:func:`op_sac_context`)."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if selective:
        kwargs["context_fn"] = op_sac_context
    enable = getattr(model, "activation_checkpointing_enable", None)
    # transformers 5 deprecates gradient_checkpointing_enable in favour of this name
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if every > 1:
        from transformers.modeling_layers import GradientCheckpointingLayer

        layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        for i, layer in enumerate(layers, start=1):
            layer.gradient_checkpointing = i % every == 0


#: torchtitan's per-op selective checkpointing keeps the outputs of these ops (its ``_op_sac_save_list``; the CPU
#: flash-attention kernel stands for its CUDA attention kernels) and recomputes the rest, matrix products excepted
#: every second one (counted within each layer's forward, so every layer keeps the same ones).
SAC_ATTENTION_OPS = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                     "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")


def op_sac_context() -> Any:
    """A fresh pair of selective-checkpoint contexts for one checkpointed call (``torch.utils.checkpoint``'s
    ``context_fn``): save the attention kernels' outputs and every other ``mm``'s, recompute the rest."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save = {getattr(torch.ops.aten, name).default for name in SAC_ATTENTION_OPS if hasattr(torch.ops.aten, name)}
    save.add(torch.ops.aten.max.default)
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            counts[mode] += 1
            return CheckpointPolicy.MUST_SAVE if counts[mode] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def make_optimizer(
    params: list[torch.nn.Parameter], name: str, impl: str, model: Any = None, galore_rank: int = 128,
    galore_gap: int = 200,
) -> torch.optim.Optimizer:
    """A ``torch.optim`` optimizer by ledger name and implementation (``galore-adamw`` needs the ``model``: its
    decoder attention and MLP linears get GaLore's low-rank projection, as Trainer's ``galore_adamw`` with
    ``optim_target_modules=["attn", "mlp"]``; the rest plain AdamW states; ``galore_gap`` steps between
    projection refreshes, Trainer's default 200)."""
    import torch

    if name == "galore-adamw":
        try:
            from galore_torch import GaLoreAdamW
        except ImportError:
            raise UnsupportedOptimizerError("galore-adamw needs the galore-torch package: pip install galore-torch") \
                from None
        targets = {id(p) for p in galore_targets(model)} if model is not None else set()
        low_rank = [p for p in params if id(p) in targets]
        rest = [p for p in params if id(p) not in targets]
        groups: list[dict[str, Any]] = [{"params": rest}] if rest else []
        if low_rank:  # Trainer's defaults: update_proj_gap 200, scale 0.25, proj_type std
            groups.append({"params": low_rank, "rank": galore_rank, "update_proj_gap": galore_gap, "scale": 0.25,
                           "proj_type": "std"})
        return GaLoreAdamW(groups, no_deprecation_warning=True)  # type: ignore[no-any-return]

    fused = True if impl == "fused" else None
    foreach = None if fused else impl == "foreach"
    if name == "adamw":
        return torch.optim.AdamW(params, foreach=foreach, fused=fused)
    if name == "adam":
        return torch.optim.Adam(params, foreach=foreach, fused=fused)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, foreach=foreach, fused=fused)
    if name == "sgd-momentum":
        return torch.optim.SGD(
            params, lr=1e-3, momentum=0.9, foreach=foreach, fused=fused
        )
    if name == "adafactor":
        if fused:
            raise UnsupportedOptimizerError(
                "torch.optim.Adafactor has no fused implementation"
            )
        return torch.optim.Adafactor(params, foreach=foreach)
    if name == "adamw-bf16-states":
        if fused:
            raise UnsupportedOptimizerError("the fused AdamW with bf16 states is Transformer Engine's FusedAdam "
                                            "(CUDA): measure foreach or single-tensor")
        from .anyprecision import make

        return make(params)  # type: ignore[no-any-return]
    if name in ("adamw-8bit", "paged-adamw-8bit", "paged-adamw-32bit"):
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise UnsupportedOptimizerError(
                f"{name} needs bitsandbytes: pip install bitsandbytes"
            ) from None
        cls = {"adamw-8bit": "AdamW8bit", "paged-adamw-8bit": "PagedAdamW8bit",
               "paged-adamw-32bit": "PagedAdamW32bit"}[name]
        return getattr(bnb.optim, cls)(params)  # type: ignore[no-any-return]
    raise UnsupportedOptimizerError(f"optimizer {name!r} cannot be measured yet")


def step_forward(model: Any, input_ids: torch.Tensor, precision: str, loss: str = "full",
                 loss_chunk: int | None = None, device: str = "cpu", half: Any = None,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The forward of one micro-batch and its loss (autocast to ``half``, bf16 by default, under mixed precision;
    the chunked loss of :mod:`.chunked_loss` when ``loss="chunked"``; ``position_ids`` of packed documents)."""
    import torch

    autocast = torch.autocast(device, dtype=half or torch.bfloat16) if precision in ("mixed", "bf16-autocast") \
        else contextlib.nullcontext()
    with autocast:
        if loss == "chunked":
            from .chunked_loss import chunked_causal_lm_loss

            hf = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wraps the model
            packed = {} if position_ids is None else {"position_ids": position_ids}
            hidden = hf.base_model(input_ids=input_ids, **packed).last_hidden_state
            value: torch.Tensor = chunked_causal_lm_loss(hidden, hf.get_output_embeddings().weight, input_ids,
                                                         loss_chunk)
            return value
        packed = {} if position_ids is None else {"position_ids": position_ids}  # the reference modules take none
        out: torch.Tensor = model(input_ids=input_ids, labels=input_ids, **packed).loss
        return out


def galore_targets(model: Any) -> list[Any]:
    """The weights GaLore projects: ``nn.Linear`` modules whose name contains ``attn`` or ``mlp`` (Trainer's
    ``optim_target_modules`` example), trainable."""
    import torch

    return [m.weight for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
            and ("attn" in name or "mlp" in name) and m.weight.requires_grad]


def optimizer_state_tensors(state: dict[str, Any]) -> list[Any]:
    """The tensors one parameter's optimizer state holds, GaLore's projection matrix included."""
    import torch

    out = []
    for value in state.values():
        if isinstance(value, torch.Tensor):
            out.append(value)
        ortho = getattr(value, "ortho_matrix", None)  # galore_torch's GaLoreProjector
        out.extend(t for t in (ortho if isinstance(ortho, list) else [ortho]) if isinstance(t, torch.Tensor))
    return out


def _check_args(
    precision: str,
    optimizer: str,
    impl: str,
    checkpointing: str,
    loss: str,
    grad_accum: int,
    iterations: int,
    batch: int,
    seq: int,
) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, not {optimizer!r}")
    if optimizer == "lion":
        raise UnsupportedOptimizerError(
            "Lion is not part of torch.optim; measure with adamw or install a Lion implementation"
        )
    if impl not in OPTIMIZER_IMPLS:
        raise ValueError(
            f"optimizer_impl must be one of {OPTIMIZER_IMPLS}, not {impl!r}"
        )
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, not {loss!r}")
    if checkpointing not in CHECKPOINTING and not (checkpointing.startswith("every:")
                                                   and checkpointing[6:].isdigit() and int(checkpointing[6:]) >= 1):
        raise ValueError(
            f"checkpointing must be one of {CHECKPOINTING} or every:N, not {checkpointing!r}"
        )
    for name, value in (
        ("grad_accum", grad_accum),
        ("iterations", iterations),
        ("batch", batch),
        ("seq", seq),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, not {value}")


def make_classifier(
    tracker: LiveStorageTracker,
) -> tuple[Callable[[StorageRecord], str], Callable[[StorageRecord], bool]]:
    """Category and compute-copy predicates for the tracker's records (after the run)."""
    records = tracker.records

    def is_compute_copy(rec: StorageRecord) -> bool:
        if rec.source_sid is None or rec.dtype not in ("bfloat16", "float16"):
            return False
        src = records.get(rec.source_sid)
        return src is not None and "parameters" in src.tags and src.dtype != rec.dtype

    def category_of(rec: StorageRecord) -> str:
        for tag in _TAGS:
            if tag in rec.tags:
                return tag
        if is_compute_copy(rec):
            return "parameters"
        return _PHASE_CATEGORY.get(rec.phase or "", "temporaries")

    return category_of, is_compute_copy


def timeline_from_tracker(tracker: LiveStorageTracker, source: str, round_to: int = 1) -> Timeline:
    """The tracker's event log as a :class:`~memcalc_gui.core.timeline.Timeline`: every allocation and free by
    ledger object (decided after the run), phase, module and op, sizes rounded up to ``round_to`` (512: the CUDA
    caching allocator), the phase windows as spans. FSDP2's storage resizes become allocations and frees."""
    from ..core.timeline import Span, Timeline, TimelineEvent

    category_of, _ = make_classifier(tracker)

    def rounded(n: int) -> int:
        return -(-n // round_to) * round_to if round_to > 1 else n

    events: list[TimelineEvent] = []
    opened: dict[tuple[str, int, int], int] = {}
    spans: list[Span] = []
    live_blocks: dict[int, list[tuple[int, int]]] = {}
    next_addr = 1 << 40
    for ev in tracker.events:
        if ev.kind == "begin" and ev.phase is not None:
            opened[(ev.phase, ev.iteration, ev.micro)] = len(events)
            continue
        if ev.kind == "end" and ev.phase is not None:
            start = opened.pop((ev.phase, ev.iteration, ev.micro), None)
            if start is not None:
                spans.append(Span(ev.phase, ev.iteration, start, len(events)))
            continue
        rec = tracker.records.get(ev.sid)
        if rec is None or ev.delta == 0:
            continue
        cat = category_of(rec)
        where = dict(phase=rec.phase or "", iteration=rec.iteration, module=rec.module or "",
                     op=rec.op.removeprefix("aten."))
        blocks = live_blocks.setdefault(ev.sid, [])
        if ev.kind == "alloc" or (ev.kind == "resize" and ev.delta > 0):
            # a storage grown in place (FSDP2's all-gather buffers) gets a block of its own
            next_addr += 4096
            addr = ev.sid * 4096 if ev.kind == "alloc" else next_addr
            blocks.append((addr, rounded(ev.delta)))
            events.append(TimelineEvent(rounded(ev.delta), cat, addr=addr, **where))  # type: ignore[arg-type]
            continue
        # a free releases every block of the storage; a shrink the latest
        for addr, size in (reversed(blocks) if ev.kind == "free" else blocks[-1:]):
            events.append(TimelineEvent(-size, cat, addr=addr, **where))  # type: ignore[arg-type]
        del blocks[(0 if ev.kind == "free" else -1):]
    return Timeline(tuple(events), source, tuple(spans), rounding=round_to)


def _summarize(
    tracker: LiveStorageTracker,
    iterations: int,
    grad_accum: int,
    n_params: int,
    live_end: list[int],
    round_to: int = 1,
    settled: bool | tuple[str, ...] = False,
) -> StepMeasurement:
    category_of, is_compute_copy = make_classifier(tracker)

    def rounded(n: int) -> int:
        return -(-n // round_to) * round_to if round_to > 1 else n

    windows = tracker.windows()

    def phase_windows(phase: str, it: int) -> list[tuple[int, int]]:
        micros = range(grad_accum) if phase in ("forward", "backward") else range(1)
        return [windows[(phase, it, m)] for m in micros if (phase, it, m) in windows]

    records: list[IterationRecord] = []
    for it in range(1, iterations + 1):
        peaks = {
            ph: max(tracker.peak(s, e).bytes for s, e in phase_windows(ph, it))
            for ph in PHASES[1:]
            if phase_windows(ph, it)
        }
        records.append(
            IterationRecord(it, live_end[it - 1], max(peaks.values()), peaks)
        )

    def iteration_of(ph: str) -> int:
        """The iteration whose windows give ``ph``'s peak: the last, or (``settled``) the steady one lowest in it."""
        if ph == "load":
            return 0
        steady = [r for r in records[1:] if ph in r.phase_peaks] \
            if settled is True or (isinstance(settled, tuple) and ph in settled) else []
        if not steady:
            return iterations
        return min(reversed(steady), key=lambda r: r.phase_peaks[ph]).index

    phases: dict[str, PhaseMeasurement] = {}
    top: dict[str, tuple[LiveStorage, ...]] = {}
    for ph in PHASES:
        wins = phase_windows(ph, iteration_of(ph))
        if not wins:
            continue
        peak = max((tracker.peak(s, e) for s, e in wins), key=lambda p: p.bytes)
        live = tracker.live_at(peak.index)
        objects = dict.fromkeys(TENSOR_OBJECTS, 0)
        copies = 0
        by_module: dict[str, int] = {}
        for sid, nbytes in live.items():
            rec = tracker.records[sid]
            size = rounded(nbytes)
            category = category_of(rec)
            objects[category] += size
            if is_compute_copy(rec):
                copies += size
            elif category == "activations" and rec.module is not None:
                by_module[rec.module] = by_module.get(rec.module, 0) + size
        end_live = tracker.events[wins[-1][1]].live_bytes
        peak_bytes = sum(objects.values()) if round_to > 1 else peak.bytes
        modules = tuple(sorted(by_module.items(), key=lambda kv: -kv[1]))

        def is_state(sid: int) -> bool:
            return category_of(tracker.records[sid]) in _STATE_CATEGORIES

        transient_peak = max((tracker.peak_excluding(s, e, is_state) for s, e in wins), key=lambda p: p.bytes)
        transient = dict.fromkeys(TENSOR_OBJECTS, 0)
        for sid, nbytes in tracker.live_at(transient_peak.index).items():
            transient[category_of(tracker.records[sid])] += rounded(nbytes)
        phases[ph] = PhaseMeasurement(peak_bytes, end_live, objects, copies, modules, transient)
        rows = [
            _live_storage(tracker.records[sid], n, category_of, is_compute_copy)
            for sid, n in live.items()
        ]
        rows.sort(key=lambda r: -r.nbytes)
        kept: list[LiveStorage] = []
        per_group: dict[tuple[str, bool], int] = {}
        # the largest _TOP_N of each category (weight copies apart), largest first
        for row in rows:
            group = (row.category, row.compute_copy)
            if per_group.get(group, 0) < _TOP_N:
                per_group[group] = per_group.get(group, 0) + 1
                kept.append(row)
        top[ph] = tuple(kept)
    return StepMeasurement("cpu", phases, records, n_params, top)


def offload_hooks(model: Any, tracker: LiveStorageTracker | None, mode: str) -> list[Any]:
    """Offload what the decoder body saves for backward to host memory while its forward runs.

    ``all``: every saved tensor, parameters included, is copied to the host and copied back when its backward node
    runs (``torch.autograd.graph.save_on_cpu``). ``checkpoint-inputs``: as torchtune's ``OffloadActivations``,
    parameters and tensors under 1 KiB stay; with checkpointing what is left to save is each layer's input. With a
    ``tracker`` (a CPU step) the host copy is a tracker-ignored clone and the copy back a tracked clone; without one
    (a CUDA step) the copies go to pinned host memory and back, synchronously (torchtune overlaps them on a side
    stream), and :func:`host_peak` reads the host bytes held. The hooks cover the decoder body only: the head and
    the loss run after it, as in torchtune, whose loss is outside the offloading context and needs its tensors at once.
    """
    import torch

    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = hf.base_model
    everything = mode == "all"

    def pack(tensor: torch.Tensor) -> Any:
        if not everything and (isinstance(tensor, torch.nn.Parameter)
                               or tensor.numel() * tensor.element_size() < OFFLOAD_MIN_BYTES):
            return (False, tensor)
        if tracker is None:
            copy = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
            copy.copy_(tensor)
            _HOST.add(copy)
            return (tensor.device, copy)
        with tracker.host():
            copy = tensor.detach().clone()
        tracker.add_host(copy)
        return (True, copy)

    def unpack(packed: Any) -> torch.Tensor:
        where, tensor = packed
        if where is False:
            return tensor  # type: ignore[no-any-return]
        return tensor.clone() if where is True else tensor.to(where)  # type: ignore[no-any-return]

    contexts: list[Any] = []

    def enter(*_: Any) -> None:
        ctx = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        ctx.__enter__()
        contexts.append(ctx)

    def leave(*_: Any) -> None:
        if contexts:
            contexts.pop().__exit__(None, None, None)

    return [body.register_forward_pre_hook(enter), body.register_forward_hook(leave, always_call=True)]


class _HostBytes:
    """Live and peak bytes of the pinned host copies a CUDA step's offloading made (freed with their packs)."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def add(self, tensor: Any) -> None:
        import weakref

        size = tensor.untyped_storage().nbytes()
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor.untyped_storage(), self._free, size).atexit = False

    def _free(self, size: int) -> None:
        self.live -= size


_HOST = _HostBytes()


def host_peak(reset: bool = False) -> int:
    """The most pinned host memory the CUDA step's offloading held (``reset``: start counting again)."""
    if reset:
        _HOST.peak = _HOST.live
    return _HOST.peak


def _module_hooks(model: Any, tracker: LiveStorageTracker) -> list[Any]:
    """Forward pre/post hooks that keep ``tracker.module_stack`` on the running module's name."""
    names = {id(m): name or type(m).__name__ for name, m in model.named_modules()}

    def push(module: Any, *_: Any) -> None:
        tracker.module_stack.append(names.get(id(module), type(module).__name__))

    def pop(module: Any, *_: Any) -> None:
        if tracker.module_stack:
            tracker.module_stack.pop()

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(push))
        handles.append(module.register_forward_hook(pop, always_call=True))
    return handles


def _live_storage(
    rec: StorageRecord,
    nbytes: int,
    category_of: Callable[[StorageRecord], str],
    is_compute_copy: Callable[[StorageRecord], bool],
) -> LiveStorage:
    return LiveStorage(
        nbytes=nbytes,
        category=category_of(rec),
        op=rec.op.removeprefix("aten."),
        phase=rec.phase,
        iteration=rec.iteration,
        micro=rec.micro,
        dtype=rec.dtype,
        shape=rec.shape,
        compute_copy=is_compute_copy(rec),
    )


def top_storages(
    measurement: StepMeasurement,
    phase: str,
    n: int = 10,
    categories: Collection[str] | None = None,
) -> list[LiveStorage]:
    """The ``n`` largest storages alive at ``phase``'s peak, optionally of some categories only.

    ``categories`` may name ``"compute_copy"`` for the 16-bit weight copies. At most the 20 largest
    of each category are kept in a measurement.
    """
    rows = measurement.top_storages.get(phase, ())
    if categories is None:
        return list(rows[:n])
    return [
        r
        for r in rows
        if r.category in categories or (r.compute_copy and "compute_copy" in categories)
    ][:n]


#: What is neither weights, optimizer state nor inputs: what a step adds on top of the model.
TRANSIENT = (
    "gradients",
    "optimizer_temporaries",
    "activations",
    "temporaries",
    "compute_copy",
)


def format_top_storages(
    measurement: StepMeasurement,
    phase: str,
    n: int = 10,
    categories: Collection[str] | None = None,
) -> str:
    """The ``n`` largest storages alive at ``phase``'s peak as a text table (``*`` = 16-bit weight copy)."""
    rows = top_storages(measurement, phase, n, categories)
    lines = [
        f"{'bytes':>14}  {'category':<22}{'created in':<22}{'op':<40}{'dtype':<10}shape"
    ]
    for s in rows:
        where = f"{s.phase}#{s.iteration}" + (f".{s.micro}" if s.micro else "")
        cat = s.category + ("*" if s.compute_copy else "")
        lines.append(
            f"{s.nbytes:>14,}  {cat:<22}{where:<22}{s.op:<40}{s.dtype:<10}{list(s.shape)}"
        )
    return "\n".join(lines)


def format_measurement(
    measurement: StepMeasurement,
    top: int = 0,
    categories: Collection[str] | None = None,
) -> str:
    """Per-phase peaks and compositions (and optionally the top storages) as text."""
    lines = [
        f"params: {measurement.params:,}   peak: {measurement.peak_bytes:,} B in {measurement.peak_phase}"
    ]
    for name, ph in measurement.phases.items():
        parts = ", ".join(f"{k}={v:,}" for k, v in ph.objects.items() if v)
        extra = (
            f" (16-bit weight copies {ph.compute_copy_bytes:,})"
            if ph.compute_copy_bytes
            else ""
        )
        lines.append(
            f"{name:<15} peak {ph.peak_bytes:>14,}  end {ph.live_bytes:>14,}  [{parts}]{extra}"
        )
        if top and top_storages(measurement, name, top, categories):
            lines.append(format_top_storages(measurement, name, top, categories))
    lines.append(
        "iterations (live at end): "
        + ", ".join(f"{r.index}:{r.live_bytes_end:,}" for r in measurement.iterations)
    )
    return "\n".join(lines)
