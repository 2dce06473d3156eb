"""The one reader of user ``config.json`` files, used by every path (estimate, trace, measure, report, window).

A config file is untrusted input. This module guarantees, for any path a user names:

- only a regular file is read (a FIFO, a device such as ``/dev/zero``, a socket or a folder is refused
  before it is opened for reading, so nothing blocks or grows without bound), and at most
  :data:`MAX_CONFIG_BYTES` of it;
- the text is UTF-8 (a byte-order mark is allowed, and UTF-16/32 with a BOM is decoded, as RFC 8259
  permits readers to); anything else is one line naming the file and the offending byte;
- the JSON nests at most :data:`MAX_JSON_DEPTH` levels and is an object;
- keys through which a config can name code or a network location (``auto_map``, ``custom_pipelines``,
  ``trust_remote_code``) are removed before transformers ever sees the dictionary
  (:func:`transformers_kwargs`); memcalc only builds the model classes transformers itself ships,
  always with ``trust_remote_code=False``.

Every problem is a :class:`~memcalc_gui.core.errors.ConfigError` with a one-line reason.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import os
from pathlib import Path
from typing import Any, Final

from .errors import ConfigError, InputError
from .files import read_regular

#: Published ``config.json`` files are a few KiB (the largest, with label maps, well under 1 MiB).
MAX_CONFIG_BYTES: Final = 4 * 2**20
#: Real configs nest three or four levels (``rope_scaling``, ``text_config``); Python's JSON reader recurses.
MAX_JSON_DEPTH: Final = 32
#: Keys that name code to import (``auto_map``, ``custom_pipelines``) or allow running it. memcalc never
#: honours them: they are dropped before transformers sees the config.
CODE_KEYS: Final = ("auto_map", "custom_pipelines", "trust_remote_code")
#: Keys that point transformers at a folder or a Hub repository, or at a dtype memcalc chooses itself.
LOCATION_KEYS: Final = ("name_or_path", "_name_or_path", "_commit_hash", "torch_dtype", "dtype")

_BOMS: Final = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)


def _read_bytes(path: Path) -> bytes:
    """The file's bytes through the one bounded reader (:func:`~memcalc_gui.core.files.read_regular`)."""
    name = path.name or str(path)
    with contextlib.suppress(OSError, ValueError):
        if path.is_dir():
            raise ConfigError("config", f"{name} is a folder; choose its config.json")
    try:
        return read_regular(path, field="config", limit=MAX_CONFIG_BYTES, what="config.json")
    except InputError as exc:
        raise ConfigError("config", exc.reason) from None


def decode_text(data: bytes, name: str = "config.json") -> str:
    """UTF-8 text (BOM allowed), or UTF-16/32 announced by a BOM; else a one-line error."""
    encoding = next((enc for bom, enc in _BOMS if data.startswith(bom)), "utf-8")
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        bad = data[exc.start:exc.start + 1].hex()
        raise ConfigError("config", f"{name} is not UTF-8 text (byte 0x{bad} at offset {exc.start})") from None


def _depth_ok(text: str) -> bool:
    """Whether brackets outside strings nest at most :data:`MAX_JSON_DEPTH` deep (before parsing recurses)."""
    depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def parse_config_text(text: str, name: str = "config.json") -> dict[str, Any]:
    """Parse config text into a dictionary with the limits of this module."""
    if not _depth_ok(text):
        raise ConfigError("config", f"{name} nests deeper than {MAX_JSON_DEPTH} levels; it is not a model config")
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError("config", f"{name} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except RecursionError:
        raise ConfigError("config", f"{name} nests too deeply to be read") from None
    except ValueError:  # Python refuses integers of more than 4300 digits
        raise ConfigError("config", f"{name} holds a number too long to be a size (over 4300 digits)") from None
    if not isinstance(cfg, dict):
        raise ConfigError("config", f"{name} must hold a JSON object")
    return cfg


def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and parse a user's ``config.json`` (see the module docstring for the guarantees)."""
    p = Path(path)
    data = _read_bytes(p)
    name = p.name or str(p)
    return parse_config_text(decode_text(data, name), name)


def code_keys(cfg: dict[str, Any]) -> list[str]:
    """The keys of ``cfg`` (top level or a nested sub-config) that name code memcalc will not run."""
    found: list[str] = [k for k in CODE_KEYS if k in cfg]
    for key, value in cfg.items():
        if isinstance(value, dict) and key.endswith("_config"):
            found += [f"{key}.{k}" for k in code_keys(value)]
    return found


def _clean(cfg: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        if key in CODE_KEYS or key in LOCATION_KEYS or key.startswith("_"):
            continue
        if isinstance(value, float) and value.is_integer() and (key.endswith(("_size", "_layers", "_heads"))
                                                                 or key in _INT_KEYS):
            value = int(value)
        if isinstance(value, dict) and key.endswith("_config"):
            value = _clean(value)
        out[key] = value
    return out


#: Size keys that transformers' classes use as integers (a ``4096.0`` in a config would break a shape).
_INT_KEYS: Final = frozenset({"n_embd", "n_head", "n_layer", "n_inner", "n_positions", "head_dim", "vocab_size",
                              "max_position_embeddings", "num_key_value_heads", "num_attention_heads",
                              "num_hidden_layers", "intermediate_size", "hidden_size", "n_ctx"})


#: Config keys of the routed experts per layer in transformers' mixture-of-experts configs.
EXPERT_KEYS: Final = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def routed_experts(cfg: dict[str, Any]) -> int:
    """The routed experts per layer a config names (:data:`EXPERT_KEYS`, the first above 1), 0 for a dense model."""
    return next((int(cfg[k]) for k in EXPERT_KEYS if isinstance(cfg.get(k), int) and cfg[k] > 1), 0)


def without_nulls(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without its null values (each then the config class's default): the second try when a config
    class rejects an explicit null. The first try keeps them, since a null can mean "none" where the class default
    is something (DeepSeek-V2-Lite's ``q_lora_rank: null`` is no query compression; the default is 1536)."""
    return {k: (without_nulls(v) if isinstance(v, dict) else v) for k, v in kwargs.items() if v is not None}


def transformers_kwargs(cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(model_type, kwargs)`` for ``AutoConfig.for_model``: code and location keys removed, integral float sizes
    made integers, ``model_type`` lower-cased (the form transformers registers); nulls kept (see
    :func:`without_nulls`)."""
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or not model_type.strip():
        raise ConfigError("model_type", "missing from config.json")
    kwargs = _clean(cfg)
    kwargs.pop("model_type", None)
    return model_type.strip().lower(), kwargs


#: Where a config keeps its layer count (the first key present), as transformers' config classes spell it.
LAYER_KEYS: Final = ("num_hidden_layers", "n_layer", "num_layers")


def with_layers(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """``cfg`` with ``layers`` decoder layers: the per-layer lists made to match (``layer_types`` — gpt-oss's and
    Gemma 3's sliding/full pattern, which transformers checks against the count — cut, or for more layers than it
    names repeated as a pattern, as those families' own defaults repeat theirs; ``mlp_only_layers`` cut). A
    calibration traces more layers than a shallow config has (a 2-layer gpt-oss is fitted from 3 and 4)."""
    key = next((k for k in LAYER_KEYS if k in cfg), "num_hidden_layers")
    out = dict(cfg, **{key: layers})
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        out["layer_types"] = [types[i % len(types)] for i in range(layers)]
    if isinstance(cfg.get("mlp_only_layers"), list):
        out["mlp_only_layers"] = [i for i in cfg["mlp_only_layers"] if isinstance(i, int) and i < layers]
    return out


def dense_prefix_layers(cfg: dict[str, Any]) -> int:
    """How many leading decoder layers differ from the rest: DeepSeek-V2/V3's dense layers before the mixture of
    experts (``first_k_dense_replace``). A fit traces past them."""
    value = cfg.get("first_k_dense_replace")
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1000 else 0
