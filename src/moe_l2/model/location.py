"""Where a model lives: a directory, or a Hugging Face repo id resolved through the local Hugging Face cache.

Every `--model` (the commands, moe-l2d and its TOML) goes through `resolve_model`; every other path a person
types goes through `expand_path`, so `~` and `$VARS` work in flags, in quoted arguments and in the TOML alike
(docs/architecture.md, "Models and paths").
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

# owner/name[@revision], as the Hub spells repo ids: letters, digits, '-', '_', '.'; no '--' or '..'.
_REPO_ID = re.compile(r"^(?P<repo>[\w.-]{1,96}/[\w.-]{1,96})(?:@(?P<revision>[\w./-]{1,256}))?$")
_UNSET_VAR = re.compile(r"\$(\w+|\{[^}]*\})")
_TRUE = {"1", "on", "yes", "true"}


class PathError(ValueError):
    """A path names an environment variable that is not set."""


class ModelNotFound(ValueError):
    """Neither a model directory nor a repo id in the local Hugging Face cache; the message says what to do."""


def expand_path(text: str | os.PathLike) -> Path:
    """`text` with `~` and `$VAR` / `${VAR}` expanded. An unset variable is an error, not a literal '$VAR'."""
    expanded = os.path.expandvars(os.path.expanduser(os.fspath(text)))
    unset = _UNSET_VAR.search(expanded)
    if unset:
        raise PathError(f"{os.fspath(text)!r} uses ${unset.group(1).strip('{}')}, which is not set: set it, "
                        "or write the path out")
    return Path(expanded)


def expand_socket(address: str) -> str:
    """A ZeroMQ address with the path of an ipc:// address expanded like any other path."""
    if address.startswith("ipc://"):
        return f"ipc://{expand_path(address[len('ipc://'):])}"
    return address


def path_arg(text: str) -> Path:
    """`expand_path` as an argparse type: the error names the option instead of 'invalid value'."""
    try:
        return expand_path(text)
    except PathError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def socket_arg(text: str) -> str:
    """`expand_socket` as an argparse type."""
    try:
        return expand_socket(text)
    except PathError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache as huggingface_hub finds it, read now (its constants are read at import):
    $HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return expand_path(cache)
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    return expand_path(home) / "hub"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def parse_repo_id(text: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `text` is spelled like `owner/name[@revision]`, else None."""
    match = _REPO_ID.match(text)
    if match is None or any(part in {".", ".."} for part in match["repo"].split("/")) \
            or "--" in match["repo"] or ".." in match["repo"]:
        return None
    return match["repo"], match["revision"]


def resolve_model(text: str | os.PathLike, download: bool = False) -> Path:
    """The directory of the model `text` names.

    A path (after `~` and `$VAR` expansion) that exists is used as is, as mlx-lm does. Otherwise `owner/name`
    or `owner/name@revision` is looked up in the local Hugging Face cache; with `download` (generate, serve),
    a model missing there is downloaded the way mlx-lm does it, with its progress bars. The daemon never
    downloads: a missing model is an error that names the command that fetches it."""
    path = expand_path(text)
    if path.exists():
        return path
    spelled = parse_repo_id(os.fspath(text))
    if spelled is None:
        raise ModelNotFound(f"no model directory at {path}: give an mlx-lm model directory or a Hugging Face "
                            "repo id such as mlx-community/Qwen3-30B-A3B-4bit")
    repo, revision = spelled
    cache = hub_cache_dir()
    found = _from_cache(repo, revision, cache)
    if found is not None:
        return found
    where = f"{repo}{'@' + revision if revision else ''}"
    fetch = (f"run `moe-l2 generate --model {where} -p hi --max-tokens 1` once to download it, "
             f"or `hf download {repo}{' --revision ' + revision if revision else ''}`")
    if not download:
        raise ModelNotFound(f"{where} is not a model directory and not in the Hugging Face cache at {cache}: {fetch}")
    if hub_offline():
        raise ModelNotFound(f"{where} is not in the Hugging Face cache at {cache}, and HF_HUB_OFFLINE is set: "
                            "unset it to download the model, or point HF_HUB_CACHE / HF_HOME at the cache that "
                            "holds it")
    return _download(repo, revision, cache)


def _from_cache(repo: str, revision: str | None, cache: Path) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError):
        return None


def _download(repo: str, revision: str | None, cache: Path) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        # mlx_lm.utils._download's call, with the cache this process resolved (HF_HUB_CACHE read now).
        return Path(snapshot_download(repo, revision=revision, allow_patterns=DEFAULT_ALLOW_PATTERNS,
                                      cache_dir=cache))
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise ModelNotFound(f"{repo} is not on the Hugging Face Hub ({type(exc).__name__}): check the repo id and "
                            "revision, or log in with `hf auth login` for a private repo") from None
    except GatedRepoError:
        raise ModelNotFound(f"{repo} is gated: accept its terms on huggingface.co and log in with "
                            "`hf auth login`") from None
    except (HfHubHTTPError, OSError) as exc:
        raise ModelNotFound(f"cannot download {repo} into {cache}: {exc}") from None
