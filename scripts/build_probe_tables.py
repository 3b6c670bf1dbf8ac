"""Regenerate the result tables of docs/probes.md from the committed probe results (no number is typed by hand).

    python scripts/build_probe_tables.py            # rewrite the block between the markers in docs/probes.md
    python scripts/build_probe_tables.py --check    # exit 1 if docs/probes.md or a <probe>.md is out of date (CI)

Every `results/probes/<run>/<probe>.json` is rendered by the probe's own `markdown()` function (the same code that
wrote `<probe>.md` next to it), runs in name order, probes in the order batch, ladder, layers, calibrate, controls,
greedy, invariance.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grpo_ratio.probes import batch, calibrate, controls, determinism, greedy, invariance, ladder, layers


ROOT = Path(__file__).resolve().parent.parent
RENDER = {"batch": batch.markdown, "ladder": ladder.markdown, "layers": layers.markdown,
          "calibrate": calibrate.markdown, "controls": controls.markdown, "greedy": greedy.markdown,
          "invariance": invariance.markdown, "determinism": determinism.markdown}
BEGIN, END = "<!-- probe-tables:begin (scripts/build_probe_tables.py) -->", "<!-- probe-tables:end -->"


def rendered(results_dir: Path) -> dict[Path, str]:
    """{result JSON path: its markdown} for every result under `results_dir`, runs in name order, probes in RENDER
    order."""
    out = {}
    for run in sorted(p for p in results_dir.iterdir() if p.is_dir()):
        for probe, render in RENDER.items():
            path = run / f"{probe}.json"
            if path.is_file():
                out[path] = render(json.loads(path.read_text()))
    return out


def tables(results: dict[Path, str]) -> str:
    """The block for docs/probes.md: each table headed by its source file."""
    return "\n".join(f"Source: `{path.relative_to(ROOT)}`\n\n{md}" for path, md in results.items())


def rebuild(doc: str, block: str) -> str:
    """`doc` with the text between the markers replaced by `block`.

    Raises:
        ValueError: the markers are missing.
    """
    if BEGIN not in doc or END not in doc:
        raise ValueError(f"docs/probes.md lacks the markers {BEGIN!r} ... {END!r}")
    head, rest = doc.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    return f"{head}{BEGIN}\n\n{block}\n{END}{tail}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=str(ROOT / "results" / "probes"))
    p.add_argument("--doc", default=str(ROOT / "docs" / "probes.md"))
    p.add_argument("--check", action="store_true", help="fail if the doc is not what this script would write")
    a = p.parse_args(argv)
    doc_path = Path(a.doc)
    results = rendered(Path(a.results))
    # the doc, and the <probe>.md written next to each JSON (same renderer), must match
    files = {doc_path: rebuild(doc_path.read_text(), tables(results))}
    files.update({path.with_suffix(".md"): md for path, md in results.items()})
    stale = [p for p, text in files.items() if not p.is_file() or p.read_text() != text]
    if a.check:
        for p in stale:
            print(f"{p} is out of date: run python scripts/build_probe_tables.py", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.write_text(files[p])
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
