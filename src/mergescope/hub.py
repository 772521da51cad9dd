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


def evict_revisions(repo_id: str, revisions: list[str], cache_dir: str | None = None) -> dict[str, int]:
    """Delete the given revisions (branch names such as ``step1000``) of a hub model from the local Hugging Face
    cache, once their jobs are done; returns {revision: bytes freed}. Blobs still used by another revision (the
    kept ``main``, say) stay. Only the hub cache is touched: a local folder (the zoo) is never an argument here."""
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(cache_dir)
    repo = next((r for r in info.repos if r.repo_id == repo_id and r.repo_type == "model"), None)
    if repo is None:
        return {}
    wanted = {rev.commit_hash: sorted(set(rev.refs) & set(revisions)) for rev in repo.revisions if set(rev.refs) & set(revisions)}
    freed: dict[str, int] = {}
    for commit, refs in wanted.items():
        if any(r not in revisions for r in next(rev.refs for rev in repo.revisions if rev.commit_hash == commit)):
            continue  # the same snapshot is also another, kept ref (main): keep it
        strategy = info.delete_revisions(commit)
        size = int(strategy.expected_freed_size)
        strategy.execute()
        for r in refs:
            freed[r] = size // len(refs)
    return freed
