"""Models named by Hugging Face Hub id (``model.path: Qwen/Qwen3-0.6B``): the local folder of a snapshot.

A config path of the form ``org/name`` that is not a folder beside the config is a Hub id. It is looked up in the
Hugging Face cache (``HF_HOME``, ``HF_HUB_CACHE``) first; a model not there is downloaded into it by `rl train`,
`rl rollout` and `rl eval` before anything starts (``rl config validate`` only looks in the cache). Where the Hub
cannot be reached, the error names the command that downloads it on a machine that can. Only what rlx reads is
downloaded: the configs, the tokenizer's files and the safetensors weights.
"""

from __future__ import annotations

import re

from rlx.errors import RLXError

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
#: what rlx reads of a checkpoint (not .bin or .pth copies of the weights, GGUF files or other formats)
FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py"]


def is_hub_id(value: str) -> bool:
    return bool(_HUB_ID.fullmatch(value)) and ".." not in value


def cached(repo_id: str) -> str | None:
    """The folder of `repo_id`'s newest snapshot in the Hugging Face cache, or None."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=FILES, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached (the library raises several kinds for it)
        return None


def local_folder(repo_id: str, where: str) -> str:
    """`repo_id`'s folder: from the cache, else downloaded into it; an error saying how to get it where the Hub
    cannot be reached. `where` names the config key."""
    folder = cached(repo_id)
    if folder is not None:
        return folder
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=FILES)
    except Exception as e:  # noqa: BLE001 - offline, unknown repository, gated, ...
        why = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise RLXError(f"{repo_id!r} is not a folder beside the config and was taken for a Hugging Face Hub id, "
                       f"but it is not in the Hugging Face cache and could not be downloaded ({type(e).__name__}: "
                       f"{why}). On a machine that reaches the Hub, run `hf download {repo_id}` (into the cache: "
                       f"HF_HOME) and copy the cache here, or set {where} to the model's folder") from None
