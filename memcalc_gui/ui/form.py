"""The form's state: what the user typed, as plain strings, and how it becomes a ``TrainingSetup``.

:class:`FormState` is what undo/redo restores and what the settings store (a preset name or a config
path, never the whole ``ModelSpec``). :func:`build_setup` turns it into a validated ``TrainingSetup``
through the core's parsers; every problem comes back as an ``InputError`` naming a form field.
No memory is computed here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ..core.distributed import (
    MAX_PARALLEL_GPUS,
    OFFLOADS,
    SCHEDULES,
    STRATEGIES,
    VIRTUAL_STAGES,
    VOCAB_SPLIT_ALWAYS,
    Parallelism,
    chosen_loss_parallel,
)
from ..core.errors import ConfigError, InputError, UnsupportedFamilyError
from ..core.finetune import MAX_RANK, TUNINGS, FineTuning
from ..core.model import (
    LITE_NOTE,
    ModelSpec,
    PresetInfo,
    load_config_file,
    preset_config,
    preset_info,
    preset_names,
    preset_source,
    preset_spec,
    spec_from_config,
    stored_count,
)
from ..core.setup import (
    ACTIVATION_OFFLOADS,
    DEFAULT_ALLOCATOR_RESERVE,
    DEFAULT_CUDA_CONTEXT_BYTES,
    GPU,
    LIMITS,
    LOSSES,
    TrainingSetup,
    gpu_presets,
)
from ..core.units import format_bytes, format_count, parse_count, parse_positive_int, parse_size

MODEL_KINDS: Final = ("preset", "config", "hub", "params")
#: The vocabulary-split box: the strategy's default (``core.distributed.default_loss_parallel``) until the user
#: ticks or clears it.
LOSS_PARALLEL_CHOICES: Final = ("auto", "true", "false")
#: The saved setup's format: 2 since the vocabulary split became the strategy's default ("auto"). A setup saved
#: before says "false" for a box nobody ticked (it was the default then), which is read as "auto".
STATE_VERSION: Final = 2
DEFAULT_PRESET: Final = "qwen2.5-1.5b"
DEFAULT_GPU: Final = "a100-80gb"

#: Precision presets of the design: (key, label, precision, optimizer).
RECIPES: Final = (
    ("fp32", "fp32", "fp32", "adamw"),
    ("mixed", "Mixed precision (6 B/param)", "mixed", "adamw"),
    ("adam8bit", "8-bit Adam (2 B/param of state)", "mixed", "adamw-8bit"),
    # the QLoRA paper's recipe (Dettmers et al. 2023, qlora.py): NF4 with double quantization, bf16 compute under
    # autocast, paged 32-bit AdamW, gradient checkpointing (peft's prepare_model_for_kbit_training turns it on)
    ("qlora", "QLoRA (4-bit base)", "mixed", "paged-adamw-32bit"),
)
#: Recipes that also choose how the model trains (and checkpointing): they match only that method.
RECIPE_TUNING: Final = {"qlora": "qlora"}


@dataclass(frozen=True)
class FormState:
    """Every input of the window as the user sees it (strings; choices by their core value)."""

    model_kind: str = "preset"
    preset: str = DEFAULT_PRESET
    config_path: str = ""
    hub_id: str = ""  # a Hugging Face Hub id (or a local model folder)
    params: str = "1.5B"
    batch: str = "4"
    seq: str = "2048"
    grad_accum: str = "4"
    precision: str = "mixed"
    optimizer: str = "adamw"
    optimizer_impl: str = "foreach"
    galore_rank: str = "128"  # GaLore's projection rank (optimizer galore-adamw)
    attention: str = "sdpa"
    loss: str = "full"
    loss_chunk: str = ""
    checkpointing: str = "none"
    use_cache: str = "false"  # "true": the loop keeps the config's use_cache=True
    optimizer_in_backward: str = "false"
    activation_offload: str = "none"
    packing: str = "false"  # "true": padding-free packing (core.setup.TrainingSetup.packing)
    tokens_per_batch: str = ""  # real tokens per micro-batch when packed; "" = batch × seq
    gpu: str = DEFAULT_GPU  # a preset id, or "" for a custom capacity
    capacity: str = ""
    cuda_context: str = format_bytes(DEFAULT_CUDA_CONTEXT_BYTES, digits=0)
    allocator_reserve: str = f"{DEFAULT_ALLOCATOR_RESERVE * 100:g} %"
    # multi-GPU (core.distributed.Parallelism); the defaults are one GPU, no sharding
    gpus: str = "1"
    strategy: str = "ddp"
    node_size: str = "8"
    ep: str = "1"
    etp: str = "1"  # Megatron-LM's expert tensor parallelism (read under its strategies only)
    tp: str = "1"  # tensor parallelism (core.layout)
    sp: str = "false"  # sequence parallelism beside tp
    loss_parallel: str = "auto"  # the vocabulary split beside tp: "auto" (the strategy's default), "true", "false"
    pp: str = "1"  # pipeline stages (core.pipeline)
    cp: str = "1"  # context parallelism (core.context)
    schedule: str = "1f1b"
    virtual_stages: str = "2"  # read under the interleaved schedule only
    reshard_after_forward: str = "true"  # FSDP2's reshard_after_forward
    dp_replicate: str = "1"  # FSDP2's hybrid sharding: replicas of sharded groups
    offload: str = "none"
    # fine-tuning (core.finetune.FineTuning); the LoRA fields apply to lora and qlora, trainable to frozen
    tuning: str = "full"
    lora_rank: str = "16"
    lora_targets: str = "all-linear"
    lora_dropout: str = "0.05"
    adapter_dtype: str = "fp32"
    quant: str = "nf4"
    double_quant: str = "true"
    prepare_kbit: str = "true"
    trainable: str = "last:4"

    def replace(self, **changes: Any) -> FormState:
        return dataclasses.replace(self, **{k: str(v) for k, v in changes.items()})

    def to_json(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any, version: int = STATE_VERSION) -> FormState:
        """Read a state saved in format ``version`` (:data:`STATE_VERSION`; an older one is brought up to date);
        unknown keys are ignored, wrong types raise ``ValueError``."""
        if not isinstance(data, dict):
            raise ValueError("saved setup is not an object")
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        bad = [k for k, v in values.items() if not isinstance(v, str)]
        if bad:
            raise ValueError(f"saved setup has non-text values for {bad}")
        if version < 2 and values.get("loss_parallel") == "false":
            values["loss_parallel"] = "auto"  # the old default, never chosen: the strategy's default now
        state = cls(**values)
        if state.loss_parallel not in LOSS_PARALLEL_CHOICES:
            raise ValueError(f"unknown loss parallel choice {state.loss_parallel!r}")
        if state.model_kind not in MODEL_KINDS:
            raise ValueError(f"unknown model kind {state.model_kind!r}")
        if state.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {state.strategy!r}")
        if state.offload not in OFFLOADS:
            raise ValueError(f"unknown offload {state.offload!r}")
        if state.schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {state.schedule!r}")
        if state.loss not in LOSSES:
            raise ValueError(f"unknown loss {state.loss!r}")
        if state.activation_offload not in ACTIVATION_OFFLOADS:
            raise ValueError(f"unknown activation offload {state.activation_offload!r}")
        if state.tuning not in TUNINGS:
            raise ValueError(f"unknown tuning {state.tuning!r}")
        return state

    def changed_fields(self, other: FormState) -> list[str]:
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]


def gpu_by_id() -> dict[str, GPU]:
    return {g.id: g for g in _gpus()}


_GPU_CACHE: list[GPU] = []


def _gpus() -> list[GPU]:
    if not _GPU_CACHE:
        _GPU_CACHE.extend(gpu_presets())
    return _GPU_CACHE


def capacity_text(gpu: GPU) -> str:
    """How a preset's capacity appears in the capacity field."""
    return format_bytes(gpu.capacity_bytes)


def default_state() -> FormState:
    """The built-in default: Qwen2.5-1.5B, micro-batch 4 × seq 2048 × accumulation 4, mixed precision
    AdamW (foreach), SDPA, no checkpointing, on an A100 80GB."""
    gpus = gpu_by_id()
    gpu = gpus.get(DEFAULT_GPU)
    if gpu is None:  # a trimmed GPU table: fall back to no verdict rather than fail
        return FormState(gpu="", capacity="")
    return FormState(capacity=capacity_text(gpu))


def recipe_for(precision: str, optimizer: str, tuning: str = "full") -> str | None:
    """The precision preset that ``precision`` + ``optimizer`` (and, for QLoRA's, ``tuning``) correspond to."""
    for key, _label, p, o in RECIPES:
        if key in RECIPE_TUNING and RECIPE_TUNING[key] != tuning:
            continue
        if (p, o) == (precision, optimizer):
            return key
    return None


# ---- parsing -----------------------------------------------------------------------------------
class FormErrors(Exception):
    """One or more fields are invalid; ``errors`` maps a form field to its reason."""

    def __init__(self, errors: dict[str, str]) -> None:
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))
        self.errors = errors


#: InputError.field (setup field, CLI flag or config key) → the form field that shows it.
_FIELD_MAP: Final = {
    "model": "preset",
    "preset": "preset",
    "params": "params",
    "config": "config_path",
    "model_id": "hub_id",
    "batch": "batch",
    "seq": "seq",
    "grad_accum": "grad_accum",
    "precision": "precision",
    "optimizer": "optimizer",
    "optimizer_impl": "optimizer_impl",
    "galore_rank": "galore_rank",
    "attention": "attention",
    "loss": "loss",
    "loss_chunk": "loss_chunk",
    "optimizer_in_backward": "optimizer_in_backward",
    "activation_offload": "activation_offload",
    "packing": "packing",
    "tokens_per_batch": "tokens_per_batch",
    "checkpointing": "checkpointing",
    "use_cache": "use_cache",
    "capacity": "capacity",
    "gpu": "gpu",
    "cuda_context": "cuda_context",
    "allocator_reserve": "allocator_reserve",
    "gpus": "gpus",
    "strategy": "strategy",
    "node_size": "node_size",
    "ep": "ep",
    "etp": "etp",
    "tp": "tp",
    "sp": "tp",  # the box beside the tensor-parallel field
    "loss_parallel": "loss_parallel",
    "pp": "pp",
    "cp": "cp",
    "schedule": "pp",  # the schedule and stages-per-GPU sit beside the pipeline field
    "virtual_stages": "pp",
    "reshard_after_forward": "reshard_after_forward",
    "dp_replicate": "dp_replicate",
    "offload": "offload",
    "parallel": "strategy",
    "tuning": "tuning",
    "lora_rank": "lora_rank",
    "lora_targets": "lora_targets",
    "lora_dropout": "lora_dropout",
    "adapter_dtype": "adapter_dtype",
    "quant": "quant",
    "double_quant": "double_quant",
    "prepare_kbit": "prepare_kbit",
    "trainable": "trainable",
}


def form_field(error: InputError, state: FormState) -> str:
    """The form field an ``InputError`` belongs to (config keys belong to the config path)."""
    if isinstance(error, ConfigError) and state.model_kind in ("config", "hub") and error.field not in ("preset",):
        return "config_path" if state.model_kind == "config" else "hub_id"
    if error.field == "model":
        return {"preset": "preset", "config": "config_path", "hub": "hub_id", "params": "params"}[state.model_kind]
    if error.field == "checkpointing" and state.checkpointing.startswith("every:"):
        return "ckpt_every"  # the every-N-th field made it
    if error.field == "checkpointing" and state.checkpointing == "selective":
        return "ckpt_selective"  # the per-op box made it
    return _FIELD_MAP.get(error.field, "general")


class FitNeeded(Exception):
    """The model's family has no block model in memcalc: the window estimates it with the fitted method
    (``core.fitted``), calibrated from the real transformers model in a worker."""

    def __init__(self, config: dict[str, Any], source: str, name: str) -> None:
        super().__init__(f"model_type {config.get('model_type')!r} needs the fitted method")
        self.config = config
        self.source = source
        self.name = name
        self.model_type = str(config.get("model_type"))[:40]


def fitted_config(setup: TrainingSetup) -> dict[str, Any] | None:
    """The config of a family without a block model that the fitted method estimates (``None`` otherwise): what the
    window's trace and measurement run."""
    needed = setup.extras.get("fit") if setup.model is None else None
    config = getattr(needed, "config", None)
    return config if isinstance(config, dict) else None


class HeuristicOnly(Exception):
    """A preset of a family without a block model in a build that cannot trace it: the heuristic from its stored
    parameter count, with the reason shown."""

    def __init__(self, config: dict[str, Any], count: int, reason: str) -> None:
        super().__init__(reason)
        self.count = count
        self.reason = reason
        self.model_type = str(config.get("model_type"))[:40]


def _unknown_family(config: dict[str, Any], source: str, name: str, error: UnsupportedFamilyError) -> Exception:
    """What a config of a family without a block model becomes: a fit request when PyTorch and transformers can
    trace it, else the error saying what would."""
    from ..trace.fake import trace_available

    if trace_available() and importlib.util.find_spec("transformers") is not None:
        return FitNeeded(config, source, name)
    count = stored_count(config)
    if count is not None:  # a preset: its stored count gives the heuristic, and the window says why
        return HeuristicOnly(config, count, LITE_NOTE.format(family=str(config.get("model_type"))[:40]))
    return ConfigError("model_type", f"{error.reason}; the full build (with PyTorch and transformers) estimates "
                                     "any transformers family from its real model")


class ModelCache:
    """Presets by name and config files by (path, mtime, size): typing never re-reads a file."""

    def __init__(self) -> None:
        self._presets: dict[str, ModelSpec] = {}
        self._files: dict[tuple[str, int, int], ModelSpec] = {}
        self._hub: dict[str, ModelSpec] = {}
        self._unknown: dict[Any, Exception] = {}  # families without a block model: what they become
        self._names: list[str] | None = None
        self._infos: dict[str, PresetInfo | None] = {}

    def names(self) -> list[str]:
        if self._names is None:
            self._names = preset_names()
        return self._names

    def groups(self) -> list[list[str]]:
        """Preset names grouped by family (families alphabetical, each smallest first): the preset list's order."""
        by_family: dict[str, list[tuple[int, str]]] = {}
        for name in self.names():
            info = self.info(name)
            if info is None:  # a broken preset file goes last rather than stopping the window
                by_family.setdefault("~", []).append((0, name))
                continue
            by_family.setdefault(info.family, []).append((info.num_params, name))
        return [[name for _n, name in sorted(items)] for _family, items in sorted(by_family.items())]

    def details(self) -> dict[str, str]:
        """Preset name → ``1.54B · qwen2`` (what the preset list shows beside each name; ``30.5B (3.35B active) ·
        qwen3_moe`` for a mixture of experts)."""
        out: dict[str, str] = {}
        for name in self.names():
            info = self.info(name)
            if info is None:  # a broken preset file shows no detail rather than stopping the window
                continue
            active = f" ({format_count(info.active_params)} active)" if info.active_params != info.num_params else ""
            out[name] = f"{format_count(info.num_params)}{active} · {info.family}"
        return out

    def info(self, name: str) -> PresetInfo | None:
        if name not in self._infos:
            try:
                self._infos[name] = preset_info(name)
            except Exception:  # a broken preset file: listed without details
                self._infos[name] = None
        return self._infos[name]

    def preset(self, text: str) -> ModelSpec:
        key = text.strip().lower()
        if not key:
            raise InputError("preset", "choose a preset (type to filter the list)")
        if key not in self._presets:
            if key not in self.names():
                matches = [n for n in self.names() if key in n]
                if len(matches) == 1:  # a unique prefix or part of a name is that preset
                    key = matches[0]
                elif matches:
                    raise InputError("preset", f"{len(matches)} presets match {text.strip()!r}: choose one")
                else:
                    raise InputError("preset", f"no preset matches {text.strip()!r}")
            if key in self._unknown:
                raise self._unknown[key]
            try:
                self._presets[key] = preset_spec(key)
            except UnsupportedFamilyError as exc:  # a preset of a family the fitted method estimates
                config = preset_config(key)
                self._unknown[key] = _unknown_family(config, preset_source(key, config), key, exc)
                raise self._unknown[key] from None
        return self._presets[key]

    def config(self, path_text: str) -> ModelSpec:
        text = path_text.strip()
        if not text:
            raise InputError("config", "open a config.json (button above, Ctrl+O, or drop one on the window)")
        path = Path(os.path.expanduser(text))
        try:
            st = path.stat()
        except OSError:
            raise InputError("config", f"{path} does not exist") from None
        key = (str(path.resolve()), st.st_mtime_ns, st.st_size)
        if key in self._unknown:
            raise self._unknown[key]
        if key not in self._files:
            if len(self._files) > 32:
                self._files.clear()
            config = load_config_file(path)
            try:
                self._files[key] = spec_from_config(config, source=str(path))
            except UnsupportedFamilyError as exc:
                name = str(config.get("_name_or_path") or path.parent.name)
                self._unknown[key] = _unknown_family(config, str(path), name, exc)
                raise self._unknown[key] from None
        return self._files[key]


    def hub(self, model_id: str) -> ModelSpec:
        """A Hub id's model from this machine only (a local folder or the Hugging Face cache): the window never
        goes to the network while the user types; "Fetch" downloads the config (:func:`..hub.resolve_config`)."""
        from ..hub import resolve_config

        key = model_id.strip()
        if key in self._unknown:
            raise self._unknown[key]
        if key not in self._hub:
            found = resolve_config(key, allow_network=False)
            if len(self._hub) > 32:
                self._hub.clear()
            try:
                self._hub[key] = spec_from_config(found.config, name=found.repo_id, source=found.source)
            except UnsupportedFamilyError as exc:
                self._unknown[key] = _unknown_family(found.config, found.source, found.repo_id, exc)
                raise self._unknown[key] from None
        return self._hub[key]


    def forget_hub(self, model_id: str) -> None:
        """Look ``model_id`` up again (a fetch just put it in the local cache)."""
        self._hub.pop(model_id.strip(), None)
        self._unknown.pop(model_id.strip(), None)


def _reserve_fraction(text: str) -> float:
    raw = text.strip().rstrip("%").strip()
    try:
        pct = float(raw)
    except ValueError:
        raise InputError("allocator_reserve", f"cannot read {text.strip()!r} as a percentage (try 10 %)") from None
    if not math.isfinite(pct) or not 0 <= pct < 100:
        raise InputError("allocator_reserve", f"must be a percentage in [0, 100), got {text.strip()!r}")
    return pct / 100


def _capacity(state: FormState) -> tuple[str | None, int | None]:
    text = state.capacity.strip()
    gpu = gpu_by_id().get(state.gpu) if state.gpu else None
    if not text:
        return (gpu.id if gpu else None), None
    if gpu is not None and text == capacity_text(gpu):
        return gpu.id, gpu.capacity_bytes  # the exact reported bytes, not the rounded text
    return (gpu.id if gpu else None), parse_size(text, "capacity")


def window_loss_parallel(strategy: str, choice: str, tp: int, block_model: bool = True) -> bool:
    """The vocabulary split the form asks for: the box's tick once the user made one (``choice`` "true" or "false"),
    else the strategy's default (``core.distributed.chosen_loss_parallel``); under Megatron-LM's strategies always, the
    box ticked and fixed whatever it said before; never without tensor parallelism (the box keeps its tick)."""
    if tp < 2:
        return False
    if strategy in VOCAB_SPLIT_ALWAYS:
        return block_model  # (the fitted method keeps it whole, and the result's warning says so)
    return chosen_loss_parallel({"true": True, "false": False}.get(choice), strategy, tp, block_model)


def build_setup(state: FormState, cache: ModelCache) -> TrainingSetup:
    """A validated ``TrainingSetup`` from the form, or :class:`FormErrors` naming every bad field."""
    errors: dict[str, str] = {}
    values: dict[str, Any] = {}
    fit: FitNeeded | None = None
    lite: dict[str, str] = {}

    def attempt(name: str, fn: Any) -> None:
        nonlocal fit
        try:
            values[name] = fn()
        except InputError as exc:
            errors.setdefault(form_field(exc, state), exc.reason)
        except FitNeeded as exc:  # a family without a block model: a parameter count now, the fitted method later
            fit = exc
            values["params"] = 1
        except HeuristicOnly as exc:
            values["params"] = exc.count
            lite.update(heuristic_reason=exc.reason, heuristic_model_type=exc.model_type)

    if state.model_kind == "preset":
        attempt("model", lambda: cache.preset(state.preset))
    elif state.model_kind == "config":
        attempt("model", lambda: cache.config(state.config_path))
    elif state.model_kind == "hub":
        attempt("model", lambda: cache.hub(state.hub_id))
    elif state.model_kind == "params":
        attempt("params", lambda: parse_count(state.params, "params"))
    else:
        errors["general"] = f"unknown model source {state.model_kind!r}"
    attempt("batch", lambda: parse_positive_int(state.batch, "batch", LIMITS["batch"]))
    attempt("seq", lambda: parse_positive_int(state.seq, "seq", LIMITS["seq"], tokens=True))
    attempt("grad_accum", lambda: parse_positive_int(state.grad_accum, "grad_accum", LIMITS["grad_accum"]))
    attempt("capacity", lambda: _capacity(state))
    attempt("cuda_context_bytes", lambda: parse_size(state.cuda_context, "cuda_context", allow_zero=True))
    attempt("allocator_reserve", lambda: _reserve_fraction(state.allocator_reserve))
    attempt("gpus", lambda: parse_positive_int(state.gpus, "gpus", MAX_PARALLEL_GPUS))
    attempt("node_size", lambda: parse_positive_int(state.node_size, "node_size", MAX_PARALLEL_GPUS))
    attempt("ep", lambda: parse_positive_int(state.ep or "1", "ep", MAX_PARALLEL_GPUS))
    # (read under Megatron-LM's strategies only: the field keeps its text while another is chosen)
    attempt("etp", lambda: parse_positive_int(state.etp or "1", "etp", MAX_PARALLEL_GPUS)
            if state.strategy.startswith("megatron") else 1)
    attempt("tp", lambda: parse_positive_int(state.tp or "1", "tp", MAX_PARALLEL_GPUS))
    attempt("pp", lambda: parse_positive_int(state.pp or "1", "pp", MAX_PARALLEL_GPUS))
    attempt("cp", lambda: parse_positive_int(state.cp or "1", "cp", MAX_PARALLEL_GPUS))
    # (read under FSDP2 only: the field keeps its text while another strategy is chosen)
    attempt("dp_replicate", lambda: parse_positive_int(state.dp_replicate or "1", "dp_replicate", MAX_PARALLEL_GPUS)
            if state.strategy == "fsdp2" else 1)
    attempt("virtual_stages", lambda: parse_positive_int(state.virtual_stages or "2", "virtual_stages", 4096)
            if state.schedule in VIRTUAL_STAGES else 1)
    attempt("tuning", lambda: tuning_from_state(state))
    attempt("loss_chunk", lambda: parse_positive_int(state.loss_chunk, "loss_chunk", LIMITS["seq"] * LIMITS["batch"])
            if state.loss_chunk.strip() and state.loss == "chunked" else None)
    attempt("galore_rank", lambda: parse_positive_int(state.galore_rank or "128", "galore_rank", 65_536)
            if state.optimizer == "galore-adamw" else 128)
    attempt("tokens_per_batch", lambda: parse_positive_int(state.tokens_per_batch, "tokens_per_batch",
                                                           LIMITS["seq"] * LIMITS["batch"], tokens=True)
            if state.tokens_per_batch.strip() and state.packing == "true" else None)
    if errors:
        raise FormErrors(errors)
    tp, pp, cp, virtual = values.pop("tp"), values.pop("pp"), values.pop("cp"), values.pop("virtual_stages")
    try:
        values["parallel"] = Parallelism(
            gpus=values.pop("gpus"),
            strategy=state.strategy,  # type: ignore[arg-type]
            node_size=values.pop("node_size"),
            ep=values.pop("ep"),
            etp=values.pop("etp"),
            tp=tp,
            pp=pp,
            cp=cp,
            # the schedule's fields keep their text while there is no pipeline
            schedule=state.schedule if pp > 1 else "1f1b",  # type: ignore[arg-type]
            virtual_stages=virtual if pp > 1 and state.schedule in VIRTUAL_STAGES else 1,
            sp=state.sp == "true" and tp > 1,  # the box keeps its tick while there is no tensor parallelism
            loss_parallel=window_loss_parallel(state.strategy, state.loss_parallel, tp,
                                               block_model=values.get("model") is not None),
            reshard_after_forward=state.reshard_after_forward != "false",
            offload=state.offload,  # type: ignore[arg-type]
            dp_replicate=values.pop("dp_replicate"),
        )
    except InputError as exc:
        raise FormErrors({form_field(exc, state): exc.reason}) from None
    gpu_id, capacity = values.pop("capacity")
    try:
        return TrainingSetup(
            precision=state.precision,  # type: ignore[arg-type]
            optimizer=state.optimizer,  # type: ignore[arg-type]
            optimizer_impl=state.optimizer_impl,  # type: ignore[arg-type]
            attention=state.attention,  # type: ignore[arg-type]
            loss=state.loss,  # type: ignore[arg-type]
            checkpointing=state.checkpointing,  # type: ignore[arg-type]
            use_cache=state.use_cache == "true",
            optimizer_in_backward=state.optimizer_in_backward == "true",
            activation_offload=state.activation_offload,  # type: ignore[arg-type]
            packing=state.packing == "true",
            gpu=gpu_id,
            capacity_bytes=capacity,
            extras={"fit": fit} if fit is not None else dict(lite),
            **values,
        )
    except InputError as exc:
        raise FormErrors({form_field(exc, state): exc.reason}) from None


def tuning_from_state(state: FormState) -> FineTuning:
    """The form's fine-tuning fields as a FineTuning (fields of other methods are ignored, not checked)."""
    if state.tuning == "full":
        return FineTuning()
    adapters = state.tuning in ("lora", "qlora")
    rank = parse_positive_int(state.lora_rank, "lora_rank", MAX_RANK) if adapters else 16
    dropout = 0.05
    if adapters:
        try:
            dropout = float(state.lora_dropout.strip().rstrip("%")) / (100 if "%" in state.lora_dropout else 1)
        except ValueError:
            raise InputError("lora_dropout", f"must be a probability such as 0.05, got {state.lora_dropout!r}") \
                from None
    targets = tuple(t.strip() for t in state.lora_targets.split(",") if t.strip()) if adapters else ("all-linear",)
    trainable = tuple(t.strip() for t in state.trainable.split(",") if t.strip()) if state.tuning == "frozen" else ()
    return FineTuning(method=state.tuning, rank=rank, targets=targets, dropout=dropout,  # type: ignore[arg-type]
                      adapter_dtype=state.adapter_dtype, quant=state.quant,  # type: ignore[arg-type]
                      double_quant=state.double_quant == "true", trainable=trainable,
                      prepare_kbit=state.prepare_kbit != "false")


def state_with_changes(state: FormState, changes: dict[str, Any]) -> FormState:
    """Apply a core ``Suggestion.changes`` (setup fields) to the form; unknown keys raise ``KeyError``."""
    names = {f.name for f in dataclasses.fields(FormState)}
    unknown = set(changes) - names
    if unknown:
        raise KeyError(f"cannot apply {sorted(unknown)} from the form")
    return state.replace(**{k: (",".join(v) if isinstance(v, (list, tuple)) else
                                str(v).lower() if isinstance(v, bool) else v) for k, v in changes.items()})
