"""Truncated-sampling correction in RatioGRPOTrainer (transformers generate path), on a tiny model.

A tiny random model is near-uniform, so top_p=0.8 keeps ~80% of the mass: r_old/sampler ~ 0.8 before correction.
Run: pytest tests/test_truncation.py
"""

import pytest
import torch
from trainer_fixtures import tiny_trainer

from grpo_ratio.corrections.kept_logprobs import kept_set_logprobs
from grpo_ratio.old_pass.scorer import completion_logprobs_from_logits
from grpo_ratio.testing import tiny_model


def _steps(trainer):
    return [row for row in trainer.state.log_history if "loss" in row]


@pytest.mark.parametrize("correction", ["renormalize", "lift_sampler"])
@pytest.mark.parametrize("truncation", [dict(top_p=0.8), dict(top_k=5)])
def test_correction_puts_old_and_sampler_on_one_support(tmp_path, correction, truncation):
    # fp32 end to end: the only gap between trainer and sampler is the kept mass.
    trainer = tiny_trainer(tmp_path, "bf16", bf16=False, max_steps=1, truncation_correction=correction, **truncation)
    trainer.train()
    (row,) = _steps(trainer)
    # before: r = p_full(g) / q_S(g) = M, the kept mass, on every token
    assert row["ratio/old_sampler/mean"] == pytest.approx(row["ratio/kept_mass_mean"], abs=1e-3)
    assert row["ratio/kept_mass_mean"] < 0.9 and row["ratio/old_sampler/oob_rate"] == 1.0
    # after: r = p_S(g) / q_S(g) = 1 up to KV-cache rounding
    assert row["ratio/old_sampler_corrected/mean"] == pytest.approx(1.0, abs=1e-4)
    assert row["ratio/old_sampler_corrected/oob_rate"] == 0.0
    assert row["ratio/new_old/oob_rate"] == 0.0  # on-policy new/old stays 1 with either correction


def test_renormalized_old_logprobs_equal_a_brute_force_over_the_kept_sets(tmp_path):
    # num_iterations=2 makes TRL run its old pass; under renormalize it must return log p_S of the sampled tokens.
    trainer = tiny_trainer(tmp_path, "bf16", bf16=False, top_p=0.8, num_iterations=2,
                           truncation_correction="renormalize")
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    out = trainer._generate_and_score_completions(batch)
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)  # (B, P+T)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    T = out["completion_ids"].size(1)
    with torch.no_grad():
        logits = tiny_model("qwen2")(input_ids=ids, attention_mask=mask, logits_to_keep=T + 1).logits  # same weights
    kept = trainer._generations["train"].kept.resize_steps(T)  # the generate recording's kept sets
    valid = out["completion_mask"].bool()
    expected = kept_set_logprobs(logits[:, :-1], out["completion_ids"], kept, mask=valid)  # (B, T)
    assert (out["old_per_token_logps"] - expected)[valid].abs().max() <= 1e-5
    full = completion_logprobs_from_logits(logits, out["completion_ids"], 1.0)
    assert (out["old_log_kept_mass"] - (full - expected))[valid].abs().max() <= 1e-5  # log M = log p - log p_S
    assert (out["old_per_token_logps"][valid] <= 0).all() and (out["old_per_token_logps"] > full)[valid].all()


def test_trls_old_pass_keeps_one_chunks_hidden_states_at_a_time(tmp_path, monkeypatch):
    # the kept-set path on TRL's own old pass kept every forward chunk's (rows, P+T, H) last hidden state until TRL's
    # call returned (the whole generation batch's: 7.4 GiB at 64 x 8.7k x 3,584 fp32); now each chunk is done as its
    # forward returns it, and the values are those of the whole batch at once
    import weakref

    from grpo_ratio.old_pass import kept_head

    trainer = tiny_trainer(tmp_path, "bf16", bf16=False, top_p=0.8, num_iterations=2, truncation_correction="renormalize",
                           per_device_train_batch_size=2, gradient_accumulation_steps=4)  # 8 rows, chunks of 2
    alive, held, chunk_bytes, project = {}, [], [], kept_head.kept_set_logps_from_hidden

    def spy(model, hidden, *args, **kwargs):
        storage = hidden.untyped_storage()  # the decoder output this chunk's slice views
        if torch.is_grad_enabled():  # the training forward: autograd keeps its hidden states for backward anyway
            return project(model, hidden, *args, **kwargs)
        held.append(sum(alive.values()))  # bytes of earlier chunks' hidden states still alive now
        chunk_bytes.append(storage.nbytes())
        key = id(storage)
        alive[key] = storage.nbytes()
        weakref.finalize(storage, alive.pop, key)
        return project(model, hidden, *args, **kwargs)

    monkeypatch.setattr(kept_head, "kept_set_logps_from_hidden", spy)
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    out = trainer._generate_and_score_completions(batch)
    assert len(chunk_bytes) == 4 and held == [0, 0, 0, 0]  # before: 0, 1, 2, 3 chunks' hidden states held
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)  # (B, P+T)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    T = out["completion_ids"].size(1)
    with torch.no_grad():
        logits = tiny_model("qwen2")(input_ids=ids, attention_mask=mask, logits_to_keep=T + 1).logits  # same weights
    valid = out["completion_mask"].bool()
    kept = trainer._generations["train"].kept.resize_steps(T)
    expected = kept_set_logprobs(logits[:, :-1], out["completion_ids"], kept, mask=valid)  # (B, T) all rows at once
    assert (out["old_per_token_logps"] - expected)[valid].abs().max() <= 1e-5


def test_lift_sampler_adds_the_log_kept_mass(tmp_path):
    trainer = tiny_trainer(tmp_path, "fp32_clone", bf16=False, top_k=5, truncation_correction="lift_sampler")
    recordings = []
    finish = trainer._finish_recording
    trainer._finish_recording = lambda *args: recordings.append(finish(*args)) or recordings[-1]
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    out = trainer._generate_and_score_completions(batch)
    valid = out["completion_mask"].bool()
    raw = torch.zeros_like(out["sampler_per_token_logps"])  # ours: kept out of TRL's loss by default
    record = recordings[0].logprobs  # (B, T_gen) the sampler's own log q_S(g), as the generate recording saw it
    raw[:, : record.size(1)] = record
    lifted = out["sampler_per_token_logps"]
    assert torch.allclose(lifted[valid], (raw + out["old_log_kept_mass"])[valid], atol=1e-6)
    # and the trainer's old log-probs stay full-vocabulary: old - lifted = log p_S - log q_S ~ 0
    assert (out["old_per_token_logps"] - lifted)[valid].abs().max() <= 1e-4


def test_training_with_renormalize_and_autocast(tmp_path):
    trainer = tiny_trainer(tmp_path, "fp16_clone", top_p=0.8, truncation_correction="renormalize", max_steps=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert len(_steps(trainer)) == 2
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert all(0.75 < row["ratio/kept_mass_mean"] < 0.85 for row in _steps(trainer))


def test_warning_when_truncation_feeds_the_ratio_uncorrected(tmp_path):
    with pytest.warns(UserWarning, match="truncation_correction='none'"):
        tiny_trainer(tmp_path, "bf16", top_p=0.8, off_policy_mask_threshold=0.5)


@pytest.mark.parametrize("kw,error,match", [
    (dict(record_sampler_logprobs=False), ValueError, "record_sampler_logprobs=True"),
])
def test_bad_truncation_setups(tmp_path, kw, error, match):
    with pytest.raises(error, match=match):
        tiny_trainer(tmp_path, "bf16", top_p=0.8, truncation_correction="renormalize", **kw)


def _vllm_config(**kw):
    """A RatioGRPOConfig with vLLM colocate and a truncation correction: the checks run in its __post_init__."""
    from grpo_ratio import RatioGRPOConfig

    base = dict(output_dir="unused", use_cpu=True, truncation_correction="renormalize", use_vllm=True,
                vllm_mode="colocate", vllm_tensor_parallel_size=1, top_p=0.8, top_k=1024, report_to="none",
                kept_set_source="recorded")  # the engine's sampling masks: what these checks are about
    return RatioGRPOConfig(**{**base, **kw})


@pytest.mark.parametrize("kw,match", [
    (dict(vllm_mode="server"), "/v1/completions"),
    (dict(vllm_tensor_parallel_size=2), "vllm_tensor_parallel_size=1"),
])
def test_vllm_setups_refused_at_start_up(kw, match):
    with pytest.raises(ValueError, match=match):
        _vllm_config(**kw)


@pytest.mark.parametrize("kw,where", [
    (dict(top_k=0), r"needs top_k > 0, got 0"),
    (dict(top_k=-1), r"needs top_k > 0, got -1"),  # vLLM's own "all tokens"
    (dict(top_k=1024, generation_kwargs={"top_k": 0}), r"needs generation_kwargs\['top_k'\] > 0, got 0"),
    (dict(top_k=1024, generation_kwargs={"top_k": -1}), r"needs generation_kwargs\['top_k'\] > 0, got -1"),
])
def test_vllm_masks_without_top_k_are_refused(kw, where):
    # vLLM refuses every request of an engine with return_sampling_mask and top_k <= 0, at the first generation
    # (training or evaluation: TRL sends both the same sampling fields): a config error, naming both fixes
    with pytest.raises(ValueError, match=where) as error:
        _vllm_config(**kw)
    message = str(error.value)
    assert "kept_set_source='recompute'" in message and "~300 MB per 8,192-token completion" in message
    assert "Set top_k (e.g." not in message  # was: "Set top_k (e.g. top_k=1024, ...)": 1,024 ids per token at top_p=1
    _vllm_config(top_k=0, generation_kwargs={"top_k": 64})  # generation_kwargs overrides the field: allowed
    _vllm_config(top_k=0, kept_set_source="recompute")  # recomputed sets need nothing of the engine


def test_vllm_output_capture_gives_kept_sets():
    # The engine's generate is wrapped on the instance; the RequestOutputs (vLLM's real field names) give the sets.
    from fixtures_vllm import CompletionOutput, RequestOutput, SamplingMask

    from grpo_ratio.sampler.vllm import VLLMOutputCapture

    outputs = [RequestOutput(request_id="0", prompt=None, prompt_token_ids=[5, 6], prompt_logprobs=None,
                             outputs=[CompletionOutput(index=0, text="", token_ids=[7, 1], cumulative_logprob=None,
                                                       logprobs=None, sampling_mask=SamplingMask([[7, 8], [1]]))],
                             finished=True)]

    class Engine:  # stands in for vllm.LLM: only `generate` is touched
        def generate(self, prompts, sampling_params=None, use_tqdm=False):
            return outputs

    engine = Engine()
    capture = VLLMOutputCapture(engine)
    assert engine.generate([{"prompt_token_ids": [5, 6]}]) is outputs
    kept = capture.kept_sets(num_rows=1)
    assert kept.sizes.tolist() == [[2, 1]] and kept.cell_ids(0, 0).tolist() == [7, 8]
    with pytest.raises(RuntimeError, match="no vLLM outputs captured"):
        capture.kept_sets(num_rows=1)  # consumed: a stale capture is never reused


def test_importance_sampling_weights_match_trl_modes():
    from grpo_ratio.diagnostics.ratios import importance_sampling_weights

    # log r = [[log 4, log 0.5]] on two valid tokens; sequence modes: product 2.0; clip_max 3.0
    log_ratio = torch.log(torch.tensor([[4.0, 0.5]]))
    mask = torch.ones(1, 2, dtype=torch.bool)
    tt = importance_sampling_weights(log_ratio, mask, "token_truncate", None, 3.0)
    assert torch.allclose(tt, torch.tensor([[3.0, 0.5]]))
    tm = importance_sampling_weights(log_ratio, mask, "token_mask", None, 3.0)
    assert torch.allclose(tm, torch.tensor([[0.0, 0.5]]))
    sm = importance_sampling_weights(log_ratio, mask, "sequence_mask", None, 3.0)
    assert torch.allclose(sm, torch.tensor([[2.0]]))


# ---------------------------------------------------------------------------------------------------------------------
# kept sets recomputed from the old policy's logits (kept_set_source="recompute")


def _probs(logits):
    return torch.softmax(torch.tensor(logits), -1).tolist()


@pytest.mark.parametrize("kept_filter,expected", [
    # logits [2, 1, 0, -1, -2]: softmax = 0.6364, 0.2341, 0.0861, 0.0317, 0.0117
    (dict(top_k=2), [0, 1]),
    (dict(top_p=0.8), [0, 1]),  # 0.636 < 0.8 <= 0.636 + 0.234: the smallest prefix with mass >= 0.8
    (dict(top_p=0.9), [0, 1, 2]),  # 0.870 < 0.9 -> one more
    (dict(min_p=0.1), [0, 1, 2]),  # keep p >= 0.1 * 0.636 = 0.064
    (dict(min_p=0.4), [0]),  # 0.234 < 0.4 * 0.636 = 0.255
    (dict(top_k=3, top_p=0.95), [0, 1, 2]),  # top_p alone would keep 4 (0.956); top_k cuts at 3
    (dict(top_p=0.9, min_p=0.2), [0, 1]),  # top_p keeps 3, then min_p drops 0.086 < 0.2 * 0.636
    (dict(temperature=2.0, top_p=0.8), [0, 1, 2]),  # T=2 flattens: 0.427, 0.259, 0.157 -> 0.843 >= 0.8
])
def test_recomputed_kept_sets_on_literal_logits(kept_filter, expected):
    from grpo_ratio.corrections.kept_logprobs import recompute_kept_sets
    from grpo_ratio.corrections.kept_sets import SamplingSettings

    assert _probs([2.0, 1.0, 0.0, -1.0, -2.0])[0] == pytest.approx(0.6364, abs=1e-4)
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0, -2.0]]])  # (1, 1, 5)
    kept, added = recompute_kept_sets(logits, torch.tensor([[0]]), SamplingSettings(**kept_filter))
    assert kept.cell_ids(0, 0).tolist() == expected and not added.any()


def test_recomputed_kept_sets_follow_the_engine_processor_order():
    # p = [0.4, 0.3, 0.2, 0.1], top_p=0.75, min_p=0.3 (drops p < 0.12: token 3), both bind.
    # generate: top_p first keeps {0, 1, 2} (0.7 < 0.75 <= 0.9), then min_p keeps them all.
    # vLLM: min_p first keeps {0, 1, 2} renormalised to [0.444, 0.333, 0.222]; top_p keeps {0, 1} (0.778 >= 0.75).
    from grpo_ratio.corrections.kept_logprobs import recompute_kept_sets
    from grpo_ratio.corrections.kept_sets import SamplingSettings

    logits = torch.log(torch.tensor([[[0.4, 0.3, 0.2, 0.1]]]))  # (1, 1, 4)
    kept = {engine: recompute_kept_sets(logits, torch.tensor([[0]]), SamplingSettings(
        top_p=0.75, min_p=0.3, engine=engine))[0].cell_ids(0, 0).tolist() for engine in ("generate", "vllm")}
    assert kept == {"generate": [0, 1, 2], "vllm": [0, 1]}
    # only one of the two binds: the orders agree
    for one in (dict(top_p=0.75), dict(min_p=0.3), dict(top_k=2, min_p=0.3)):
        masks = [SamplingSettings(**one, engine=e).keep_mask(logits[0]) for e in ("generate", "vllm")]
        assert torch.equal(*masks), one
    with pytest.raises(ValueError, match="no truncation order"):
        SamplingSettings(top_p=0.75, engine="sglang").keep_mask(logits[0])


def test_a_sampled_token_outside_the_recomputed_set_is_added_and_reported():
    from grpo_ratio.corrections.kept_logprobs import recompute_kept_sets
    from grpo_ratio.corrections.kept_sets import SamplingSettings

    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0, -2.0], [0.0, 0.0, 0.0, 0.0, 0.0]]])  # (1, 2, 5)
    kept, added = recompute_kept_sets(logits, torch.tensor([[4, 3]]), SamplingSettings(top_k=2))
    assert kept.cell_ids(0, 0).tolist() == [0, 1, 4]  # token 4 was sampled: it joins its set
    assert added.tolist() == [[True, False]]
    # equal logits at step 2: generate's top-k keeps every token tied with the k-th, so all 5 (token 3 included)
    assert kept.cell_ids(0, 1).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("correction", ["renormalize", "lift_sampler"])
def test_recomputed_sets_equal_the_recorded_ones_in_fp32(tmp_path, correction):
    # fp32 end to end: the trainer's logits are the sampler's, so recomputing the filter gives the recorded sets and
    # the same corrected ratio (1 up to rounding); no sampled token falls outside.
    rows = {}
    for source in ("recorded", "recompute"):
        trainer = tiny_trainer(tmp_path / source, "fp32_clone", bf16=False, max_steps=1, top_p=0.8,
                               truncation_correction=correction, kept_set_source=source)
        trainer.train()
        (rows[source],) = _steps(trainer)
    assert rows["recompute"]["ratio/kept_set_added_rate"] == 0.0
    assert "ratio/kept_set_added_rate" not in rows["recorded"]
    for key in ("ratio/kept_mass_mean", "ratio/old_sampler_corrected/mean", "ratio/old_sampler/mean"):
        assert rows["recompute"][key] == pytest.approx(rows["recorded"][key], abs=1e-5), key
    assert rows["recompute"]["ratio/old_sampler_corrected/oob_rate"] == 0.0


def test_recompute_on_policy_bf16_recomputes_in_the_training_forward(tmp_path):
    # bf16 mode, TRL skips its old pass: the training forward itself recomputes the sets from its logits
    trainer = tiny_trainer(tmp_path, "bf16", bf16=False, max_steps=1, top_k=5, truncation_correction="renormalize",
                           kept_set_source="recompute")
    trainer.train()
    (row,) = _steps(trainer)
    assert row["ratio/kept_set_added_rate"] == 0.0 and row["ratio/new_old/oob_rate"] == 0.0
    assert row["ratio/old_sampler_corrected/mean"] == pytest.approx(1.0, abs=1e-4)


def test_recompute_lifts_the_server_mode_refusal():
    from grpo_ratio import RatioGRPOConfig

    args = RatioGRPOConfig(output_dir="unused", use_cpu=True, use_vllm=True, vllm_mode="server", top_p=0.8,
                           truncation_correction="renormalize", report_to="none")  # auto -> recompute with vLLM
    assert args.resolved_kept_set_source == "recompute"
    with pytest.raises(ValueError, match="kept_set_source='recompute'"):
        RatioGRPOConfig(output_dir="unused", use_cpu=True, use_vllm=True, vllm_mode="server", top_p=0.8,
                        truncation_correction="renormalize", kept_set_source="recorded", report_to="none")


@pytest.mark.parametrize("correction,renormalized", [("renormalize", True), ("lift_sampler", False)])
def test_reference_logprobs_follow_the_correction(tmp_path, correction, renormalized):
    # docs/truncation.md: under renormalize TRL's reference pass (beta > 0) goes through the same hook, so the
    # reference log-probs are over the kept sets too; under lift_sampler they stay full-vocabulary. At step 1 the
    # reference weights are the policy's, so in fp32 the reference equals the old pass on the same support.
    from transformers import AutoModelForCausalLM

    tiny_model("qwen2").save_pretrained(tmp_path / "model")  # TRL re-loads the reference from this path
    trainer = tiny_trainer(tmp_path, "fp32_clone", model=AutoModelForCausalLM.from_pretrained(tmp_path / "model"),
                           bf16=False, top_k=5, beta=0.04, truncation_correction=correction, max_steps=1)
    seen = []
    generate_and_score = trainer._generate_and_score_completions

    def keep(inputs):
        output = generate_and_score(inputs)
        seen.append(output)
        return output

    trainer._generate_and_score_completions = keep
    trainer.train()
    (output,) = seen
    valid = output["completion_mask"].bool()  # (B, T)
    log_mass = output["old_log_kept_mass"]  # (B, T) log M_old of the kept sets
    old = output["old_per_token_logps"]  # (B, T) over S under renormalize, full-vocabulary under lift_sampler
    full = old + log_mass if renormalized else old
    expected = full - log_mass if renormalized else full
    assert (output["ref_per_token_logps"] - expected)[valid].abs().max() < 1e-5
    assert (log_mass[valid] < -0.1).any()  # top_k=5 of 300 tokens: over S and full-vocabulary differ
