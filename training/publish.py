"""Publishing an adapter: a folder ready for ``huggingface_hub`` upload, its model card, the upload.

:func:`write_hub_folder` copies the adapter files and writes ``README.md``, a
``huggingface_hub`` ``ModelCard``: metadata (``ModelCardData``: ``library_name`` selfdraft,
``base_model`` when the target is a hub id, licence, tags) and the target pin, drafter, training
recipe and the acceptance table (per traffic mix and temperature) that ``adapter_config.json``
records, plus a loading snippet that runs as written (:func:`loading_snippet`). :func:`push_folder` uploads such a folder; without a token or a network
it raises :class:`PublishError` saying which, before any upload starts.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
from pathlib import Path
from urllib.parse import urlparse

from heads.adapter import CONFIG_NAME, WEIGHTS_NAME, read_config, read_weights, write_directory
from heads.adapter import acceptance_entries

logger = logging.getLogger(__name__)

CARD_NAME = "README.md"
_NETWORK_MODULES = ("httpx", "httpcore", "requests", "urllib3", "ssl")


class PublishError(RuntimeError):
    """The folder cannot be written or uploaded; the message says why and what to do."""


def _hub_id(name: str) -> str | None:
    """``name`` when it looks like a hub repository id (``owner/name``), not a local path."""
    parts = name.split("/")
    if len(parts) == 2 and all(parts) and not name.startswith((".", "~")) and not Path(name).exists():
        return name
    return None


def card_data(config: dict, license_id: str, license_name: str | None, license_link: str | None):
    """The card's metadata (``huggingface_hub.ModelCardData``)."""
    from huggingface_hub import ModelCardData

    base = _hub_id(config["target"].get("name_or_path") or "")
    return ModelCardData(
        library_name="selfdraft", license=license_id,
        license_name=(license_name or "same-as-target-model") if license_id == "other" else None,
        license_link=license_link, base_model=base, base_model_relation="adapter" if base else None,
        tags=["selfdraft", "speculative-decoding", config["kind"]],
    )


def front_matter(config: dict, license_id: str, license_name: str | None, license_link: str | None) -> str:
    """YAML front matter of the model card (``ModelCardData`` as YAML, between ``---`` lines)."""
    return "---\n" + card_data(config, license_id, license_name, license_link).to_yaml() + "\n---"


def loading_snippet(config: dict, location: str, repo_id: str | None = None) -> list[str]:
    """Python lines that load the target and this adapter and generate, runnable as written:
    the target as the pin names it (hub id or the path it was loaded from), its tokenizer for the
    prompt, the adapter from the hub (``repo_id``) or from ``location``."""
    target = config["target"]
    name = target.get("name_or_path") or "TARGET_MODEL_DIR"
    revision = f", revision={target['revision']!r}" if target.get("revision") else ""
    adapter = f"snapshot_download({repo_id!r})" if repo_id else repr(location)
    return [*(["from huggingface_hub import snapshot_download"] if repo_id else []),
            "from transformers import AutoModelForCausalLM, AutoTokenizer", "import heads", "",
            f"target = {name!r}",
            f"tokenizer = AutoTokenizer.from_pretrained(target{revision})",
            f"model = AutoModelForCausalLM.from_pretrained(target{revision})",
            f"spec = heads.load_heads(model, {adapter})",
            'input_ids = tokenizer("Once upon a time", return_tensors="pt").input_ids',
            "ids = spec.generate(input_ids, max_new_tokens=32)  # == model.generate(input_ids, do_sample=False, ...)",
            "print(tokenizer.decode(ids[0]))"]


def _table(header: list[str], rows: list[list[object]]) -> list[str]:
    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.3g}"
        return str(value).replace("|", "\\|")
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]


def acceptance_table(config: dict) -> list[str]:
    """Markdown rows of the acceptance the config records, one per mix and temperature."""
    rows = []
    for mix, entry in acceptance_entries(config.get("acceptance", {})):
        temperature = entry.get("temperature", 0.0)
        rows.append([mix, "greedy" if not temperature else temperature, entry["tau"],
                     " ".join(f"{rate:.2f}" for rate in entry.get("acceptance_by_position", [])) or "-",
                     entry.get("prompts", "-"), entry.get("max_new_tokens", "-"),
                     entry.get("tokens_per_s_spec", "-")])
    if not rows:
        return ["No acceptance was measured at save time (train with held-out prompts, `--eval-prompts`)."]
    return _table(["traffic mix", "temperature", "tau", "acceptance by position", "prompts", "max new tokens",
                   "tokens/s (speculative)"], rows)


def _recipe_rows(training: dict) -> list[list[object]]:
    rows = []
    for key, value in sorted(training.items()):
        if isinstance(value, dict):
            rows += [[f"{key}.{inner}", json.dumps(item)] for inner, item in sorted(value.items())]
        else:
            rows.append([key, json.dumps(value)])
    return rows


def _medusa2_warning(config: dict) -> list[str]:
    """The model card's paragraph for heads trained jointly with a LoRA on the backbone."""
    drift = config["backbone_lora"].get("drift", {})
    measured = (f" Measured after training on held-out sequences: mean KL {drift['kl_per_token']:.4f} per token, "
                f"greedy agreement {drift['top1_agreement']:.3f}." if {"kl_per_token", "top1_agreement"} <= set(drift)
                else "")
    return ["**Medusa-2: these heads come with a LoRA on the backbone** "
            f"(`{config['backbone_lora']['path']}/`, peft's layout). `heads.load_heads` merges it into the model, so "
            "the outputs are those of the *tuned* backbone: lossless against the tuned model, **not** against the "
            f"original.{measured}", ""]


def model_card(config: dict, repo_id: str | None = None, license_id: str = "other",
               license_name: str | None = None, license_link: str | None = None,
               folder: str | os.PathLike | None = None) -> str:
    """The ``README.md`` of a published adapter (``folder``: where it is written, the snippet's
    adapter path when there is no ``repo_id``), checked by ``huggingface_hub.ModelCard``."""
    from huggingface_hub import ModelCard

    target = config["target"]
    recorded = target.get("name_or_path") or ""
    name = _hub_id(recorded) or Path(recorded).name or "the target model"
    location = repo_id or str(folder or "path/to/this/folder")
    load_target = _hub_id(target.get("name_or_path") or "") or target.get("name_or_path") or "TARGET_MODEL_DIR"
    lines = [front_matter(config, license_id, license_name, license_link), "",
             f"# {config['kind'].capitalize()} draft heads for {name}", "",
             "A speculative-decoding drafter trained with [selfdraft](https://pypi.org/project/selfdraft/) by "
             "self-distillation. It only proposes tokens; the target verifies them, so greedy outputs are identical "
             "to the target's own `generate` and sampled outputs follow its distribution.", "",
             *(_medusa2_warning(config) if config.get("backbone_lora") else []),
             "## Target (pinned)", "",
             "`heads.load_heads` refuses another target (`strict=True`); `strict=False` warns instead.", ""]
    lines += _table(["field", "value"], [[key, target.get(key)] for key in
                                         ("name_or_path", "revision", "model_type", "config_sha256",
                                          "weights_sha256", "vocab_size", "hidden_size", "dtype")
                                         + (("lora_sha256",) if target.get("lora_sha256") else ())])
    lines += ["", "## Drafter", ""]
    lines += _table(["field", "value"], [["kind", config["kind"]]] +
                    [[key, json.dumps(value)] for key, value in sorted(config["drafter"].items())])
    lines += ["", "## Training recipe", ""]
    recipe = _recipe_rows(config.get("training", {}))
    lines += _table(["field", "value"], recipe) if recipe else ["Not recorded."]
    lines += ["", "## Acceptance measured at save time", "",
              "tau: tokens committed per target forward (bonus token included).", ""]
    lines += acceptance_table(config)
    lines += ["", "## How to load", "", "```python", *loading_snippet(config, location, repo_id), "```", "",
              "Re-measure on your own traffic after a target update (exits non-zero when tau drops):", "",
              "```", *([f"hf download {repo_id} --local-dir ADAPTER_DIR"] if repo_id else []),
              f"selfdraft check --model {load_target} --adapter {'ADAPTER_DIR' if repo_id else location} "
              "--data prompts.jsonl", "```", ""]
    return str(ModelCard("\n".join(lines)))  # parses and checks the metadata block


def write_hub_folder(adapter_dir: str | os.PathLike, hub_dir: str | os.PathLike, repo_id: str | None = None,
                     license_id: str = "other", license_name: str | None = None,
                     license_link: str | None = None) -> Path:
    """Write ``hub_dir`` (atomically): the adapter's two files, checked, and its model card."""
    adapter_dir = Path(adapter_dir)
    config = read_config(adapter_dir)
    read_weights(adapter_dir)  # refuse a corrupt weights file before publishing it
    card = model_card(config, repo_id, license_id, license_name, license_link, folder=hub_dir)

    def copy(name: str):
        return lambda path: shutil.copyfile(adapter_dir / name, path)

    files = {CONFIG_NAME: copy(CONFIG_NAME), WEIGHTS_NAME: copy(WEIGHTS_NAME),
             CARD_NAME: lambda path: path.write_text(card)}
    if config.get("backbone_lora") is not None:  # Medusa-2: the backbone's LoRA travels with the heads
        folder = config["backbone_lora"]["path"]
        files[folder] = lambda path: shutil.copytree(adapter_dir / folder, path)
    write_directory(Path(hub_dir), files)
    return Path(hub_dir)


def _reachable(endpoint: str, timeout: float = 10.0) -> str | None:
    """None when a TCP connection to ``endpoint`` opens, else the reason."""
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return None
    except OSError as error:
        return f"{url.hostname}:{port}: {error}"


def _network_error(error: BaseException) -> bool:
    module = type(error).__module__ or ""
    return isinstance(error, OSError) or module.split(".")[0].rstrip("0123456789") in _NETWORK_MODULES


def push_folder(hub_dir: str | os.PathLike, repo_id: str, private: bool = False,
                commit_message: str = "Upload selfdraft adapter") -> str:
    """Upload ``hub_dir`` to the model repository ``repo_id`` (created when missing); the commit URL.

    Raises :class:`PublishError` when the folder is not a hub folder, no token is configured,
    offline mode is on, the hub cannot be reached, or the hub refuses the upload.
    """
    from huggingface_hub import HfApi, constants, get_token
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    hub_dir = Path(hub_dir)
    missing = [name for name in (CONFIG_NAME, WEIGHTS_NAME, CARD_NAME) if not (hub_dir / name).is_file()]
    if missing:
        raise PublishError(f"{hub_dir} lacks {missing}: write it with `selfdraft export --adapter DIR --hub-dir "
                           f"{hub_dir}` first")
    read_config(hub_dir)
    if constants.HF_HUB_OFFLINE:
        raise PublishError("HF_HUB_OFFLINE is set: unset it to upload")
    token = get_token()
    if not token:
        raise PublishError("no Hugging Face token: run `hf auth login` or set HF_TOKEN, then push again")
    endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    unreachable = _reachable(endpoint)
    if unreachable:
        raise PublishError(f"no network: cannot reach the hub at {endpoint} ({unreachable})")
    api = HfApi(endpoint=endpoint, token=token, library_name="selfdraft")
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_folder(repo_id=repo_id, folder_path=str(hub_dir), commit_message=commit_message)
    except OfflineModeIsEnabled as error:
        raise PublishError(f"offline mode is enabled: {error}") from error
    except HfHubHTTPError as error:
        raise PublishError(f"the hub refused the upload to {repo_id}: {error}") from error
    except Exception as error:
        if _network_error(error):
            raise PublishError(f"network error while uploading to {endpoint}: {error}") from error
        raise
    return str(getattr(info, "commit_url", info))
