"""Model references: a local checkpoint directory, or a Hugging Face Hub id `ORG/NAME[@REVISION]`.

A Hub id is fetched through `huggingface_hub` into its cache (HF_HOME / HF_HUB_CACHE; HF_HUB_OFFLINE=1 reads
the cache only), and only the files this project loads: config.json, generation_config.json, safetensors weights
(and their index), the tokenizer files and the chat template (`chat_template.jinja`, rendered in a Jinja sandbox by
`mbd.chat_template`). Never a `*.py` file: checkpoints that ship modeling code (`trust_remote_code` in
transformers) are read by this project's own model code, so no code from the Hub runs. `@REVISION` pins a
branch, tag or commit, as `revision=` does in transformers.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from mbd.config import ConfigError, resolve_path

# the files a checkpoint directory needs here (mbd.checkpoint_files, mbd.model.checkpoint, mbd.tokenizer); code
# is never fetched
ALLOW_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                  "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})(?:@(?P<rev>[\w./-]{1,200}))?$")


def parse_hub_id(ref: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) if `ref` has the shape of a Hub id, else None."""
    m = HUB_ID.match(ref)
    return (m["repo"], m["rev"]) if m and ".." not in ref else None


def resolve_model(ref: str | Path) -> Path:
    """The local checkpoint directory for `ref`: an existing path (working directory, then the repository
    root) as it is; else a Hub id, downloaded (or found in the cache) and returned as its snapshot directory.
    A ref that is neither comes back as the path it names, so callers report the missing directory."""
    local = resolve_path(ref)
    if local.exists() or parse_hub_id(str(ref)) is None:
        return local
    return _snapshot(str(ref))


@lru_cache(maxsize=32)
def _snapshot(ref: str) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, \
        RevisionNotFoundError

    repo, rev = parse_hub_id(ref)
    try:
        path = Path(snapshot_download(repo, revision=rev, allow_patterns=ALLOW_PATTERNS))
    except LocalEntryNotFoundError as e:
        where = "offline (HF_HUB_OFFLINE=1) and " if constants.HF_HUB_OFFLINE else ""
        raise ConfigError(f"model {ref}: {where}not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                          f"not reachable: download it once online, or pass a local directory") from e
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise ConfigError(f"model {ref}: no such Hugging Face repository or revision ({type(e).__name__})") from e
    except HfHubHTTPError as e:
        raise ConfigError(f"model {ref}: the Hugging Face Hub refused the download: {e}") from e
    if not (path / "config.json").is_file():
        raise ConfigError(f"model {ref}: the Hub snapshot has no config.json (not a checkpoint this project reads)")
    return path
