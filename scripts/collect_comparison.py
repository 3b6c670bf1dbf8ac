"""Copy the small, committable part of a finished comparison into results/: the summary, the overlay PNG and each
run's log history and configuration (no W&B folders, no models).

    python scripts/collect_comparison.py runs/compare/arith-arms results/arms_smollm2_arithmetic

The docs render their tables from the copied `summary.json` (`python trainers/compare.py --render ...`).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def collect(src: Path, dest: Path) -> list[Path]:
    """Copy `summary.json`, `comparison.png` and `<run>/{log_history,first_rollouts,rollout_fingerprints}.json` plus
    the run's config.

    Raises:
        FileNotFoundError: `src` has no `summary.json` (the comparison did not finish).
    """
    if not (src / "summary.json").is_file():
        raise FileNotFoundError(f"{src}/summary.json: the comparison has not finished (resume it first)")
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for name in ("summary.json", "comparison.png"):
        if (src / name).is_file():
            shutil.copy2(src / name, dest / name)
            written.append(dest / name)
    for run in sorted(p for p in src.iterdir() if (p / "log_history.json").is_file()):
        out = dest / run.name
        out.mkdir(exist_ok=True)
        for name in ("log_history.json", "first_rollouts.json", "rollout_fingerprints.json"):
            if (run / name).is_file():  # fingerprints: absent in runs recorded before they were stored
                shutil.copy2(run / name, out / name)
                written.append(out / name)
        meta = json.loads((run / "run.json").read_text())
        meta.pop("fingerprint", None)  # the recipe text: in recipes/ already
        (out / "run.json").write_text(json.dumps(meta, indent=1) + "\n")
        written.append(out / "run.json")
    return written


if __name__ == "__main__":
    for path in collect(Path(sys.argv[1]), Path(sys.argv[2])):
        print(f"wrote {path}")
