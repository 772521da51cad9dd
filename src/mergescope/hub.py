"""Hub reachability: fail fast with one line instead of hanging on a dead network."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

from mergescope.errors import MergescopeError

_cache: dict[str, bool] = {}


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    url = urlparse(hub_endpoint())
    key = url.netloc
    if key not in _cache:
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            with socket.create_connection((url.hostname, port), timeout=timeout):
                _cache[key] = True
        except OSError:
            _cache[key] = False
    return _cache[key]


def check_hub_reachable(what: str) -> None:
    if not hub_reachable():
        raise MergescopeError(
            f"the Hugging Face hub ({hub_endpoint()}) is unreachable (or HF_HUB_OFFLINE is set) and {what} "
            "is needed from it; connect to the internet, or give a local folder instead"
        )
