"""Whether the Hugging Face Hub can be reached, asked once before anything downloads.

Offline, the Hub's clients retry each request with backoff (five times each, tens of seconds) before they
fall back to the local cache. The dry run asks here first: `HF_HUB_OFFLINE` set is honoured as it is;
otherwise one connection to the Hub (or to the HTTPS proxy) decides, and where it fails, the plan reads
the cache alone, as under `HF_HUB_OFFLINE=1`, and says so in one line.

    muonrun pretrain qwen2-muon-fsdp2 --dry-run
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

from muonrun.errors import UserError

TRUE = {"1", "on", "yes", "true"}  # as huggingface_hub reads HF_HUB_OFFLINE
ENDPOINT = "https://huggingface.co"
CONNECT_TIMEOUT_S = 3.0


def uses_hub(c) -> bool:
    """Whether the run names anything on the Hub: a tokenizer, a model or a dataset that is not local."""
    from muonrun.data.sources import resolve_files

    if c.data.tokenizer != "byte" and not os.path.isdir(os.path.expanduser(c.data.tokenizer)):
        return True
    if c.model.name_or_path and not os.path.isdir(os.path.expanduser(c.model.name_or_path)):
        return True
    for group in ("sources", "eval_sources"):
        for i, src in enumerate(getattr(c.data, group)):
            try:
                if resolve_files(src, f"data.{group}.{i}") is None:
                    return True
            except UserError:  # a local path with a mistake: the data check reports it
                pass
    return False


def unreachable(timeout: float = CONNECT_TIMEOUT_S) -> str | None:
    """None when a TCP connection to the Hub (or to the HTTPS proxy the Hub's clients would use) opens
    within `timeout` seconds, else what failed (`huggingface.co:443: Name or service not known`)."""
    proxy = next(
        (
            os.environ[k]
            for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
            if os.environ.get(k)
        ),
        None,
    )
    url = urlsplit(proxy or os.environ.get("HF_ENDPOINT") or ENDPOINT)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return f"{host}:{port}: {e.strerror or type(e).__name__}"
    return None


def hub_access(c) -> str | None:
    """The plan's one line about the Hub, or None where the run needs nothing from it. Where the Hub cannot
    be reached, sets HF_HUB_OFFLINE=1 for this process, which the Hub's clients read when first imported
    (the dry run imports them after this), so they read the cache at once instead of retrying."""
    if not uses_hub(c):
        return None
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in TRUE:
        return "offline (HF_HUB_OFFLINE is set): only the local Hugging Face cache is read"
    why = unreachable()
    if why is None:
        return "reachable"
    os.environ["HF_HUB_OFFLINE"] = "1"
    return f"not reachable from here ({why}): planned from the local Hugging Face cache alone, as HF_HUB_OFFLINE=1"
