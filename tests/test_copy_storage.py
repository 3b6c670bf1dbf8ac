"""`copy_storage="per_layer"`: the weights of `fp16_clone` (and of `fp32_clone` on bf16-stored weights) cast module by
module during the old pass instead of held in a resident copy. Bitwise equal to the resident copy, nothing kept.

Run: pytest tests/test_copy_storage.py
"""

import pytest
import torch

from grpo_ratio.old_pass.copies import PerLayerCast
from grpo_ratio.old_pass.scorer import OldLogprobScorer
from grpo_ratio.testing import ARCHITECTURES, tiny_model


T = 5  # completion tokens scored per row


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 300, (4, 12), generator=g)  # (B, P+T)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # one left-padded prompt, as TRL builds them
    return ids, mask


def _score(model, mode, storage, version=0):
    scorer = OldLogprobScorer(model, mode, copy_storage=storage)
    ids, mask = _batch()
    return scorer, scorer.score(ids, mask, T, batch_size=2, version=version).logps


CASES = [("fp16_clone", torch.float32), ("fp16_clone", torch.bfloat16), ("fp32_clone", torch.bfloat16)]


@pytest.mark.parametrize("mode,weights", CASES)
@pytest.mark.parametrize("arch,tie", [(arch, False) for arch in ARCHITECTURES] + [("llama", True)])  # tied: 1 copy
def test_per_layer_equals_the_resident_copy_bitwise(arch, tie, mode, weights):
    model = tiny_model(arch, tie_word_embeddings=tie, dtype=weights)
    resident, expected = _score(model, mode, "resident")
    per_layer, logps = _score(model, mode, "per_layer")
    assert torch.equal(logps, expected)
    assert resident.extra_bytes() > 0  # the resident copy really ran (and is held) ...
    assert per_layer.copies() == [] and per_layer.extra_bytes() == 0  # ... the per-layer casts hold nothing


def test_peak_is_the_largest_module_and_the_policy_is_untouched():
    model = tiny_model("llama", tie_word_embeddings=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {k: id(p) for k, p in model.named_parameters()}
    scorer, _ = _score(model, "fp16_clone", "per_layer")
    cast = scorer.per_layer_cast(torch.float16)
    # the embedding and the untied head are the largest modules: 300 x 64 fp16 values, one at a time
    assert cast.peak_bytes == 300 * 64 * 2
    assert cast.num_casts == 2 * len(cast.owners)  # every owning module once per chunk, 2 chunks
    assert {k: id(p) for k, p in model.named_parameters()} == params  # the policy's own Parameters are back
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, before[k]), k
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())  # hooks removed


def test_per_layer_follows_the_weights_without_a_refresh():
    model = tiny_model("qwen2")
    resident = OldLogprobScorer(model, "fp16_clone")
    per_layer = OldLogprobScorer(model, "fp16_clone", copy_storage="per_layer")
    ids, mask = _batch()
    first = per_layer.score(ids, mask, T, version=0).logps
    assert torch.equal(first, resident.score(ids, mask, T, version=0).logps)
    with torch.no_grad():  # an optimizer step: the policy's weights move in place
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    moved = per_layer.score(ids, mask, T, version=0).logps  # the same version: no refresh could have happened
    assert not torch.equal(moved, first)
    assert torch.equal(moved, resident.score(ids, mask, T, version=1).logps)  # the resident copy needs its refresh
    assert resident.copies()[0].num_refreshes == 2


def test_non_persistent_buffers_come_from_a_fresh_module():
    # bf16-stored weights: `.to(bfloat16)` rounded the policy's rotary inv_freq; a copy built from the config
    # recomputes it. Casting the policy's rounded buffer instead gives other log-probs.
    model = tiny_model("llama", dtype=torch.bfloat16)
    _, expected = _score(model, "fp16_clone", "resident")
    rounded = PerLayerCast(model, torch.float16)
    rounded._fresh = {key: {} for key in rounded._fresh}
    ids, mask = _batch()
    with rounded.active(), torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=T + 1, use_cache=False).logits
    from grpo_ratio.old_pass.scorer import completion_logprobs_from_logits

    assert not torch.equal(completion_logprobs_from_logits(logits, ids[:, -T:], 1.0), expected)


def test_refusals():
    with pytest.raises(ValueError, match="copy_storage='layer' is not allowed; allowed: resident, per_layer"):
        OldLogprobScorer(tiny_model("qwen2"), "fp16_clone", copy_storage="layer")


PEFT_CASES = {  # LoRA on every linear layer, DoRA (its magnitude merged by PEFT), a trained head (modules_to_save)
    "lora": dict(r=4, target_modules="all-linear"),
    "dora": dict(r=4, target_modules=["q_proj", "v_proj"], use_dora=True),
    "saved_head": dict(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]),
}


@pytest.mark.parametrize("mode,weights", CASES)
@pytest.mark.parametrize("adapters", list(PEFT_CASES))
def test_with_peft_each_layer_is_merged_when_it_runs_as_the_resident_copy_merges_it(adapters, mode, weights):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model("qwen2", dtype=weights),
                                peft.LoraConfig(init_lora_weights=False, **PEFT_CASES[adapters]))  # adapters != 0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    resident, expected = _score(model, mode, "resident")
    per_layer, logps = _score(model, mode, "per_layer")
    if adapters == "saved_head":  # the adapted head is applied by its forward, tile by tile: fp32 rounding apart
        torch.testing.assert_close(logps, expected, rtol=0, atol=2e-6)
    else:
        assert torch.equal(logps, expected)
    with model.disable_adapter():
        assert not torch.equal(expected, _score(model, mode, "per_layer")[1])  # the adapters count
    cast = per_layer.per_layer_cast(_DTYPE[mode])
    size = _DTYPE[mode].itemsize
    assert per_layer.extra_bytes() == 0 and cast.peak_bytes == 300 * 64 * size  # the embedding / head, one at a time
    assert resident.extra_bytes() >= sum(p.numel() for p in model.get_base_model().parameters()) * size // 2
    for k, v in model.state_dict().items():  # the policy untouched, its adapters unmerged, no patch left behind
        assert v.dtype == before[k].dtype and torch.equal(v, before[k]), k
    assert all("forward" not in m.__dict__ for m in model.modules())


_DTYPE = {"fp16_clone": torch.float16, "fp32_clone": torch.float32}


def test_a_per_layer_run_equals_a_resident_run(tmp_path):
    # the trainer: 2 optimizer steps of fp16_clone each way; the same old log-probs, so the same loss, metrics and
    # weights bit for bit, and only the resident run holds (and refreshes) a copy
    from trainer_fixtures import tiny_trainer

    runs = {}
    for storage in ("resident", "per_layer"):
        runs[storage] = tiny_trainer(tmp_path / storage, "fp16_clone", copy_storage=storage)
        runs[storage].train()
    resident, per_layer = runs["resident"], runs["per_layer"]
    drop = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "step_time")
    history = lambda t: [{k: v for k, v in row.items() if k not in drop} for row in t.state.log_history]
    assert history(resident) == history(per_layer)
    assert resident.state.log_history[0]["ratio/new_old/mean_abs_log_ratio"] > 0  # fp16 old vs bf16 new: measured
    for (name, p), q in zip(resident.model.named_parameters(), per_layer.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    ((copy,),) = [resident.scorer.copies()]
    assert copy.num_refreshes == 2 and per_layer.scorer.copies() == []
    assert per_layer.scorer.per_layer_cast(torch.float16).num_casts > 0


def test_the_trainer_runs_per_layer_with_peft(tmp_path):
    peft = pytest.importorskip("peft")
    from trainer_fixtures import tiny_trainer

    trainer = tiny_trainer(tmp_path, "fp16_clone", copy_storage="per_layer",
                           peft_config=peft.LoraConfig(r=2, target_modules=["q_proj"]))
    trainer.train()
    assert trainer.state.log_history[0]["ratio/new_old/mean_abs_log_ratio"] > 0  # fp16 old vs bf16 new: measured
    assert trainer.scorer.copies() == [] and trainer.scorer.per_layer_cast(torch.float16).num_casts > 0


def _overflowing(model, token=5):
    """`model` with token `token`'s input embedding x1e8 (fp16 overflows; RMSNorm keeps fp32 finite) and a (4, 12)
    batch holding `token` in rows 0 and 2 only."""
    with torch.no_grad():
        model.get_input_embeddings().weight[token].mul_(1e8)
    ids = torch.randint(token + 1, 300, (4, 12), generator=torch.Generator().manual_seed(0))
    ids[0, 9], ids[2, 10] = token, token
    return model, ids, torch.ones_like(ids)


def _copies_built(monkeypatch) -> list:
    """The dtype of every `ModuleCopy` built from now on, in order."""
    from grpo_ratio.old_pass import copies

    built, init = [], copies.ModuleCopy.__init__

    def spy(self, source, dtype, whole_model=False):
        built.append((dtype, whole_model))
        init(self, source, dtype, whole_model)

    monkeypatch.setattr(copies.ModuleCopy, "__init__", spy)
    return built


def test_the_fp16_fallback_keeps_the_fp16_copy_and_builds_no_fp32_one(monkeypatch):
    # bf16-stored weights, fp16_clone, rows 0 and 2 overflow, one row per chunk: the fallback's fp32 re-run once
    # replaced the resident fp16 copy by a new fp32 whole-model copy and the next chunk rebuilt the fp16 one (fp16,
    # fp32, fp16, fp32, fp16: 5 whole copies for 4 chunks); now the fp16 copy is built once and the fallback rows run
    # on a per-layer fp32 cast (the resident fp32 copy's numbers bitwise)
    model, ids, mask = _overflowing(tiny_model("qwen2", dtype=torch.bfloat16))
    built = _copies_built(monkeypatch)
    scorer = OldLogprobScorer(model, "fp16_clone")
    result = scorer.score(ids, mask, T, batch_size=1)
    assert result.fallback_rows == 2 and torch.isfinite(result.logps).all()
    assert built == [(torch.float16, True)]
    assert scorer.extra_bytes() == sum(p.numel() for p in model.parameters()) * 2  # the fp16 copy only
    fp32 = OldLogprobScorer(model, "fp32_clone").score(ids, mask, T, batch_size=1).logps  # a resident fp32 copy
    assert torch.equal(result.logps[[0, 2]], fp32[[0, 2]])
    del built[:]
    scorer.score(ids, mask, T, batch_size=1, version=1)  # after a step: the same copy, refreshed
    assert built == [] and scorer.copies()[0].num_refreshes == 2


def test_the_fp16_fallback_with_peft_builds_no_fp32_copy_either(monkeypatch):
    # PEFT adapters: the per-layer fp32 cast merges each adapted layer as it runs (PEFT's own merge), so the fallback
    # keeps no resident fp32 copy beside the fp16 one (it once built one, and before that swapped the two chunk after
    # chunk); its rows equal a resident fp32_clone copy's (merged whole) bitwise
    import peft

    model = peft.get_peft_model(tiny_model("qwen2", dtype=torch.bfloat16),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model, ids, mask = _overflowing(model)
    built = _copies_built(monkeypatch)
    scorer = OldLogprobScorer(model, "fp16_clone")
    result = scorer.score(ids, mask, T, batch_size=1)
    assert result.fallback_rows == 2 and torch.isfinite(result.logps).all()
    assert built == [(torch.float16, True)]
    assert [c.num_refreshes for c in scorer.copies()] == [1]
    fp32 = OldLogprobScorer(model, "fp32_clone").score(ids, mask, T, batch_size=1).logps
    assert torch.equal(result.logps[[0, 2]], fp32[[0, 2]])
