"""A model, tokenizer or dataset named as on the Hugging Face Hub (`meta-llama/Llama-3.2-1B`, `org/name@revision`)
where a local directory is allowed: the directory of its snapshot in huggingface_hub's cache, downloaded into it
when online. huggingface_hub's own settings apply: HF_HUB_OFFLINE=1 reads the cache only, HF_HOME / HF_HUB_CACHE
say where the cache is, HF_TOKEN authenticates gated models. A local directory is always taken as it is."""

from __future__ import annotations

import functools
import os

from disttrain.core.errors import UserError

# What a training run reads from a model repository: configs, tokenizers, safetensors weights (not the .bin, .pt,
# ONNX or GGUF copies many repositories also hold).
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]


def is_hub_id(name: str) -> bool:
    """`org/name` or `name`, with an optional `@revision`, and not an existing path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo = name.partition("@")[0]
    if os.path.exists(name) or not repo or repo.startswith((".", "/", "~")) or repo.count("/") > 1:
        return False
    try:
        validate_repo_id(repo)
    except HFValidationError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def local_directory(name: str, key: str = "model.hf", repo_type: str = "model") -> str:
    """`name` itself when it is a directory; else the cached snapshot of the Hub repository `name[@revision]`,
    fetched if online. UserError (one line, naming `key`) when it is neither."""
    if os.path.isdir(name):
        return name
    what = "a local folder written by save_pretrained" if repo_type == "model" else "a local folder or file"
    if not is_hub_id(name):
        raise UserError(f"{key}={name}: no such directory (allowed: {what}, or a Hugging Face Hub id such as "
                        "org/name or org/name@revision)")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError, \
        RevisionNotFoundError

    repo, _, revision = name.partition("@")
    try:
        return snapshot_download(repo, revision=revision or None, repo_type=repo_type,
                                 allow_patterns=MODEL_FILES if repo_type == "model" else None)
    except LocalEntryNotFoundError:
        why = ("HF_HUB_OFFLINE=1 allows the cache only" if constants.HF_HUB_OFFLINE else
               "the Hub could not be reached")
        raise UserError(f"{key}={name}: no such directory, and not in the Hugging Face cache "
                        f"({constants.HF_HUB_CACHE}) while {why} (allowed: {what}, or a Hub id that is cached or "
                        "reachable)") from None
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise UserError(f"{key}={name}: no such directory, and the Hub has no {repo_type} {repo} that this machine "
                        f"may read ({type(exc).__name__}; for a gated model, accept its terms and set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise UserError(f"{key}={name}: the Hub {repo_type} {repo} has no revision {revision}") from None
