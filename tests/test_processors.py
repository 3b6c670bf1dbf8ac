"""Logits processors beyond temperature/top_k/top_p/min_p: each one `generate` (or vLLM) applies is either modelled by
the old pass and the corrections, or named in a start-up warning (grpo_ratio issue 20; the table in
docs/truncation.md, "Logits processors").

The model is a tiny random Qwen2 with a scaled-up LM head (peaked logits, as a trained model has), in fp32 end to end:
the corrected old/sampler ratio is then 1 up to float rounding wherever the sampler's distribution is modelled.

Run: pytest tests/test_processors.py
"""

import inspect
import re
import warnings
from pathlib import Path

import pytest
import torch
from trainer_fixtures import peaked_model, tiny_grpo_args, tiny_trainer
from transformers import GenerationMixin
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from grpo_ratio.checks import check_processors
from grpo_ratio.corrections.processors import PROCESSORS, VLLM_PROCESSORS, RepetitionPenalty
from grpo_ratio.sampler.settings import settings_from_config


ROOT = Path(__file__).resolve().parents[1]
BAND_TOKENS = 0.01  # at most 1% of tokens out of [0.9, 1.1]
NOT_PROCESSORS = {"_eos_token_tensor", "do_sample", "max_length", "num_beams", "num_return_sequences", "use_cache",
                  "temperature", "top_k", "top_p", "min_p"}  # sampling itself, or read by a processor listed


def _train(tmp_path, model=None, **kwargs):
    settings = dict(max_steps=1, max_completion_length=12, bf16=False, top_k=20, truncation_correction="renormalize")
    settings.update(kwargs)
    trainer = tiny_trainer(tmp_path, "fp32_clone", model=model or peaked_model(scale=20.0), **settings)
    trainer.train()
    (row,) = [r for r in trainer.state.log_history if "loss" in r]
    return row


def _corrected_is_one(row):
    assert row["ratio/old_sampler_corrected/num_tokens"] >= 24
    assert abs(row["ratio/old_sampler_corrected/mean"] - 1.0) < 0.01
    assert row["ratio/old_sampler_corrected/oob_rate"] <= BAND_TOKENS


# ---------------------------------------------------------------------------------------------------------------------
# modelled: repetition_penalty (re-applied), removal-only processors with recorded kept sets


@pytest.mark.parametrize("source", ["recorded", "recompute"])
@pytest.mark.parametrize("correction", ["renormalize", "lift_sampler"])
def test_repetition_penalty_is_modelled(tmp_path, correction, source):
    # Unmodelled, this run's corrected mean was 1.06-1.07 (the penalty divides the logits of repeated tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # modelled: nothing to warn about
        row = _train(tmp_path, repetition_penalty=1.3, truncation_correction=correction, kept_set_source=source)
    _corrected_is_one(row)
    assert row["ratio/old_sampler/oob_rate"] > 0.2  # the raw ratio carries the penalty (and the top_k mass)


def test_repetition_penalty_through_generation_kwargs(tmp_path):
    _corrected_is_one(_train(tmp_path, generation_kwargs={"repetition_penalty": 1.3}))


def test_a_removal_only_processor_is_modelled_by_recorded_kept_sets(tmp_path):
    model = peaked_model(scale=20.0)
    model.generation_config.no_repeat_ngram_size = 1  # from the model's generation config: no token twice
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _corrected_is_one(_train(tmp_path, model=model))


def test_repetition_penalty_equals_transformers_processor():
    # Left-padded prompts, then completions: at every position, the penalty of exactly the prefix generate saw.
    g = torch.Generator().manual_seed(0)
    B, P, T, V = 3, 4, 5, 11
    input_ids = torch.randint(0, V, (B, P + T), generator=g)  # (B, P+T)
    attention_mask = torch.ones(B, P + T, dtype=torch.long)
    attention_mask[1, :2] = 0  # row 1 has two pads, whose ids must not count
    logits = torch.randn(B, T, V, generator=g) * 3  # (B, T, V)
    penalty = RepetitionPenalty(1.3, input_ids, attention_mask)
    cells = torch.arange(B * T)
    ours = penalty(logits.reshape(B * T, V), cells, T).reshape(B, T, V)
    processor = RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=(attention_mask != 0).int().argmax(dim=1))
    for t in range(T):
        expected = processor(input_ids[:, : P + t], logits[:, t].clone())  # (B, V)
        assert torch.equal(ours[:, t], expected), t


def test_no_effect_processors_are_silent_and_leave_the_ratio_at_one(tmp_path):
    # The third class: a log-softmax of the scores and NaN/inf removal leave the sampled distribution unchanged
    model = peaked_model(scale=20.0)
    model.generation_config.renormalize_logits = True
    model.generation_config.remove_invalid_values = True
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing to warn about
        _corrected_is_one(_train(tmp_path, model=model))


# ---------------------------------------------------------------------------------------------------------------------
# not modelled: warned at start-up, naming the field


def _warnings_of(tmp_path, model=None, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_trainer(tmp_path, "fp32_clone", model=model or peaked_model(scale=20.0), bf16=False, top_k=20,
                     **kwargs)
    return [str(w.message) for w in caught if "logits processors" in str(w.message)]


@pytest.mark.parametrize("field,value,kwargs", [
    ("no_repeat_ngram_size", 2, dict(truncation_correction="renormalize", kept_set_source="recompute")),
    ("suppress_tokens", [5, 6], dict(truncation_correction="lift_sampler", kept_set_source="recompute")),
    ("sequence_bias", {(7,): 2.0}, dict(truncation_correction="renormalize")),
    ("repetition_penalty", 1.3, dict()),  # truncation_correction="none": nothing is modelled
], ids=["masks-recompute", "suppress-recompute", "reweights", "none"])
def test_unmodelled_processors_are_named_at_start_up(tmp_path, field, value, kwargs):
    model = peaked_model(scale=20.0)
    if field == "repetition_penalty":
        kwargs = {**kwargs, "repetition_penalty": value}
    else:
        setattr(model.generation_config, field, value)
    (message,) = _warnings_of(tmp_path, model=model, **kwargs)
    assert f"{field}=" in message and PROCESSORS[field].effect in message


def test_vllm_sampling_kwargs_are_read_against_vllms_fields():
    args = tiny_grpo_args("out", generation_kwargs={"presence_penalty": 0.5, "min_tokens": 4}, repetition_penalty=1.2)
    settings = settings_from_config(args, vllm=True)
    assert settings.repetition_penalty == 1.2 and settings.engine == "vllm"
    assert dict(settings.processors) == {"repetition_penalty": 1.2, "presence_penalty": 0.5, "min_tokens": 4}
    with pytest.warns(UserWarning, match="presence_penalty=0.5.*min_tokens=4") as record:
        named = check_processors(dict(settings.processors), "renormalize", False, "config", VLLM_PROCESSORS)
    assert named == ["presence_penalty", "min_tokens"] and len(record) == 1


# the processor class generate builds for each field (temperature and truncation warpers are sampling itself)
FIELD_OF_CLASS = {
    "RepetitionPenaltyLogitsProcessor": "repetition_penalty", "NoRepeatNGramLogitsProcessor": "no_repeat_ngram_size",
    "NoBadWordsLogitsProcessor": "bad_words_ids", "SuppressTokensLogitsProcessor": "suppress_tokens",
    "SuppressTokensAtBeginLogitsProcessor": "begin_suppress_tokens", "MinLengthLogitsProcessor": "min_length",
    "MinNewTokensLengthLogitsProcessor": "min_new_tokens", "ForcedBOSTokenLogitsProcessor": "forced_bos_token_id",
    "ForcedEOSTokenLogitsProcessor": "forced_eos_token_id", "TypicalLogitsWarper": "typical_p",
    "EpsilonLogitsWarper": "epsilon_cutoff", "EtaLogitsWarper": "eta_cutoff", "TopHLogitsWarper": "top_h",
    "SequenceBiasLogitsProcessor": "sequence_bias", "ExponentialDecayLengthPenalty": "exponential_decay_length_penalty",
    "LogitNormalization": "renormalize_logits", "InfNanRemoveLogitsProcessor": "remove_invalid_values",
}
SAMPLING_CLASSES = {"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
                    "SamplerLogprobRecorder"}


@pytest.mark.parametrize("trl_penalty,model_penalty", [(1.2, 1.5), (1.0, 1.3)], ids=["trl-field", "model-only"])
def test_the_settings_read_are_what_generate_builds(tmp_path, monkeypatch, trl_penalty, model_penalty):
    # TRL's fields, generation_kwargs and the model's generation_config together: the processors the trainer reads
    # (and warns about or models) are exactly the ones generate builds during the rollouts, with the same penalty.
    # TRL always passes its repetition_penalty, so the model's own is overridden (docs/truncation.md).
    built = []
    build = GenerationMixin._get_logits_processor

    def spy(self, *args, **kwargs):
        processors = build(self, *args, **kwargs)
        built.append(list(processors))
        return processors

    monkeypatch.setattr(GenerationMixin, "_get_logits_processor", spy)
    model = peaked_model(scale=20.0)
    config = model.generation_config
    config.repetition_penalty, config.no_repeat_ngram_size, config.min_new_tokens = model_penalty, 3, 2
    config.suppress_tokens = [5]
    trainer = tiny_trainer(tmp_path, "fp32_clone", model=model, bf16=False, max_steps=1, top_k=20,
                           repetition_penalty=trl_penalty, generation_kwargs={"typical_p": 0.95},
                           truncation_correction="renormalize")
    trainer.train()
    assert len(built) >= 1
    for processors in built:
        names = [type(p).__name__ for p in processors]
        assert set(names) - SAMPLING_CLASSES <= set(FIELD_OF_CLASS), names  # every class is mapped here
        fields = {FIELD_OF_CLASS[n] for n in names if n in FIELD_OF_CLASS}
        # generate turns min_new_tokens into min_length = prompt + min_new_tokens as well (_prepare_generated_length):
        # the same EOS removal, one row of the table
        fields -= {"min_length"} if "min_new_tokens" in fields else set()
        assert fields == set(dict(trainer.sampling.processors)), names
        penalties = [p.penalty for p in processors if isinstance(p, RepetitionPenaltyLogitsProcessor)]
        assert penalties == ([trl_penalty] if trl_penalty != 1.0 else [])
    assert trainer.sampling.repetition_penalty == trl_penalty
    assert {"no_repeat_ngram_size", "min_new_tokens", "suppress_tokens", "typical_p"} <= set(
        dict(trainer.sampling.processors))  # the model's fields and generation_kwargs' are read


# ---------------------------------------------------------------------------------------------------------------------
# the table is complete: every field generate's processor factory reads, every row in the docs


def test_every_generate_processor_field_is_in_the_table():
    source = inspect.getsource(GenerationMixin._get_logits_processor)
    fields = set(re.findall(r"generation_config\.(\w+)", source))
    assert fields - NOT_PROCESSORS - set(PROCESSORS) == set()
    assert "renormalize_logits" in fields and "repetition_penalty" in fields  # the parse found the factory's fields


def test_docs_table_names_every_processor():
    text = (ROOT / "docs" / "truncation.md").read_text()
    section = text[text.index("## Logits processors"):]
    for name in (*PROCESSORS, *VLLM_PROCESSORS):
        assert f"| `{name}`" in section, name
