"""Start-up lints of `RatioGRPOTrainer`: checks that need the model or the generation backend, run once when the
trainer is built (config-only checks live in `RatioGRPOConfig.__post_init__`). Each one either refuses a setup that
would be silently wrong (`ValueError` naming the fields and the fix) or warns about one that makes the ratio measure
something the user may not expect (`UserWarning` naming the fields and the fix). docs/compatibility.md lists them.
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path

import torch
from torch import nn

from .config import VLLM_FP32_HEAD_FLAG
from .corrections import check_head_is_linear
from .forward import model_anatomy
from .processors import PROCESSORS, VLLM_PROCESSORS, check_processors
from .rollouts import SamplingSettings
from .sharding import engine_of


# config fields of transformers models that set a dropout probability applied inside the forward
_DROPOUT_FIELDS = ("attention_dropout", "hidden_dropout", "hidden_dropout_prob", "attention_probs_dropout_prob",
                   "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout", "activation_dropout")
# module names of learned absolute position embeddings (GPT-2 `wpe`, OPT/BART `embed_positions`, BERT-style)
_ABSOLUTE_POSITION_MODULES = ("wpe", "embed_positions", "position_embeddings")


def check_sampling(args, sampling: SamplingSettings) -> None:
    """Truncated sampling against `truncation_correction`, with the settings generation really uses (`sampling`:
    on the transformers path unset fields come from the model's `generation_config`, e.g. a shipped `min_p`).

    (Beam search or greedy decoding with a correction is refused where the plan is resolved, `grpo_ratio.plan`.)

    Warns (UserWarning): a correction where sampling is neither truncated nor processed otherwise (it changes
        nothing; logits processors are `grpo_ratio.processors.check_processors`'s); truncation that feeds
        the importance ratio (vLLM IS correction, `off_policy_mask_threshold` with `sampler_logprobs_in_loss`)
        uncorrected; truncation with no correction at all (the diagnostics will show the kept mass).
    """
    correction = args.truncation_correction
    if correction != "none" and not sampling.truncated and not sampling.processors:
        warnings.warn(f"truncation_correction={correction!r} has no effect: sampling is not truncated "
                      f"(top_p=1, top_k=0, no min_p in the {sampling.source}); ratio/kept_mass_mean will be 1",
                      stacklevel=3)
        return
    if correction != "none" or not sampling.truncated:
        return
    sampler_in_loss = (args.use_vllm and args.vllm_importance_sampling_correction) or (
        args.off_policy_mask_threshold is not None and (args.use_vllm or args.sampler_logprobs_in_loss))
    where = "sampler log-probs feed the importance ratio" if sampler_in_loss else "ratio/old_sampler/* will show it"
    warnings.warn(f"sampling is truncated ({sampling.describe()}, from the {sampling.source}) but "
                  f"truncation_correction='none': the sampler's log-probs are renormalised over the kept tokens, the "
                  f"trainer's are not, so old/sampler carries the kept mass ({where}; at top_p=0.8 about half the "
                  f"tokens leave [0.9, 1.1]). Set truncation_correction='renormalize' or 'lift_sampler'.", stacklevel=3)


def check_train_dataset(dataset) -> None:
    """Refuse a training set TRL would mishandle: an empty one (TRL trains 0 steps and exits 0) and one without a
    `prompt` column (TRL fails with a KeyError deep inside a step). Streamed datasets whose columns are unknown, and
    anything without `column_names`/`len` (TRL's own errors apply), pass.

    Raises:
        ValueError: no rows, or no `prompt` column (naming the columns the dataset has).
    """
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, list) and "prompt" not in columns:
        raise ValueError(f"train_dataset has no 'prompt' column (GRPO reads the prompts from it); its columns are: "
                         f"{', '.join(map(repr, columns)) or 'none'}. Rename one, e.g. dataset.rename_column("
                         f"'question', 'prompt'), or map your rows to {{'prompt': ...}}")
    try:
        rows = len(dataset)
    except TypeError:  # a streamed dataset: its length is not known
        return
    if rows == 0:
        raise ValueError("train_dataset is empty (0 rows): there is nothing to train on")


def active_dropout(model: nn.Module) -> list[str]:
    """Names of the dropouts with p > 0 in `model`: `nn.Dropout` modules (e.g. PEFT's `lora_dropout`) and config
    fields applied inside the forward (e.g. `attention_dropout`), as `name=p` strings."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            key = name.split(".")[-2] if name.split(".")[-1] in ("default",) else name.split(".")[-1]
            found.setdefault(key, module.p)
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    for field in _DROPOUT_FIELDS:
        value = getattr(text_config, field, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            found.setdefault(field, value)
    return [f"{k}={v}" for k, v in found.items()]


def check_dropout(args, model: nn.Module) -> None:
    """Warn when dropout is active in training (TRL's `disable_dropout=False`): the training forward samples dropout
    masks, so new/old at the first inner step measures dropout noise, not precision. grpo_ratio's scoring modes
    compute old log-probs without dropout (deterministic); TRL's own pass (`bf16` with an old pass) samples it."""
    if args.disable_dropout:
        return
    dropout = active_dropout(model)
    if dropout:
        warnings.warn(f"dropout is active during training ({', '.join(dropout)}) and disable_dropout=False: the "
                      f"training forward draws dropout masks, so new/old at the first inner step carries dropout noise "
                      f"(grpo_ratio's scoring modes score without dropout). Set disable_dropout=True for a ratio that "
                      f"measures precision only.", stacklevel=3)


def uses_absolute_positions(model: nn.Module) -> bool:
    """Whether the model adds learned absolute position embeddings (GPT-2 `wpe`, OPT `embed_positions`, ...)."""
    return any(isinstance(m, nn.Embedding) and name.split(".")[-1] in _ABSOLUTE_POSITION_MODULES
               for name, m in model.named_modules())


def check_positions(args, model: nn.Module) -> None:
    """Warn for models with absolute position embeddings: TRL passes no `position_ids`, so with left-padded prompts
    its own forward (the training forward, and the old pass of `bf16`) puts a completion at positions shifted by
    its prompt's padding, unlike `generate`. grpo_ratio's modes use generate's positions, so new/old shows it."""
    if uses_absolute_positions(model):
        warnings.warn(f"{type(model).__name__} uses absolute position embeddings and TRL passes no position_ids: with "
                      f"left-padded prompts TRL's training forward (and old_logprob_mode='bf16') scores completions at "
                      f"positions shifted by their prompt's padding, while generate and grpo_ratio's other scoring "
                      f"modes count positions from the attention mask. Expect new/old to show this; prompts of one "
                      f"length (no left padding) avoid it (docs/compatibility.md).", stacklevel=3)


def old_side_dtype(args, trainer_dtype: torch.dtype) -> torch.dtype:
    """The precision of the old log-probs' LM head: fp32 for the fp32 modes, fp16 for `fp16_clone`, the training
    forward's for `bf16` and `sampler` (whose new side is the training forward)."""
    if args.old_logprob_mode in ("fp32_clone", "fp32_head", "guided_fp32") or args.cast_lm_head_to_fp32:
        return torch.float32
    return torch.float16 if args.old_logprob_mode == "fp16_clone" else trainer_dtype


def old_body_dtype(args, trainer_dtype: torch.dtype) -> torch.dtype:
    """The precision of the old log-probs' body (the decoder layers): fp32 for `fp32_clone`, fp16 for `fp16_clone`,
    the training forward's otherwise (`fp32_head` and `guided_fp32` upcast only the head and a few layers)."""
    return {"fp32_clone": torch.float32, "fp16_clone": torch.float16}.get(args.old_logprob_mode, trainer_dtype)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_vllm(args, engine_dtype: torch.dtype | None, trainer_dtype: torch.dtype,
               engine_head_dtype: torch.dtype | None = None) -> None:
    """Sampler/trainer mismatches that cost a run before it starts, with vLLM.

    Args:
        engine_dtype: the colocate engine's `model_config.dtype`; None in server mode (unknown here).
        engine_head_dtype: its `model_config.head_dtype` (fp32 with `vllm_lm_head_fp32`); None = `engine_dtype`.

    Warns (UserWarning): the engine's body samples in another dtype than the trainer's old log-probs (TRL passes
    none: vLLM downcasts an fp32 checkpoint; on SmolLM2 a bf16 engine is 0.26 nats off an fp32 trainer, an fp32
    engine 3e-5); with the bodies alike, an fp32 LM head on one side only (the trainer's `fp32_head`/`guided_fp32`/
    `cast_lm_head_to_fp32`, or the sampler's `vllm_lm_head_fp32`): it moves the old/sampler gap rather than closing it
    (NeMo-RL #3936; prime-rl runs both heads in fp32), and the message names the other side's switch;
    `lift_sampler` with TRL's own `sampling/importance_sampling_ratio/*`, which TRL computes before the lift (the
    weights the loss uses are logged as `ratio/importance_sampling_ratio/*`); server mode, where the engine's dtypes
    cannot be read here (the message names the `vllm serve` flags).
    """
    if not args.use_vllm:
        return
    body, head = old_body_dtype(args, trainer_dtype), old_side_dtype(args, trainer_dtype)
    if engine_dtype is not None and engine_dtype != body:
        warnings.warn(f"vLLM samples in {engine_dtype} but the old log-probs are computed in {body} "
                      f"(old_logprob_mode={args.old_logprob_mode!r}, bf16={args.bf16}): old/sampler and TRL's "
                      f"importance-sampling ratio carry that precision gap. Set vllm_dtype={_name(body)!r} to sample "
                      f"in the same dtype.", stacklevel=3)
    if engine_dtype is None and args.vllm_mode == "server":
        head_flag = f" {VLLM_FP32_HEAD_FLAG}" if head == torch.float32 and body != torch.float32 else ""
        warnings.warn(f"vLLM server mode: the engine's dtype is set where the server starts; start it with `trl "
                      f"vllm-serve --dtype {_name(body)}{head_flag}` so that the sampler matches the old log-probs "
                      f"({body} body, {head} LM head)", stacklevel=3)
    engine_head = engine_head_dtype or engine_dtype
    if engine_dtype is None or engine_dtype != body or engine_head == head:
        pass  # no engine to compare, the body lint above already names the fix, or the heads agree
    elif head == torch.float32:
        warnings.warn(f"an fp32 LM head on the trainer side only (old_logprob_mode={args.old_logprob_mode!r}, "
                      f"cast_lm_head_to_fp32={args.cast_lm_head_to_fp32}) while vLLM runs its head in {engine_head}: "
                      f"an fp32 head on one side moves the old/sampler gap rather than closing it. Set "
                      f"vllm_lm_head_fp32=True (a server: {VLLM_FP32_HEAD_FLAG}) for the sampler-side twin",
                      stacklevel=3)
    elif engine_head == torch.float32:
        warnings.warn(f"an fp32 LM head on the sampler side only (vllm_lm_head_fp32=True) while the old log-probs "
                      f"use a {head} head (old_logprob_mode={args.old_logprob_mode!r}): an fp32 head on one side "
                      f"moves the old/sampler gap rather than closing it. Set old_logprob_mode='fp32_head' (or "
                      f"cast_lm_head_to_fp32=True) for the trainer-side twin", stacklevel=3)
    if args.truncation_correction == "lift_sampler" and args.vllm_importance_sampling_correction:
        warnings.warn("truncation_correction='lift_sampler': TRL computes its logged sampling/importance_sampling_"
                      "ratio/* before the lift (it still carries the kept mass); the lifted weights the loss uses "
                      "are logged as ratio/importance_sampling_ratio/*", stacklevel=3)


def _model_key(name: str) -> str:
    """A model's name without owner or location, lower-cased, so that a hub id, its hub-cache snapshot
    (`.../models--Owner--Name/snapshots/<hash>`) and a converted copy (`~/.cache/grpo_ratio/Name`) compare equal."""
    hub_cache = re.search(r"models--([^/\\]+)", name)
    if hub_cache:
        name = hub_cache.group(1).replace("--", "/")
    return Path(name.rstrip("/\\")).name.lower()


def check_calibration(args, model: nn.Module) -> None:
    """A `guided_fp32_layers` calibration file against the model being trained (`args.guided_fp32_calibration`,
    kept by `RatioGRPOConfig` when `guided_fp32_layers` is a file; nothing to check otherwise).

    Raises:
        ValueError: the file was measured on a model with another number of decoder layers: its layer choice (and
            even its indices) belong to another architecture.
    Warns (UserWarning): the file names another model (same layer count): the layers that carry the batch-shape
        divergence differ between models, so its choice may not be the right one for this model.
    """
    calibration = getattr(args, "guided_fp32_calibration", None)
    if not calibration:
        return
    num_layers = len(model_anatomy(model).layers)
    path, recorded = calibration["path"], calibration.get("model")
    fix = (f"measure this model with `grpo-ratio probe calibrate --model <it> --calibration-out FILE` and pass FILE, "
           f"or pass layer indices (guided_fp32_layers='0,{num_layers - 1}')")
    if calibration.get("num_layers") is not None and calibration["num_layers"] != num_layers:
        raise ValueError(f"guided_fp32_layers={path!r} is a calibration for {recorded or 'another model'} with "
                         f"{calibration['num_layers']} decoder layers, but the trained model has {num_layers}; "
                         f"{fix}")
    name = getattr(getattr(model, "config", None), "name_or_path", "") or ""
    if recorded and name and _model_key(recorded) != _model_key(name):
        warnings.warn(f"guided_fp32_layers={path!r} is a calibration for model {recorded!r}, but the trained model is "
                      f"{name!r}: the layers that carry the bf16 batch-shape divergence differ between models, so its "
                      f"choice {args.guided_fp32_layer_ids} may not suit this one; {fix}", stacklevel=3)


def colocate_engine_dtypes(trainer) -> tuple:
    """(dtype, LM head dtype) of a trainer's colocate vLLM engine (vLLM's resolved `model_config.dtype`,
    `.head_dtype`), or (None, None) without one (server mode: unknown here)."""
    if not (trainer.use_vllm and trainer.vllm_mode == "colocate"):
        return None, None
    config = trainer.vllm_generation.llm.llm_engine.model_config
    return config.dtype, getattr(config, "head_dtype", config.dtype)


def training_dtype(args, policy: nn.Module) -> torch.dtype:
    """The dtype the training forward computes in: the autocast dtype (TRL's `bf16`/`fp16`), else the weights'."""
    if args.bf16:
        return torch.bfloat16
    if args.fp16:
        return torch.float16
    return next(policy.parameters()).dtype


def check_fsdp2_rounding(engine: str, args, anchor_is_policy: bool) -> None:
    """Warn that FSDP2 with a bf16 mixed-precision policy rounds TRL's per-token log-probs to bf16 where the old side
    is the policy's own pass (`bf16`, `sampler`); the other modes return fp32 (docs/distributed.md)."""
    if engine == "fsdp2" and args.bf16 and anchor_is_policy:
        warnings.warn("FSDP2 with a bf16 mixed-precision policy returns TRL's per-token log-probs rounded to bf16 "
                      "(up to 1.5e-2 nats, on both sides of every ratio). old_logprob_mode='bf16' keeps TRL's numbers "
                      "bit for bit, rounding included; every other mode returns the training forward's log-probs in "
                      "fp32 (docs/distributed.md)", stacklevel=4)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls natively (x86 AVX512-BF16 or AMX, as torch's oneDNN kernels use them);
    False on CPUs where torch emulates bf16 (AVX2-only x86: measured ~50x slower than fp32 for a SmolLM2-sized
    matmul on a 2-core AMD EPYC, docs/benchmarks.md)."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def check_cpu_precision(args, device_type: str) -> None:
    """Say before training (a `grpo_ratio` logger warning, once per process; not a Python warning, which test suites
    turn into errors) when bf16/fp16 autocast runs on a CPU without native bf16: every step is emulated and many times
    slower than in fp32, which is not the cost a GPU pays."""
    global _said_cpu_precision
    if device_type != "cpu" or not (args.bf16 or args.fp16) or _said_cpu_precision or cpu_has_native_bf16():
        return
    _said_cpu_precision = True
    logging.getLogger("grpo_ratio").warning(
        "%s=True on a CPU without native bf16 (no AVX512-BF16/AMX): autocast is emulated and each step is many times "
        "slower than in fp32 (times do not carry over to a GPU). The ratio is then measured at that precision, as the "
        "precision arms intend; for a quick look at the diagnostics use bf16=False "
        "(recipes/smollm2-135m/quickstart_cpu.yaml)", "bf16" if args.bf16 else "fp16")


_said_cpu_precision = False


def check_mode_precision(args, trainer_dtype: torch.dtype) -> None:
    """Say before training (a `grpo_ratio` logger warning, as `check_cpu_precision`) when the scoring mode cannot close
    a gap because the training forward already runs in fp32 (`bf16=False`, `fp16=False`, fp32 weights): the fp32 modes
    then compute the policy's own log-probs again (the same up to fp32 rounding: cost, no effect), and `fp16_clone`
    rounds them to fp16, which opens a gap (new/old out of band, clip flips) instead of closing one."""
    mode = args.old_logprob_mode
    if trainer_dtype != torch.float32 or mode not in ("fp32_clone", "fp32_head", "guided_fp32", "fp16_clone"):
        return
    what = ("rounds the old log-probs to fp16: it opens a precision gap (new/old out of band, PPO clip flips) "
            "instead of closing one" if mode == "fp16_clone" else
            "computes the policy's own fp32 log-probs again: the same up to fp32 rounding, so the mode adds cost "
            "and no effect")
    logging.getLogger("grpo_ratio").warning(
        "old_logprob_mode=%r with a training forward in fp32 (bf16=False, fp16=False, fp32 weights) %s. The scoring "
        "modes are for bf16/fp16 training; in fp32 use old_logprob_mode='bf16' (TRL's own, r = 1 exactly)", mode, what)


def check_r2_has_an_old_pass(plan) -> None:
    """Warn when `routing_replay="R2"` has nothing to replay: R2 replays the old pass's routes in the updates, and in
    TRL's on-policy default with `old_logprob_mode="bf16"` (or `fp32_head` fused) no old pass runs; the one update
    per generation is the old policy's forward itself."""
    if plan.routing_replay == "R2" and not plan.runs_old_pass:
        warnings.warn("routing_replay='R2' has nothing to replay in this run: no old pass runs (TRL's on-policy "
                      "default: num_iterations=1, steps_per_generation == gradient_accumulation_steps, and "
                      f"old_logprob_mode={plan.scorer_mode or 'bf16'!r} "
                      "without one), so the only update of each generation routes as the old policy. R2 acts with "
                      "num_iterations > 1 or a scoring mode's old pass; routing_replay='R3' replays the sampler's "
                      "routes (docs/moe.md)", stacklevel=4)


def lint_trainer(trainer, policy: nn.Module) -> None:
    """Every start-up check of a `RatioGRPOTrainer` that needs the model (the config-only ones ran in the config):
    the LM head for a correction, the sampling settings and logits processors the rollouts use, dropout, positions,
    a calibration file made for another model, the vLLM engine's dtypes, FSDP2's bf16 rounding, a scoring mode in an
    fp32 run. Warns or raises as each check documents."""
    args, sampling, plan = trainer.args, trainer.plan.sampling, trainer.plan
    check_head_is_linear(args.truncation_correction, policy.config)
    check_sampling(args, sampling)
    check_processors(dict(sampling.processors), plan.correction, plan.records_kept_sets, sampling.source,
                     VLLM_PROCESSORS if sampling.engine == "vllm" else PROCESSORS)
    check_dropout(args, policy)
    check_positions(args, policy)
    check_calibration(args, policy)
    engine_dtype, engine_head_dtype = colocate_engine_dtypes(trainer)
    trainer_dtype = training_dtype(args, policy)
    check_vllm(args, engine_dtype, trainer_dtype, engine_head_dtype)
    check_fsdp2_rounding(engine_of(trainer.accelerator), args, plan.anchor_is_policy)
    check_cpu_precision(args, trainer.accelerator.device.type)
    check_mode_precision(args, trainer_dtype)
    check_r2_has_an_old_pass(plan)
