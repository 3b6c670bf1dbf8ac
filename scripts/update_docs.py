"""Regenerate the measured tables in docs/*.md from committed result files (no number is typed by hand).

A generated block in a markdown file looks like

    <!-- BEGIN generated: python benchmarks/ratio_smollm2.py --render results/ratio_smollm2.json -->
    ...output of that command...
    <!-- END generated -->

`python scripts/update_docs.py` re-runs every command and rewrites its block; `--check` only reports stale blocks
(exit 1), which tests/test_docs.py runs. The command `show PATH` is no program: the block is the file PATH of the
repository in a fenced code block (a runnable script a doc shows in full, e.g. trainers/async_grpo.py).

Without `--check` it also regenerates the CLI precheck's field list, grpo_ratio/cli/cli_fields.json
(`python -m grpo_ratio.cli.precheck --write`: a config field's help or choices changed; tests/test_precheck.py checks
it is current).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- BEGIN generated: (?P<cmd>.+?) -->\n)(?P<body>.*?)(<!-- END generated -->)", re.S)


def render(cmd: str) -> str:
    argv = shlex.split(cmd)
    if argv[0] == "show":
        path = ROOT / argv[1]
        language = {".py": "python", ".sh": "bash"}.get(path.suffix, "")
        return f"```{language}\n{path.read_text().rstrip()}\n```\n"
    if argv[0] == "python":
        argv[0] = sys.executable
    # a render only reads committed files; without WANDB_MODE, transformers' import prints no W&B banner to stdout
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True, env=env).stdout
    return out.rstrip("\n") + "\n"


def update(path: Path, check: bool) -> bool:
    """Rewrite (or, with check, compare) every generated block of one file; True when it was up to date."""
    text = path.read_text()
    stale = []

    def replace(match):
        body = render(match.group("cmd"))
        if body != match.group("body"):
            stale.append(match.group("cmd"))
        return match.group(1) + body + match.group(4)

    new = BLOCK.sub(replace, text)
    if stale and not check:
        path.write_text(new)
    for cmd in stale:
        print(f"{path.relative_to(ROOT)}: {'stale' if check else 'updated'}: {cmd}")
    return not stale


def main(argv: list[str]) -> int:
    check = "--check" in argv
    if not check:
        subprocess.run([sys.executable, "-m", "grpo_ratio.cli.precheck", "--write"], cwd=ROOT, check=True)
    ok = all([update(p, check) for p in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"] if p.exists()])
    return 0 if ok or not check else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
