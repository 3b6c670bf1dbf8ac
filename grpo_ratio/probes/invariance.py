"""`grpo-ratio probe invariance`: bitwise invariance of the old log-probs, per scoring mode (after DetLLM's
zero-tolerance test harness, "Eliminating Nondeterminism in LLM Inference with Integer-Only Arithmetic": rerun, alone
vs random co-prompts, prefill vs token-by-token; logits chain-hashed).

Completions are sampled once (`common.sample_completions`), then, for each `old_logprob_mode` of
`grpo_ratio.old_pass.scorer.OldLogprobScorer` on an fp32-weights model (TRL's regime: `bf16` = bf16 autocast), the fp32
log-probs of the completion tokens are compared BIT FOR BIT (not within a tolerance) in three checks:

- rerun: each sequence scored alone (batch 1, no padding) twice;
- co-batch k: each sequence alone vs inside a random co-batch of k sequences (its neighbours are other prompts of the
  set, drawn with `torch.Generator().manual_seed(seed)`, the same groups for every mode), laid out as TRL lays out a
  batch (prompts left-padded, completions right-padded to the group's longest);
- decode: the teacher-forced full pass (prefill of prompt + completion, batch 1) vs token-by-token decoding with the
  KV cache: the prompt prefilled, then each completion token fed alone with `past_key_values`, in the same precision
  context as the mode (its autocast, its fp16 copy, its fp32 layers); a mode that cannot decode is reported as such.

The equal rate is the share of valid completion tokens whose fp32 log-prob bit patterns are identical. The chain hash
of a mode is sha256 chained over the sequences in order, each link over the little-endian fp32 bytes of that
sequence's valid batch-1 log-probs, so two machines that scored the same tokens (`tokens_sha256`) can compare.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import time

import torch
from tqdm.auto import tqdm

from ..modes import GUIDED_FP32, PRECISION_MODES
from ..old_pass import scorer as scoring
from ..old_pass.scorer import OldLogprobScorer
from . import common
from .common import Completions, compare, layout_trl, recommendation_block, score_alone


MODES = PRECISION_MODES


# ---------------------------------------------------------------------------------------------------------------------
# pure pieces


def bitwise_equal(logp_a: torch.Tensor, logp_b: torch.Tensor, valid: torch.Tensor) -> dict:
    """Bitwise agreement of two fp32 log-prob tensors over the valid tokens, plus `compare`'s out-of-band summary.

    Args:
        logp_a, logp_b: (B, T) fp32 log-probs of the same tokens under two computations.
        valid: (B, T) bool.
    Returns:
        {"num_equal", "equal_rate" (num_equal / num_tokens; nan when no token), **compare(logp_a, logp_b, valid)}.
        -0.0 and +0.0 differ bitwise and count as unequal; two NaNs with the same bits count as equal.
    Raises:
        ValueError: a tensor is not fp32 (the bit patterns of another dtype are not the ones hashed).
    """
    if logp_a.dtype != torch.float32 or logp_b.dtype != torch.float32:
        raise ValueError(f"bitwise_equal needs fp32 log-probs, got {logp_a.dtype} and {logp_b.dtype}")
    same = (logp_a.view(torch.int32) == logp_b.view(torch.int32)) & valid  # (B, T)
    res = compare(logp_a, logp_b, valid)
    n_equal = int(same.sum())
    return {"num_equal": n_equal, "equal_rate": n_equal / res["num_tokens"] if res["num_tokens"] else float("nan"),
            **res}


def chain_hash(logps: torch.Tensor, valid: torch.Tensor) -> str:
    """sha256 chain over the sequences: h_0 = 32 zero bytes, h_i = sha256(h_{i-1} || bytes_i), where bytes_i are the
    little-endian fp32 bytes of row i's valid log-probs in token order; returns h_B in hex (64 characters).

    Args:
        logps: (B, T) fp32 log-probs.
        valid: (B, T) bool; invalid positions are not hashed, so padding values cannot change the hash.
    Raises:
        ValueError: `logps` is not fp32.
    """
    if logps.dtype != torch.float32:
        raise ValueError(f"chain_hash needs fp32 log-probs, got {logps.dtype}")
    h = bytes(32)
    for row, keep in zip(logps.cpu(), valid.cpu(), strict=True):
        h = hashlib.sha256(h + row[keep].numpy().astype("<f4").tobytes()).digest()
    return h.hex()


def tokens_hash(data: Completions) -> str:
    """sha256 of the valid completion ids (int64 little-endian, rows chained as `chain_hash`): equal on two machines
    iff they scored the same tokens, the precondition for comparing their log-prob chain hashes."""
    ids = data.input_ids[:, -data.logits_to_keep:]  # (B, T)
    h = bytes(32)
    for row, keep in zip(ids, data.valid, strict=True):
        h = hashlib.sha256(h + row[keep].numpy().astype("<i8").tobytes()).digest()
    return h.hex()


def co_batch_groups(num_rows: int, size: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """Random co-batches covering every row once: a seeded permutation cut into groups of `size`; a short last group
    is filled with neighbours drawn from the other rows (scored but not measured there).

    Returns:
        [(rows of the batch, in batch order; the rows measured in it)], each batch exactly `size` rows.
    Raises:
        ValueError: size outside [1, num_rows].
    """
    if not 1 <= size <= num_rows:
        raise ValueError(f"co-batch size {size} must be between 1 and the number of sequences ({num_rows})")
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_rows, generator=gen).tolist()
    groups = []
    for start in range(0, num_rows, size):
        measured = perm[start:start + size]
        others = [i for i in perm if i not in measured]
        fill = [others[j] for j in torch.randperm(len(others), generator=gen)[:size - len(measured)].tolist()]
        rows = measured + fill
        order = torch.randperm(size, generator=gen).tolist()  # the measured rows do not always come first
        groups.append(([rows[j] for j in order], measured))
    return groups


# ---------------------------------------------------------------------------------------------------------------------
# scoring in the three layouts


def _parts(data: Completions, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row i's unpadded prompt ids (p_i,) and completion ids (t_i,)."""
    ids, _, t_i = data.alone(i)
    return ids[0, :-t_i], ids[0, -t_i:]


def score_co_batches(scorer: OldLogprobScorer, data: Completions, groups, pad_id: int, eos: list[int]) -> torch.Tensor:
    """(B, T) fp32 log-probs of each row scored inside its co-batch (one forward per group), in `data`'s layout
    (0 past each row's completion)."""
    out = torch.zeros(data.valid.shape)  # (B, T)
    for rows, measured in groups:
        parts = [_parts(data, i) for i in rows]
        batch = layout_trl([p for p, _ in parts], [c for _, c in parts], pad_id, eos)
        logps = scorer.score(batch.input_ids, batch.attention_mask, batch.logits_to_keep).logps  # (k, T_group)
        for pos, i in enumerate(rows):
            if i in measured:
                t_i = len(parts[pos][1])
                out[i, :t_i] = logps[pos, :t_i]
    return out


def _cache_kwarg(model) -> str:
    """The forward's KV-cache argument: `cache` (transformers >= 5.x) or the older `past_key_values`."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def _decode_forward(model, input_ids, attention_mask, logits_to_keep: int, generation_positions: bool = True
                    ) -> torch.Tensor:
    """Drop-in for `scoring.plain_forward` on one unpadded row: the first S - logits_to_keep tokens prefilled with
    the KV cache, then each of the last `logits_to_keep` tokens fed alone with the cache.

    input_ids (1, S) -> logits (1, logits_to_keep + 1, V) at the positions the teacher-forced pass returns (the
    `plain_forward` contract: one more than the completion, the last is dropped by the caller). One unpadded row:
    positions are 0..S-1 whether or not they are counted from the mask (`generation_positions` is moot here).
    """
    if input_ids.size(0) != 1 or not bool(attention_mask.all()):
        raise ValueError("token-by-token decode scores one unpadded sequence at a time")
    key = _cache_kwarg(model)
    prefix = input_ids[:, :input_ids.size(1) - logits_to_keep]  # (1, p): its last logit predicts completion token 0
    out = type(model).forward(model, input_ids=prefix, use_cache=True, logits_to_keep=1)
    logits = [out.logits]  # [(1, 1, V)]
    for j in range(prefix.size(1), input_ids.size(1)):
        cache = out.cache if hasattr(out, "cache") else out.past_key_values  # a Cache may be falsy (len 0)
        out = type(model).forward(model, input_ids=input_ids[:, j:j + 1], use_cache=True, **{key: cache})
        logits.append(out.logits[:, -1:])  # (1, 1, V)
    return torch.cat(logits, dim=1)  # (1, logits_to_keep + 1, V)


@contextlib.contextmanager
def decoding():
    """Within this context `OldLogprobScorer.score` decodes token by token with the KV cache instead of one
    teacher-forced pass.

    Every mode reaches the model through `scoring.plain_forward`, inside the mode's own precision context (its
    autocast, its fp16 copy, its patched fp32 layers/norm/head); swapping that one function keeps the context exactly
    and changes only prefill-at-once into prefill-then-decode. Restored on exit.
    """
    original = scoring.plain_forward
    scoring.plain_forward = _decode_forward
    try:
        yield
    finally:
        scoring.plain_forward = original


def score_decode(scorer: OldLogprobScorer, data: Completions) -> torch.Tensor:
    """(B, T) fp32 log-probs from prefill + token-by-token decode, each sequence alone (as `score_alone`)."""
    with decoding():
        return score_alone(lambda ids, mask, t: scorer.score(ids, mask, t, batch_size=1).logps, data)


# ---------------------------------------------------------------------------------------------------------------------
# the probe


def run_mode(model, data: Completions, mode: str, layers: list[int] | None, groups: dict, pad_id: int,
             eos: list[int]) -> dict:
    """The three checks for one mode. Returns {"rerun", "co_batch_{k}" for each k, "decode": bitwise_equal(...) each
    (decode: or {"supported": False, "reason"}), "chain_hash", "seconds"}."""
    t0 = time.perf_counter()
    scorer = OldLogprobScorer(model, mode, layers=layers if mode == GUIDED_FP32.name else None)
    alone = score_alone(lambda ids, mask, t: scorer.score(ids, mask, t, batch_size=1).logps, data)  # (B, T)
    res = {"rerun": bitwise_equal(score_alone(lambda ids, mask, t: scorer.score(ids, mask, t, batch_size=1).logps, data),
                                  alone, data.valid)}
    for k, g in groups.items():
        res[f"co_batch_{k}"] = bitwise_equal(score_co_batches(scorer, data, g, pad_id, eos), alone, data.valid)
    try:
        res["decode"] = {"supported": True, **bitwise_equal(score_decode(scorer, data), alone, data.valid)}
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as err:  # a model whose forward has no cache
        res["decode"] = {"supported": False, "reason": f"{type(err).__name__}: {err}"}
    res["chain_hash"] = chain_hash(alone, data.valid)
    res["seconds"] = time.perf_counter() - t0
    return res


def run_invariance(model, data: Completions, pad_id: int, eos: list[int], layers: list[int] | None = None,
                   co_batch_sizes=(2, 8), seed: int = 1234, modes=MODES, progress: bool = True) -> dict:
    """Every check for every mode on `model` (fp32 weights, not modified).

    Args:
        data: the sampled completions (B sequences).
        pad_id, eos: the tokenizer's pad id and the EOS id(s), to lay out co-batches as TRL does.
        layers: guided_fp32's decoder layers; None skips `guided_fp32` (recorded as skipped).
        co_batch_sizes: sizes k of the random co-batches, each in [2, B].
        seed: seeds the co-batch groups (the same groups for every mode).
    Returns:
        {"modes": {mode: run_mode(...)} (guided_fp32 without layers: {"skipped": reason}),
         "co_batches": {k: [[rows in batch order], ...]}, "tokens_sha256": tokens_hash(data)}.
    Raises:
        ValueError: an unknown mode, or a co-batch size outside [2, B].
    """
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"modes {bad} unknown; allowed: {', '.join(MODES)}")
    B = data.input_ids.size(0)
    bad = [k for k in co_batch_sizes if not 2 <= k <= B]
    if bad:
        raise ValueError(f"co-batch sizes {bad} must be between 2 and the number of sequences ({B})")
    groups = {k: co_batch_groups(B, k, seed + k) for k in co_batch_sizes}
    results = {}
    for mode in tqdm(modes, desc="invariance: modes", disable=not progress):
        if mode == GUIDED_FP32.name and not layers:
            results[mode] = {"skipped": "no --layers given"}
            continue
        results[mode] = run_mode(model, data, mode, layers, groups, pad_id, eos)
    return {"modes": results, "co_batches": {str(k): [rows for rows, _ in g] for k, g in groups.items()},
            "tokens_sha256": tokens_hash(data)}


def _rate(res: dict) -> str:
    if not res.get("supported", True):
        return "cannot decode"
    return f"{100 * res['equal_rate']:.2f}% ({res['max_abs_dlogp']:.2g})"


def markdown(payload: dict) -> str:
    """One row per mode: the bitwise-equal rate (and max abs dlogp) of each check, and the batch-1 chain hash."""
    info, r = payload["info"], payload["result"]
    sizes = list(r["co_batches"])
    head = ["mode", "tokens", "rerun"] + [f"alone vs co-batch {k}" for k in sizes] + \
        ["prefill vs decode", "batch-1 chain hash", "seconds"]
    lines = [(f"### invariance: {info['model']} ({info['num_sequences']} sequences, {info['num_tokens']} completion "
              f"tokens, <= {info['max_new_tokens']} new tokens, seed {info['seed']}, fp32 weights)"), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode, res in r["modes"].items():
        if "skipped" in res:
            lines.append("| " + " | ".join([mode, "-", f"skipped: {res['skipped']}"] + ["-"] * (len(head) - 3)) + " |")
            continue
        cells = [mode, str(res["rerun"]["num_tokens"]), _rate(res["rerun"])]
        cells += [_rate(res[f"co_batch_{k}"]) for k in sizes] + [_rate(res["decode"])]
        cells += [f"`{res['chain_hash'][:12]}`", f"{res['seconds']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    layers = payload.get("guided_fp32_layers")
    lines += ["", ("Bitwise-equal rate: share of valid completion tokens whose fp32 log-prob has the same bits in both "
                   "computations (in brackets: max abs dlogp). Rerun: each sequence alone, twice; co-batch k: alone "
                   "vs inside a random batch of k sequences (TRL's padding); decode: teacher-forced prefill vs "
                   "prompt prefill + token-by-token decode with the KV cache, same precision context. "
                   f"guided_fp32 layers: {layers}. Chain hash: first 12 hex digits of the sha256 chain over the "
                   f"batch-1 log-probs (full value in the JSON); tokens sha256 `{r['tokens_sha256'][:12]}`."), ""]
    return "\n".join(lines + recommendation(payload))


def recommendation(payload: dict) -> list[str]:
    """The conclusion: which checks each mode passes bit for bit, and the mode whose moves stay smallest."""
    r = payload["result"]
    modes = {m: x for m, x in r["modes"].items() if "skipped" not in x}
    if not modes:
        return recommendation_block(["No mode was measured."], [])
    checks = [k for k in next(iter(modes.values())) if k.startswith("co_batch_")] + ["decode"]
    rerun = [m for m, x in modes.items() if x["rerun"]["equal_rate"] == 1.0]
    invariant = [m for m, x in modes.items()
                 if all(x[k].get("supported", True) and x[k]["equal_rate"] == 1.0 for k in checks)]
    worst = {m: max(x[k]["max_abs_dlogp"] for k in checks if x[k].get("supported", True)) for m, x in modes.items()}
    smallest = min(worst, key=worst.get)
    sentences = [("Every mode reruns bit for bit." if len(rerun) == len(modes) else
                  f"Rerun bit for bit: {', '.join(rerun) or 'no mode'}."),
                 (f"Bitwise invariant to co-batching and decoding: {', '.join(invariant)}." if invariant else
                  "No mode is bitwise invariant to co-batching or token-by-token decoding on this model."),
                 f"The smallest moves are `{smallest}`'s (max abs dlogp {worst[smallest]:.2g} over those checks): "
                 "for reproducible old log-probs score each sequence alone with one mode (the rerun), and for the "
                 f"least batch-shape dependence use `{smallest}`."]
    caveats = ["Bits depend on the kernels: these probes run on the CPU; compare chain hashes between machines only "
               "when their tokens sha256 match."]
    return recommendation_block(sentences, caveats)


# ---------------------------------------------------------------------------------------------------------------------
# command line: `grpo-ratio probe invariance`

HELP = ("bitwise checks of each scoring mode's log-probs: rerun, alone vs random co-batches, prefill vs "
        "token-by-token decode; chain hash")


def add_arguments(p) -> None:
    common.add_common_arguments(p, max_new_tokens=32)
    p.add_argument("--layers", default=None,
                   help="guided_fp32 layers: comma-separated indices or a calibration JSON (probe layers/calibrate); "
                        "without it guided_fp32 is skipped")
    p.add_argument("--co-batch-sizes", default="2,8",
                   help="sizes of the random co-batches, comma-separated, each in [2, --num-prompts] (--batch-size "
                        "is not used by this probe)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of the scoring modes")


def run(args) -> list:
    """Sample once, run the bitwise checks for each scoring mode, write invariance.json/.md."""
    sizes = common.int_list(args.co_batch_sizes, "--co-batch-sizes")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise common.ProbeError(f"--modes {args.modes!r}: expected a comma-separated subset of {', '.join(MODES)}")
    prompts, idx = common.load_prompts(args)
    for k in sizes:
        if k < 2:
            raise common.ProbeError(f"--co-batch-sizes: {k} is not a co-batch; each size must be >= 2")
        common.check_batch_size(k, len(prompts), "--co-batch-sizes")
    model, tok = common.load_model(args.model)
    layers = common.guided_layers(args.layers, model)
    data = common.sample_completions(model, tok, prompts, args.max_new_tokens, args.seed, gsm8k=common.is_gsm8k(args))
    result = run_invariance(model, data, tok.pad_token_id, common.eos_ids(model, tok), layers, sizes, args.seed,
                            tuple(modes), progress=not args.no_progress)
    payload = {"probe": "invariance", "info": common.run_info(args, model, idx, data), "guided_fp32_layers": layers,
               "layers_source": args.layers, "result": result}
    return common.write_results(args.out, "invariance", payload, markdown(payload))
