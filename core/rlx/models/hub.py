"""Models named by Hugging Face Hub id (``model.path: Qwen/Qwen3-0.6B``): the local folder of a snapshot.

A config path of the form ``org/name`` whose first part is no folder beside the config is a Hub id. It is looked up
in the Hugging Face cache (``HF_HOME``, ``HF_HUB_CACHE``) first; a model not there whole is downloaded into it by
`rl train`, `rl rollout`, `rl eval` and `rl serve` before anything starts, once the config has no other problem
(``rl config validate`` only looks in the cache). Where the Hub
cannot be reached, the error names the command that downloads it on a machine that can. Only what rlx reads is
downloaded: the configs, the tokenizer's files and the safetensors weights.
"""

from __future__ import annotations

import re
from pathlib import Path

from rlx.errors import RLXError

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
#: what rlx reads of a checkpoint (not .bin or .pth copies of the weights, GGUF files or other formats)
FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py"]


def is_hub_id(value: str) -> bool:
    return bool(_HUB_ID.fullmatch(value)) and ".." not in value


def cached(repo_id: str, weights: bool = True) -> str | None:
    """The folder of `repo_id`'s newest snapshot in the Hugging Face cache, or None; with `weights`, only one that
    holds safetensors weights (a cache that `AutoConfig` or `AutoTokenizer` filled holds a config and no more)."""
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(repo_id, allow_patterns=FILES, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached (the library raises several kinds for it)
        return None
    return folder if not weights or _has_weights(folder) else None


def local_folder(repo_id: str, where: str, weights: bool = True) -> str:
    """`repo_id`'s folder, downloaded into the cache (the files it lacks; nothing when it is whole and current), or
    the cache's where the Hub cannot be reached; an error saying how to get it where neither serves. `where` names
    the config key."""
    from huggingface_hub import constants, snapshot_download

    try:
        folder: str | None = snapshot_download(repo_id, allow_patterns=FILES)  # offline: the cache's, whole or not
        error = None
    except Exception as e:  # noqa: BLE001 - offline, unknown repository, gated, ...
        folder, error = cached(repo_id, weights), e
    if folder is not None and (not weights or _has_weights(folder)):
        return folder
    if error is None and not constants.HF_HUB_OFFLINE:
        raise RLXError(f"the Hugging Face Hub's {repo_id!r} has no safetensors weights, which rlx reads; "
                       f"save the model with safetensors and set {where} to its folder")
    why = f"{type(error).__name__}: {str(error).strip().splitlines()[0]}" if error is not None and str(error).strip() \
        else "the Hub is switched off (HF_HUB_OFFLINE)" if error is None else type(error).__name__
    raise RLXError(f"{repo_id!r} is not a folder beside the config and was taken for a Hugging Face Hub id, but it "
                   f"is not in the Hugging Face cache whole and could not be downloaded ({why}). On a machine that "
                   f"reaches the Hub, run `hf download {repo_id}` (into the cache: HF_HOME) and copy the cache here, "
                   f"or set {where} to the model's folder")


def _has_weights(folder: str) -> bool:
    return any(Path(folder).glob("*.safetensors"))
