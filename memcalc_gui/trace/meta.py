"""Exact parameter counts from transformers on the meta device, for families the core does not model.

torch and transformers are imported inside the functions only (the window starts without them).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core import cachefile
from ..core.configfile import routed_experts, transformers_kwargs, without_nulls
from ..core.errors import ConfigError
from ..core.fitted import structure_problem


def transformers_available() -> bool:
    """True when both torch and transformers can be imported (without importing them)."""
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


def count_params_on_meta(config: dict[str, Any]) -> int:
    """``sum(p.numel())`` of ``AutoModelForCausalLM.from_config`` built on the meta device (no memory, offline)."""
    return count_params_and_active_on_meta(config)[0]


#: Config keys of the routed experts per token (transformers' MoE configs; the experts per layer: EXPERT_KEYS).
_TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k")


def routed_name(name: str) -> bool:
    """Whether a parameter (or module) of transformers' name ``name`` belongs to the routed experts
    (``….experts.*``; a shared expert is ``shared_expert(s).*``, not routed): what expert parallelism splits and
    torchtitan's FSDP2 placement (``trace.ranks.experts_placement``) shards apart."""
    return ".experts." in f".{name}."


def count_params_and_active_on_meta(config: dict[str, Any]) -> tuple[int, int]:
    """Total parameters, and those one token uses: a mixture-of-experts layer's routed experts
    (``….experts.*``, the shared experts apart) count ``top_k / num_experts`` of their size."""
    counts = structure_on_meta(config)
    return counts["num_params"], counts["active_params"]


def structure_on_meta(config: dict[str, Any]) -> dict[str, int]:
    """The counts a per-GPU budget needs, from the model transformers builds on the meta device:
    ``num_params``, ``active_params`` (see :func:`count_params_and_active_on_meta`), ``layer_params`` (the largest
    decoder layer: the unit FSDP wraps), ``largest_module`` (the most parameters one module holds itself, what
    DeepSpeed's ZeRO-3 estimator gathers at once), ``root_unit`` (what no decoder layer holds: embeddings, final
    norm, LM head), ``expert_params`` (the routed experts), ``num_experts`` and ``top_k``, ``hidden_size``, and for
    expert parallelism ``layer_expert_params`` (one layer's routed experts), ``largest_expert_module`` and
    ``largest_dense_module`` (the largest module outside the routed experts), ``expert_dim1_gcd`` (the greatest
    common divisor of the routed experts' fused weights' second dimensions: what FSDP2 must split evenly where
    torchtitan shards them along it; 0 without routed experts). Memoised per config in the process:
    a layout search asks for the same few configs' counts hundreds of times, and each build of a mixture of experts
    on the meta device takes a tenth of a second or more."""
    try:
        key = json.dumps(config, sort_keys=True, default=str)
    except (TypeError, ValueError):  # a config JSON cannot hold (a test's object): counted each time
        return _structure_now(config)
    with _STRUCTURES_LOCK:
        found = _STRUCTURES.get(key)
    if found is None:
        found = _stored_structure(key)
    if found is None:
        found = _structure_now(config)
        _store_structure(key, found)
    with _STRUCTURES_LOCK:
        if key not in _STRUCTURES:
            if len(_STRUCTURES) >= _STRUCTURES_KEPT:
                _STRUCTURES.pop(next(iter(_STRUCTURES)))
            _STRUCTURES[key] = found
    return dict(found)


#: The counts :func:`structure_on_meta` gives, each a whole number (a stored file without all of them is counted
#: again).
STRUCTURE_KEYS = ("num_params", "active_params", "layer_params", "largest_module", "root_unit", "expert_params",
                  "num_experts", "top_k", "hidden_size", "layer_expert_params", "largest_expert_module",
                  "largest_dense_module", "expert_dim1_gcd")


def answer_path(key: str) -> Path:
    """Where an answer transformers gave for ``key`` is kept on disk (a config's counts; ``sdpa:…``, ``narrower:…``),
    in a folder beside the fits: keyed with the transformers that gave it and this memcalc, so a warm estimate of a
    family without a block model imports neither torch nor transformers (6.5 s of a Mixtral estimate, 2 cores).
    Each file is sealed (:func:`store_answer`)."""
    from .. import __version__
    from .fit import cache_dir

    text = json.dumps({"config": key, "transformers": package_version("transformers"), "memcalc": __version__,
                       "format": 1}, sort_keys=True)
    return cache_dir() / "structures" / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"


def answer_kind(key: str) -> str:
    """The kind of answer kept for ``key`` (the envelope's ``kind``, checked on read): ``sdpa``, ``narrower`` or
    ``structure`` (a config's counts)."""
    return "sdpa" if key.startswith("sdpa:") else "narrower" if key.startswith("narrower:") else "structure"


def _answer_versions() -> dict[str, Any]:
    from .. import __version__

    return {"memcalc": __version__, "transformers": package_version("transformers")}


def stored_answer(key: str, check: Callable[[Any], None], legacy: Callable[[Any], bool]) -> Any:
    """The answer kept for ``key`` (:func:`answer_path`), or ``None``: none kept, stale (another memcalc or
    transformers, or a file from before the envelope that ``legacy`` recognises: asked again silently), or damaged
    (set aside with one notice, ``core.cachefile``). ``check`` raises ``ValueError`` for a payload that cannot be
    true. JSON only: nothing in the file runs."""
    path = answer_path(key)
    return cachefile.read_sealed(path, kind=answer_kind(key), key=path.stem, versions=_answer_versions(),
                                 what="the cached answer of transformers", check=check, legacy=legacy,
                                 redo="it is asked again")


def store_answer(key: str, payload: dict[str, Any], check: Callable[[Any], None] | None = None) -> bool:
    """Keep ``payload`` for ``key``, sealed (its kind, its name's key and the versions, with a checksum), whole or
    not at all; a read-only cache costs a build next time and one notice (``core.cachefile.write_sealed``). An
    answer its reader's ``check`` would refuse is not kept (asked again next time rather than set aside as damaged
    on every run)."""
    if check is not None:
        try:
            check(payload)
        except (ValueError, TypeError, KeyError):
            return False
    path = answer_path(key)
    return cachefile.write_sealed(path, kind=answer_kind(key), key=path.stem, versions=_answer_versions(),
                                  payload=payload, what="the cached answer of transformers")


def _check_structure(payload: Any) -> None:
    if not isinstance(payload, dict) or set(payload) != set(STRUCTURE_KEYS):
        raise ValueError("it does not hold a config's counts")
    problem = structure_problem(payload)
    if problem is not None:
        raise ValueError(f"its counts are inconsistent: {problem}")


def _legacy_structure(data: dict[str, Any]) -> bool:
    return set(data) <= set(STRUCTURE_KEYS) and all(type(v) is int for v in data.values()) and bool(data)


def _stored_structure(key: str) -> dict[str, int] | None:
    """The counts kept for ``key``, or ``None`` (none kept, stale, or damaged: counted again; a damaged file is set
    aside with one notice). The counts must be whole numbers consistent with one another
    (``core.fitted.structure_problem``)."""
    data = stored_answer(key, _check_structure, _legacy_structure)
    return {k: int(data[k]) for k in STRUCTURE_KEYS} if data is not None else None


def _store_structure(key: str, counts: dict[str, int]) -> None:
    """Keep ``counts`` for ``key`` (:func:`store_answer`)."""
    store_answer(key, counts, _check_structure)


def write_whole_json(path: Path, data: dict[str, Any]) -> bool:
    """``data`` (plain JSON, no envelope) at ``path`` whole or not at all: ``core.files.atomic_write``, its
    temporary file removed on any failure (a full disk, a folder at ``path``, no permission); ``False`` and one
    notice per folder when it cannot be written. memcalc's own cache files are sealed (:func:`store_answer`)."""
    return cachefile.write_bytes(path, json.dumps(data).encode())


@functools.lru_cache(maxsize=16)
def _distribution_version(module: str) -> str | None:
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_version(module: str) -> str:
    """``module.__version__`` without importing it where it is not loaded yet (its installed distribution's
    version, the same string for torch and transformers); imported where no distribution says (a frozen app)."""
    loaded = sys.modules.get(module)
    if loaded is not None:
        return str(getattr(loaded, "__version__", ""))
    found = _distribution_version(module)
    return found if found is not None else str(getattr(importlib.import_module(module), "__version__", ""))


#: :func:`structure_on_meta`'s counts by config, the oldest dropped first past this many.
_STRUCTURES_KEPT = 64
_STRUCTURES: dict[str, dict[str, int]] = {}
_STRUCTURES_LOCK = threading.Lock()


def _structure_now(config: dict[str, Any]) -> dict[str, int]:
    model = _build_on_meta(config)
    total = int(sum(p.numel() for p in model.parameters()))
    layers = max((m for m in model.modules() if type(m).__name__ == "ModuleList"), key=len, default=None)
    layer_sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers] if layers is not None else [0]
    experts = routed_experts(config)
    top_k = next((int(config[k]) for k in _TOP_K_KEYS if isinstance(config.get(k), int) and config[k] > 0), 0)
    moe = bool(experts and top_k)

    def routed(name: str) -> bool:
        return moe and routed_name(name)

    own = [(name, sum(p.numel() for p in m.parameters(recurse=False))) for name, m in model.named_modules()]
    expert_params = int(sum(p.numel() for name, p in model.named_parameters() if routed(name)))
    layer_experts = [sum(p.numel() for name, p in layer.named_parameters() if routed(name))
                     for layer in layers] if layers is not None else [0]
    # what FSDP2's Shard(1) of the routed experts must split evenly (every fused weight's second dimension)
    second = [p.shape[1] for name, p in model.named_parameters() if routed(name) and p.dim() >= 2]
    active = total - expert_params + expert_params * min(top_k, experts) // experts if moe else total
    return {"num_params": total, "active_params": int(active), "layer_params": int(max(layer_sizes)),
            "largest_module": int(max(n for _name, n in own)), "root_unit": total - int(sum(layer_sizes)),
            "expert_params": expert_params, "num_experts": experts if expert_params else 0,
            "top_k": top_k if expert_params else 0, "hidden_size": int(getattr(model.config, "hidden_size", 0) or 0),
            "layer_expert_params": int(max(layer_experts)),
            "largest_expert_module": int(max((n for name, n in own if routed(name)), default=0)),
            "largest_dense_module": int(max(n for name, n in own if not routed(name))),
            "expert_dim1_gcd": math.gcd(*second) if second else 0}


def auto_config(model_type: str, kwargs: dict[str, Any]) -> Any:
    """``AutoConfig.for_model`` with the config's nulls, else without them (a class that rejects an explicit null
    takes its default); transformers' own error when it rejects the config either way."""
    import transformers

    try:
        return transformers.AutoConfig.for_model(model_type, **kwargs)
    except Exception:  # a config class rejects some value: the nulls are the usual cause
        cleaned = without_nulls(kwargs)
        if cleaned == kwargs:
            raise
        return transformers.AutoConfig.for_model(model_type, **cleaned)


def supports_sdpa(config: dict[str, Any]) -> bool:
    """Whether transformers' causal-LM class for the config's ``model_type`` runs SDPA attention (its
    ``_supports_sdpa``; Gemma 2 and BLOOM, for instance, do not). Unknown types answer True (the build says more).
    Kept on disk per model type and transformers version, as the counts are (sealed: a file edited to say True,
    which made Gemma 2 fail each run, is damaged or stale and asked again; one with its checksum recomputed is not
    detectable from the file)."""
    key = "sdpa:" + str(config.get("model_type", "")).strip().lower()
    stored = stored_answer(key, _check_sdpa, _legacy_sdpa)
    if stored is not None:
        return bool(stored["sdpa"])
    answer = _supports_sdpa_now(config)
    store_answer(key, {"sdpa": answer}, _check_sdpa)
    return answer


def _check_sdpa(payload: Any) -> None:
    if not isinstance(payload, dict) or set(payload) != {"sdpa"} or not isinstance(payload["sdpa"], bool):
        raise ValueError("it does not hold an SDPA answer")


def _legacy_sdpa(data: dict[str, Any]) -> bool:
    return set(data) == {"sdpa"} and isinstance(data["sdpa"], bool)


def _supports_sdpa_now(config: dict[str, Any]) -> bool:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(config.get("model_type", "")).strip().lower())
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    return bool(getattr(cls, "_supports_sdpa", True)) if cls is not None else True


def _build_on_meta(config: dict[str, Any]) -> Any:
    """``AutoModelForCausalLM.from_config`` on the meta device (no memory, offline, no code a config names), as
    the process's one torch job (transformers' lazy imports fail when two threads run them at once)."""
    from ..measure import exclusive_torch_job

    with exclusive_torch_job():
        return _build_on_meta_now(config)


def _build_on_meta_now(config: dict[str, Any]) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    model_type, cfg = transformers_kwargs(config)  # no auto_map or location keys: nothing a config names runs
    if model_type not in transformers.CONFIG_MAPPING:
        raise ConfigError("model_type", f"transformers {transformers.__version__} has no model type {model_type!r}")
    try:
        hf_config = auto_config(model_type, cfg)
    except Exception as exc:  # a config class rejects some value
        raise ConfigError("config", f"transformers rejects it: {exc}") from None
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(hf_config, trust_remote_code=False)
    except Exception as exc:  # transformers raises many kinds for configs it cannot build
        if "Unrecognized configuration class" in str(exc):
            raise ConfigError("model_type", f"{model_type!r} is not a causal language model transformers can build "
                                            "(AutoModelForCausalLM)") from None
        raise ConfigError("config", f"transformers could not build a causal LM from it: {exc}") from None
    return model
