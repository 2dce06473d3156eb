"""A model named by its Hugging Face Hub id (``meta-llama/Llama-3.1-8B``): its ``config.json`` from a local
directory, the local Hugging Face cache, or the Hub.

Order: a directory (or a ``config.json`` path) the id names on this machine; the local cache
(``huggingface_hub.try_to_load_from_cache``: ``HF_HOME``/``HF_HUB_CACHE`` honoured), with no network; the published
config memcalc bundles as a preset (``_name_or_path`` equal to the id, default revision only); only then
the Hub (``hf_hub_download`` of ``config.json`` alone: the token from ``HF_TOKEN`` or ``hf auth login``, and
``HF_ENDPOINT`` honoured). ``HF_HUB_OFFLINE`` as the user set it keeps the network out (memcalc sets it for its own
model building, so the user's value is the one seen when the program started). Every failure is one line
naming its cause: offline, no network, gated, not found, no config.json, not JSON.

huggingface_hub is imported inside functions only; the file read goes through ``core.configfile`` like any
config the user opens.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import USER_HF_OFFLINE, install_hint
from .core.configfile import read_config
from .core.errors import InputError, one_line
from .core.model import preset_config, preset_for_hub_id

#: ``org/name`` as the Hub spells repository ids (huggingface_hub.utils.validate_repo_id): letters, digits and
#: ``-_.``; at most 96 characters for the name.
REPO_ID = re.compile(r"^(?:[\w\-.]{1,96}/)?[\w\-.]{1,96}$")
FIELD = "model_id"


@dataclass(frozen=True)
class HubConfig:
    """A resolved config and where it came from (for the model's source line)."""

    repo_id: str
    config: dict[str, Any]
    path: str
    origin: str  # "local directory", "local cache", the bundled preset, or "Hub"

    @property
    def source(self) -> str:
        return f"{self.repo_id} ({self.origin})"


def _bundled(repo_id: str, preset: str) -> HubConfig:
    return HubConfig(repo_id, preset_config(preset), f"preset {preset}", f"memcalc's bundled copy, preset {preset}")


def _fail(message: str) -> InputError:
    return InputError(FIELD, message)


@contextlib.contextmanager
def _user_offline_mode() -> Iterator[None]:
    """huggingface_hub reads HF_HUB_OFFLINE once, at import: use the user's value for this call."""
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = USER_HF_OFFLINE
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = saved


def resolve_config(model_id: str, revision: str | None = None, *, allow_network: bool = True) -> HubConfig:
    """The ``config.json`` of ``model_id``: a local directory or file, else the local cache, else the Hub.

    ``allow_network=False`` looks on this machine only (the window's startup: a saved id is not fetched until the
    user asks). Raises :class:`InputError` on field ``model_id`` with one line naming the cause.
    """
    text = model_id.strip()
    if not text:
        raise _fail("give a Hub id such as meta-llama/Llama-3.1-8B")
    local = Path(text).expanduser()
    if local.is_dir() or (local.is_file() and local.suffix == ".json"):
        file = local / "config.json" if local.is_dir() else local
        if not file.is_file():
            raise _fail(f"{local} has no config.json")
        return HubConfig(text, read_config(file), str(file), "local directory")
    if not REPO_ID.match(text) or ".." in text or "--" in text:
        raise _fail(f"{text[:80]!r} is neither a folder here nor a Hub id (org/name, e.g. meta-llama/Llama-3.1-8B)")
    preset = preset_for_hub_id(text) if revision in (None, "main") else None
    try:
        import huggingface_hub as hub
        from huggingface_hub import errors
    except ImportError:
        if preset is not None:
            return _bundled(text, preset)
        raise _fail(f"Hub ids need huggingface_hub: {install_hint('hf')}") from None

    with _user_offline_mode():
        cached = hub.try_to_load_from_cache(text, "config.json", revision=revision)
        if isinstance(cached, str):
            return HubConfig(text, read_config(cached), cached, "local cache")
        if preset is not None:  # the published config, bundled with memcalc: no network needed
            return _bundled(text, preset)
        if not allow_network:
            raise _fail(f"{text} is not in the local Hugging Face cache: fetch it from the Hub")
        if USER_HF_OFFLINE:
            raise _fail(f"{text} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set")
        try:
            # one HEAD request without retries first: a missing network or a wrong id answers at once, where
            # hf_hub_download would retry with backoff for about 20 s
            hub.get_hf_file_metadata(hub.hf_hub_url(text, "config.json", revision=revision), timeout=10)
            path = hub.hf_hub_download(text, "config.json", revision=revision)
        except errors.GatedRepoError:
            raise _fail(f"{text} is gated: accept its license on the Hub, then log in (hf auth login) or set "
                        "HF_TOKEN") from None
        except errors.RevisionNotFoundError:
            raise _fail(f"{text} has no revision {revision or 'main'!r}") from None
        except errors.RepositoryNotFoundError:
            raise _fail(f"no model {text} on the Hub (or it is private: log in or set HF_TOKEN)") from None
        except errors.RemoteEntryNotFoundError:
            raise _fail(f"{text} has no config.json on the Hub") from None
        except errors.OfflineModeIsEnabled:
            raise _fail(f"{text} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set") from None
        except errors.HfHubHTTPError as exc:
            raise _fail(f"the Hub answered {one_line(str(exc), 160)}") from None
        except Exception as exc:  # the HTTP client's own errors (connection, DNS, TLS, timeout, proxy)
            cause = exc.__cause__ or exc if isinstance(exc, errors.LocalEntryNotFoundError) else exc
            raise _fail(f"{text} is not in the local Hugging Face cache and the Hub cannot be reached "
                        f"({type(cause).__name__}: {one_line(str(cause), 120)})") from None
    return HubConfig(text, read_config(path), path, "Hub")
