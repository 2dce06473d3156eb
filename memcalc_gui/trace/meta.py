"""Exact parameter counts from transformers on the meta device, for families the core does not model.

torch and transformers are imported inside the functions only (the window starts without them).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from ..core.errors import ConfigError


def transformers_available() -> bool:
    """True when both torch and transformers can be imported (without importing them)."""
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


def count_params_on_meta(config: dict[str, Any]) -> int:
    """``sum(p.numel())`` of ``AutoModelForCausalLM.from_config`` built on the meta device (no memory, offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    cfg = {k: v for k, v in config.items() if not k.startswith("_")}
    model_type = cfg.pop("model_type", None)
    try:
        hf_config = transformers.AutoConfig.for_model(model_type, **cfg)
    except (ValueError, KeyError) as exc:
        raise ConfigError("model_type", f"transformers does not know {model_type!r}: {exc}") from None
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(hf_config)
    except Exception as exc:  # transformers raises many kinds for configs it cannot build
        raise ConfigError("config", f"transformers could not build a causal LM from it: {exc}") from None
    return int(sum(p.numel() for p in model.parameters()))
