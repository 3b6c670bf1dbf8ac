"""Start-up lints that catch a sampler/trainer mismatch before it costs a run (grpo_ratio/checks.py), and the IS
weights logged under `lift_sampler`. The end-to-end versions against a real vLLM engine are in tests/vllm_lane.

Run: pytest tests/test_lints.py
"""

import json
import warnings

import pytest
import torch

from grpo_ratio import RatioGRPOConfig
from grpo_ratio.checks import check_calibration, check_vllm, old_body_dtype, old_side_dtype
from grpo_ratio.testing import tiny_model


def _vllm_args(**kw):
    base = dict(output_dir="unused", use_cpu=True, use_vllm=True, vllm_mode="colocate", report_to="none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # config-time warnings are not under test here
        return RatioGRPOConfig(**{**base, **kw})


def _caught(args, engine, trainer):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_vllm(args, engine, trainer)
    return [str(w.message) for w in caught]


def test_engine_dtype_differs_from_the_old_log_probs():
    # TRL passes no dtype: vLLM runs an fp32 checkpoint in bf16; an fp32 trainer (bf16=False) then disagrees
    args = _vllm_args(bf16=False, old_logprob_mode="fp32_clone")
    (message,) = _caught(args, torch.bfloat16, torch.float32)
    assert "vLLM samples in torch.bfloat16 but the old log-probs are computed in torch.float32" in message
    assert "vllm_dtype='float32'" in message
    assert _caught(args, torch.float32, torch.float32) == []  # vllm_dtype="float32": nothing to say


def test_bf16_trainer_and_bf16_engine_agree():
    args = _vllm_args(bf16=True, old_logprob_mode="bf16")
    assert old_side_dtype(args, torch.bfloat16) == torch.bfloat16
    assert _caught(args, torch.bfloat16, torch.bfloat16) == []


def _caught_heads(args, engine, trainer, engine_head):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_vllm(args, engine, trainer, engine_head)
    return [str(w.message) for w in caught]


def test_fp32_head_on_one_side_only_names_the_other_sides_switch():
    # trainer side only: the bodies agree (bf16), the heads do not; the fix is the sampler-side counterpart
    args = _vllm_args(bf16=True, old_logprob_mode="fp32_head")
    (message,) = _caught(args, torch.bfloat16, torch.bfloat16)
    assert "an fp32 LM head on the trainer side only" in message and "moves the old/sampler gap" in message
    assert "vllm_lm_head_fp32=True" in message and """--hf-overrides '{"head_dtype": "float32"}'""" in message
    # both heads in fp32 (vllm_lm_head_fp32=True: the engine reports head_dtype float32): nothing to say
    both = _vllm_args(bf16=True, old_logprob_mode="fp32_head", vllm_lm_head_fp32=True)
    assert _caught_heads(both, torch.bfloat16, torch.bfloat16, torch.float32) == []
    # sampler side only: the fix is the trainer-side counterpart
    sampler_only = _vllm_args(bf16=True, old_logprob_mode="bf16", vllm_lm_head_fp32=True)
    (message,) = _caught_heads(sampler_only, torch.bfloat16, torch.bfloat16, torch.float32)
    assert "an fp32 LM head on the sampler side only" in message and "old_logprob_mode='fp32_head'" in message


def test_fp32_head_bodies_compare_at_the_training_precision():
    # fp32_head upcasts only the head: its body is the bf16 training forward, so a bf16 engine matches the body
    args = _vllm_args(bf16=True, old_logprob_mode="fp32_head", vllm_lm_head_fp32=True)
    assert old_body_dtype(args, torch.bfloat16) == torch.bfloat16 and old_side_dtype(args, torch.bfloat16) == torch.float32
    assert not any("vllm_dtype=" in m for m in _caught_heads(args, torch.bfloat16, torch.bfloat16, torch.float32))
    # an fp32 engine against that bf16 body: the body lint names vllm_dtype
    (message,) = _caught_heads(args, torch.float32, torch.bfloat16, torch.float32)
    assert "vllm_dtype='bfloat16'" in message


def test_lift_sampler_names_the_is_metrics_the_loss_uses():
    args = _vllm_args(top_p=0.8, truncation_correction="lift_sampler")
    messages = _caught(args, torch.bfloat16, torch.bfloat16)
    assert any("ratio/importance_sampling_ratio/*" in m for m in messages)


def test_server_mode_names_the_dtype_flag():
    args = _vllm_args(vllm_mode="server", bf16=False)
    messages = _caught(args, None, torch.float32)
    assert any("trl vllm-serve --dtype float32" in m for m in messages)
    head = _vllm_args(vllm_mode="server", bf16=True, old_logprob_mode="fp32_head")
    (message,) = _caught(head, None, torch.bfloat16)
    assert """trl vllm-serve --dtype bfloat16 --hf-overrides '{"head_dtype": "float32"}'""" in message


@pytest.mark.parametrize("kw,match", [
    (dict(vllm_dtype="fp32"), "vllm_dtype='fp32' is not allowed"),
    (dict(vllm_dtype="float32", vllm_mode="server"), "trl vllm-serve --dtype float32"),
    (dict(vllm_lm_head_fp32=True, vllm_mode="server"), """--hf-overrides '\\{"head_dtype": "float32"\\}'"""),
    (dict(vllm_lm_head_fp32=True, use_vllm=False), "vllm_lm_head_fp32=True sets TRL's colocate engine"),
    (dict(vllm_lm_head_fp32="yes"), "vllm_lm_head_fp32 must be True or False"),
])
def test_vllm_dtype_is_validated(kw, match):
    with pytest.raises(ValueError, match=match):
        _vllm_args(**kw)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_logged_is_weights_are_trls_formula(level):
    from accelerate import Accelerator

    from grpo_ratio.diagnostics.ratio_diagnostics import RatioDiagnostics

    args = _vllm_args()
    from trainer_fixtures import config_plan

    diagnostics = RatioDiagnostics(args, Accelerator(cpu=True), eos_token_ids=[1], plan=config_plan(args))
    mask = torch.tensor([[True, True, False], [True, False, False]])
    if level == "token":
        weights = torch.tensor([[0.5, 2.0, 9.0], [1.0, 9.0, 9.0]])  # 9.0 only on masked cells
        expected = (0.5, (0.5 + 2.0 + 1.0) / 3, 2.0)
    else:
        weights = torch.tensor([[0.25], [3.0]])
        expected = (0.25, 1.625, 3.0)
    metrics = diagnostics.importance_sampling_metrics(weights, mask)
    assert [metrics[f"ratio/importance_sampling_ratio/{k}"] for k in ("min", "mean", "max")] == pytest.approx(expected)


# ---------------------------------------------------------------------------------------------------------------------
# check_calibration: a guided_fp32_layers calibration file against the trained model


def _guided_args(tmp_path, **record):
    calib = tmp_path / "calibration.json"
    calib.write_text(json.dumps({"guided_fp32_layers": [0, 1], **record}))
    return RatioGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", old_logprob_mode="guided_fp32",
                           guided_fp32_layers=str(calib))


def _named_tiny(name_or_path: str):
    model = tiny_model("qwen2")  # 2 decoder layers
    model.config.name_or_path = name_or_path
    return model


def test_calibration_for_another_layer_count_fails(tmp_path):
    args = _guided_args(tmp_path, model="HuggingFaceTB/SmolLM2-135M-Instruct", ranking=list(range(30)))
    with pytest.raises(ValueError, match=r"calibration for HuggingFaceTB/SmolLM2-135M-Instruct with 30 decoder "
                                         r"layers, but the trained model has 2; .*probe calibrate"):
        check_calibration(args, _named_tiny("HuggingFaceTB/SmolLM2-135M-Instruct"))


@pytest.mark.parametrize("name_or_path", [
    "HuggingFaceTB/SmolLM2-135M-Instruct",
    "/root/.cache/huggingface/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/12fd25f77366fa6b",
    "/root/.cache/grpo_ratio/SmolLM2-135M-Instruct/",  # the converted GGUF (grpo_ratio.models)
    "",  # an in-memory model with no name: nothing to compare
])
def test_calibration_for_the_same_model_passes(tmp_path, name_or_path):
    args = _guided_args(tmp_path, model="HuggingFaceTB/SmolLM2-135M-Instruct", num_layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_calibration(args, _named_tiny(name_or_path))


def test_calibration_for_another_model_warns(tmp_path):
    args = _guided_args(tmp_path, model="Qwen/Qwen2.5-0.5B-Instruct", num_layers=2)
    with pytest.warns(UserWarning, match=r"calibration for model 'Qwen/Qwen2.5-0.5B-Instruct', but the trained "
                                         r"model is 'HuggingFaceTB/SmolLM2-135M-Instruct'"):
        check_calibration(args, _named_tiny("HuggingFaceTB/SmolLM2-135M-Instruct"))


def test_layer_indices_and_old_files_are_not_checked(tmp_path):
    indices = RatioGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                              old_logprob_mode="guided_fp32", guided_fp32_layers="0,1")
    unrecorded = _guided_args(tmp_path)  # a file without model or per-layer lists: nothing to compare
    for args in (indices, unrecorded):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_calibration(args, _named_tiny("some/model"))


@pytest.mark.parametrize("mode", ["bf16", "fp32_clone", "fp16_clone", "fp32_head"])
def test_a_scoring_mode_in_an_fp32_run_is_said(tmp_path, caplog, mode):
    # a fresh user's finding: with bf16=False and fp32 weights, fp32_clone/fp32_head measured mean |log r| = 0 (no
    # effect, only cost) and fp16_clone put up to 10% of SmolLM2's tokens out of band (a gap it opened)
    from trainer_fixtures import tiny_trainer

    with caplog.at_level("WARNING", logger="grpo_ratio"):
        tiny_trainer(tmp_path / "fp32", mode, model=tiny_model("qwen2"), bf16=False, max_steps=1)
        said = [m for m in caplog.messages if "with a training forward in fp32" in m]
        if mode == "bf16":
            assert said == []  # TRL's own: nothing to say
        else:
            (message,) = said
            assert f"old_logprob_mode='{mode}'" in message and "use old_logprob_mode='bf16'" in message
            assert ("opens a precision gap" in message) == (mode == "fp16_clone")
        caplog.clear()
        # bf16 autocast, or bf16-stored weights without it: the modes close a gap; nothing to say
        tiny_trainer(tmp_path / "bf16", mode, model=tiny_model("qwen2"), bf16=True, max_steps=1)
        tiny_trainer(tmp_path / "w", mode, model=tiny_model("qwen2", dtype=torch.bfloat16), bf16=False, max_steps=1)
        assert not [m for m in caplog.messages if "with a training forward in fp32" in m]


def test_an_empty_dataset_is_said_to_be_empty_not_missing_its_prompt_column(tmp_path):
    # the issue: a dataset built from no rows has no columns either, and was reported as "no 'prompt' column"
    from datasets import Dataset
    from trainer_fixtures import tiny_grpo_args

    from grpo_ratio import RatioGRPOTrainer
    from grpo_ratio.checks import check_train_dataset
    from grpo_ratio.testing import letter_reward, tiny_tokenizer

    emptied = Dataset.from_dict({"prompt": ["a"], "answer": ["b"]}).filter(lambda row: False)
    for dataset, columns in ((Dataset.from_list([]), "no columns"),
                             (Dataset.from_dict({"prompt": []}), "columns 'prompt'"),
                             (emptied, "columns 'prompt', 'answer'")):
        with pytest.raises(ValueError, match=rf"^train_dataset is empty \(0 rows\): there is nothing to train on "
                                             rf"\({columns}\)"):
            check_train_dataset(dataset)
    with pytest.raises(ValueError, match=r"^train_dataset is empty \(0 rows\): there is nothing to train on \(no "):
        RatioGRPOTrainer(model=tiny_model("qwen2"), reward_funcs=letter_reward, args=tiny_grpo_args(tmp_path),
                         train_dataset=Dataset.from_list([]), processing_class=tiny_tokenizer())
    # a dataset with rows but no prompts is still the missing column, and rows with prompts pass
    with pytest.raises(ValueError, match="no 'prompt' column"):
        check_train_dataset(Dataset.from_dict({"question": ["2+2?"]}))
    check_train_dataset(Dataset.from_dict({"prompt": ["2+2?"]}))
    check_train_dataset(Dataset.from_dict({"prompt": ["2+2?"]}).to_iterable_dataset())  # streamed: length unknown
