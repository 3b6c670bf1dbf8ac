"""The measured tables in docs/ are generated from committed results (scripts/update_docs.py), never typed by hand."""

import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def test_generated_doc_tables_are_up_to_date():
    proc = subprocess.run([sys.executable, "scripts/update_docs.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------------------------------
# prose numbers: every number the prose of a measured doc states must be held by the generated tables beside it

import re  # noqa: E402

import pytest  # noqa: E402


GENERATED = re.compile(r"<!-- BEGIN generated: .+? -->\n(.*?)<!-- END generated -->", re.S)
NOT_PROSE = [re.compile(p, re.S) for p in (r"<!-- BEGIN generated: .+? -->.*?<!-- END generated -->",
                                           r"```.*?```", r"`[^`\n]*`", r"\]\([^)]*\)", r"https?://\S+",
                                           r"github\.com/\S+", r"<!--.*?-->")]
NUMBER = re.compile(r"(?<![\w.\-/=^])[-−+]?\d+(?:\.\d+)?%?(?![\w.]\d|[\w])")
# numbers that are settings, rules or citations, not measurements of this project (with the reason)
NOT_MEASURED = {
    "docs/reading.md": {"0.9", "1.1",  # the default band [0.9, 1.1]
                        "1%", "0.97", "95%",  # thresholds of the report's rules; the interval level
                        "0", "1", "2", "3", "10"},  # exactly 0 / 1; seeds and steps the verdict needs
    "docs/arms.md": {"2", "4", "16", "3", "10", "150",  # recipe settings; seeds and steps the verdict needs; the
                     "1"},  # batch-logprob-gap report's steps; num_iterations / "exactly 1"
}


def prose_numbers(text: str) -> list[str]:
    """Numbers in the prose of a markdown doc: outside generated blocks, code, links and comments."""
    for pattern in NOT_PROSE:
        text = pattern.sub(" ", text)
    return [m.group(0).replace("−", "-") for m in NUMBER.finditer(text)]


def _value(token: str) -> tuple[float, bool, int]:
    """(value, is a percentage, decimals) of a number token."""
    pct = token.endswith("%")
    digits = token.rstrip("%")
    return float(digits), pct, len(digits.split(".")[1]) if "." in digits else 0


def held(number: str, tables: str) -> bool:
    """Whether a table number, rounded to the prose number's decimals, equals it (a percentage also matches the
    table's fraction: 9.7% is held by 0.097)."""
    value, pct, decimals = _value(number)
    for token in NUMBER.findall(tables.replace("−", "-")):
        t, t_pct, _ = _value(token)
        if pct and not t_pct:
            t, t_pct = 100 * t, True
        if t_pct == pct and abs(round(t, decimals) - value) < 1e-9:
            return True
    return False


def test_held_reads_percentages_and_rounding():
    tables = "| fp32_clone | 0.097 | +0.012 | 5.9% |"
    assert held("9.7%", tables) and held("6%", tables) and held("+0.012", tables)
    assert not held("+0.013", tables) and not held("9.8%", tables)  # the arms.md prose
    assert prose_numbers("a `9.9` b 7.6% of tokens, [x](y-1.2) p99 1.5B step-1 −0.022") == ["7.6%", "-0.022"]


@pytest.mark.parametrize("doc", sorted(NOT_MEASURED))
def test_prose_numbers_are_held_by_the_generated_tables(doc):
    text = (ROOT / doc).read_text()
    tables = "\n".join(GENERATED.findall(text))
    assert tables, f"{doc} has no generated table"
    stray = [n for n in prose_numbers(text) if n not in NOT_MEASURED[doc] and not held(n, tables)]
    assert not stray, f"{doc}: prose numbers no generated table holds: {stray}"


# ---------------------------------------------------------------------------------------------------------------------
# module paths: the README and the docs name only modules, folders and names that exist (the package moves; its
# docs must move with it), and never a module name retired by the move into rooms (docs/design.md, "Old module names")

import ast  # noqa: E402


PACKAGE = ROOT / "grpo_ratio"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# a path inside the repository (`grpo_ratio/...`, or `../grpo_ratio/...` from docs/), not a cache or clone folder
PATH = re.compile(r"(?:(?<=\.\./)|(?<![\w/.~]))grpo_ratio/[\w/]*\w+(?:\.py|\.json|/)?")
DOTTED = re.compile(r"(?<![\w/.])grpo_ratio(?:\.[A-Za-z_]\w*)+")
RETIRED = re.compile(r"(?<![\w/.])(?:scoring|rollouts|lints|sharding|sharding_fsdp2|sharding_zero3|memory|testing_sharded|"
                     r"corrections|diagnostics|cli)\.py\b|grpo_ratio[./]scripts\b|grpo_ratio\.(?:scoring|rollouts|lints|"
                     r"memory|testing_sharded|sharding)\b")
# "Old module names" in docs/design.md maps the retired names on purpose
RETIRED_TABLE = re.compile(r"### Old module names\n.*?\n## ", re.S)


def top_level_names(module: Path) -> set[str]:
    """Names a module defines or imports at its top level (the package face: also its lazily imported names)."""
    names = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            if isinstance(node.value, ast.Dict) and any(getattr(t, "id", "") == "_LAZY" for t in targets):
                names |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    return names


def resolve_dotted(dotted: str) -> str | None:
    """None when `grpo_ratio.a.b.name...` is a module, or a module and a name it defines; else what is missing."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if module.exists():
            rest = parts[cut:]
            return None if not rest or rest[0] in top_level_names(module) else f"{rest[0]} not in {module.name}"
    return "no such module"


def test_resolve_dotted_reads_modules_and_their_names():
    assert resolve_dotted("grpo_ratio.diagnostics.ratios.valid_token_mask") is None
    assert resolve_dotted("grpo_ratio.RatioGRPOTrainer") is None  # the package face's lazy name
    assert resolve_dotted("grpo_ratio.diagnostics.ratios.no_such_name") is not None
    assert resolve_dotted("grpo_ratio.scoring") is not None


def _prose(path: Path) -> str:
    return RETIRED_TABLE.sub("## ", path.read_text()) if path.name == "design.md" else path.read_text()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_name_only_modules_that_exist(doc):
    text = _prose(doc)
    missing = [p for p in PATH.findall(text) if not (ROOT / p).exists()]
    missing += [f"{d} ({why})" for d in set(DOTTED.findall(text)) if (why := resolve_dotted(d.rstrip(".")))]
    missing += [m.group(0) for m in RETIRED.finditer(text)]
    assert not missing, f"{doc.relative_to(ROOT)} names what the package does not have: {sorted(set(missing))}"


def test_the_design_is_the_inventory_of_every_module():
    """docs/design.md names every module of the package: by its path under grpo_ratio/, or by its name in the row of
    its folder."""
    design = (ROOT / "docs" / "design.md").read_text()
    unnamed = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        folder = path.parent.relative_to(PACKAGE).as_posix()
        named = f"`{rel}`" in design or (folder != "." and f"{folder}/" in design and path.stem in design)
        if path.name == "__init__.py":
            named = folder == "." or f"`{folder}/" in design
        unnamed += [] if named else [rel]
    assert not unnamed, f"docs/design.md does not name {unnamed}"


# ---------------------------------------------------------------------------------------------------------------------
# fields: each new field (`RatioFields`, shared by RatioGRPOConfig and RatioRLOOConfig) is described once, in its
# `help`; the feature pages list theirs on a
# "Fields:" line linking to grpo_ratio/config.py, and every field has such a page

FIELDS_LINE = re.compile(r"^Fields:(.*?)(?:\n\n|\Z)", re.S | re.M)
CONFIG_LINK = re.compile(r"\[([^\]]*)\]\(\.\./grpo_ratio/config\.py\)")


def config_fields() -> set[str]:
    tree = ast.parse((PACKAGE / "config.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RatioFields")  # both configs
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def listed_fields() -> dict[str, set[str]]:
    """doc -> the field names its "Fields:" lines list (in backticks)."""
    found = {}
    for doc in sorted((ROOT / "docs").glob("*.md")):
        links = [link for block in FIELDS_LINE.findall(doc.read_text()) for link in CONFIG_LINK.findall(block)]
        names = {n for link in links for n in re.findall(r"`(\w+)`", link)}
        if names:
            found[doc.name] = names
    return found


def test_every_config_field_is_listed_on_a_feature_page_and_only_real_ones():
    fields, listed = config_fields(), listed_fields()
    assert len(fields) > 20  # the AST walk found the class
    everywhere = set().union(*listed.values())
    assert fields - everywhere == set(), "fields no page lists on a 'Fields:' line"
    assert {doc: sorted(names - fields) for doc, names in listed.items() if names - fields} == {}
    for doc in ("scoring_modes.md", "truncation.md", "corrections.md", "moe.md"):  # the main feature pages
        text = (ROOT / "docs" / doc).read_text()
        assert doc in listed and "](../grpo_ratio/config.py)" in FIELDS_LINE.search(text).group(1), doc


def test_the_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"](docs/{p.name})" not in readme] == []
