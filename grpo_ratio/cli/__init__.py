"""`grpo-ratio`: the project's console command, a thin dispatcher.

    grpo-ratio train   --config recipes/smollm2-135m/arithmetic/fp32_clone.yaml [--max_steps 10 ...]
    grpo-ratio compare --recipes recipes/smollm2-135m/arithmetic/{bf16,fp32_clone}.yaml --seeds 0 1 --name arms
    grpo-ratio report  runs/compare/arms          # what the logged ratios say, and what to change (docs/reading.md)
    grpo-ratio report  RUN --check "first:ratio/new_old/mean_abs_log_ratio<1e-8"   # a gate: exit 1 when one fails
    grpo-ratio probe batch  --model HuggingFaceTB/SmolLM2-135M-Instruct --prompts test.jsonl --num-prompts 8 --out DIR
    grpo-ratio probe ladder --layers recipes/smollm2-135m/calibration.json ...
    grpo-ratio probe layers ...      # writes DIR/calibration.json for RatioGRPOConfig(guided_fp32_layers=...)
    grpo-ratio probe calibrate --target 0.01 ...
    grpo-ratio probe controls | greedy | invariance ...
    grpo-ratio probe routes --model tiny:qwen3_moe   # MoE route flips: decode vs prefill, fp32 vs bf16
    grpo-ratio probe determinism --model tiny:llama  # int32-logit vs fp32/bf16 hashes (docs/integer.md)

`train` and `compare` are `grpo_ratio/cli/train.py` and `compare.py`; each probe is one module `grpo_ratio/probes/<name>.py` with its own
`add_arguments` and `run`, writing `DIR/<probe>.json` and `DIR/<probe>.md` (and a PNG where a plot helps).
docs/probes.md explains the probes.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


PROBES = ("batch", "ladder", "layers", "calibrate", "controls", "greedy", "invariance", "routes", "determinism")


def _probe_modules() -> dict:
    from ..probes import batch, calibrate, controls, determinism, greedy, invariance, ladder, layers, routes

    modules = {"batch": batch, "ladder": ladder, "layers": layers, "calibrate": calibrate, "controls": controls,
               "greedy": greedy, "invariance": invariance, "routes": routes, "determinism": determinism}
    return {name: modules[name] for name in PROBES}


def build_parser() -> argparse.ArgumentParser:
    """`grpo-ratio {train,compare,probe}`; `probe` has one subcommand per probe module."""
    parser = argparse.ArgumentParser(prog="grpo-ratio", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    top = parser.add_subparsers(dest="command", required=True)
    top.add_parser("train", help="train one arm from a recipe (flags: grpo-ratio train --help)", add_help=False)
    top.add_parser("compare", help="compare arms over seeds (flags: grpo-ratio compare --help)", add_help=False)
    top.add_parser("report", help="read a run's or a comparison's ratio metrics (grpo-ratio report --help)",
                   add_help=False)
    probe = top.add_parser("probe", help="measure the bf16 batch-shape precision gap of a causal LM")
    sub = probe.add_subparsers(dest="probe", required=True)
    for name, module in _probe_modules().items():
        module.add_arguments(sub.add_parser(name, help=module.HELP))
    return parser


def _run_probe(args) -> int:
    import torch  # here, not at the top: `grpo-ratio report` (a CI gate) starts without loading torch

    from ..probes.common import ProbeError

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        with torch.no_grad():  # scoped: main() also runs in-process (tests, notebooks); never flip global state
            paths = _probe_modules()[args.probe].run(args)
    except ProbeError as err:
        print(f"grpo-ratio probe {args.probe}: error: {err}", file=sys.stderr)
        return 2
    for path in paths:
        if str(path).endswith(".md"):
            print(Path(path).read_text())  # the table, so a terminal run shows the result
    for path in paths:
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `grpo-ratio` console script; returns the exit status (2 on bad input)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # train and compare parse their own flags (TrlParser: every TRL field is a flag), so hand them the rest
    if argv[:1] in (["train"], ["compare"]):  # recipe keys and flags checked before the heavy imports (10-40 s)
        from .precheck import run_or_exit

        run_or_exit(argv[0], argv[1:])
    if argv[:1] == ["train"]:
        from .train import cli_main

        cli_main(argv[1:])
        return 0
    if argv[:1] == ["compare"]:
        from .compare import main as compare_main

        compare_main(argv[1:])
        return 0
    if argv[:1] == ["report"]:
        from ..analysis.report import main as report_main

        return report_main(argv[1:])
    return _run_probe(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
