"""The docs name real things: every file of the product is in docs/architecture.md's layout under its
own folder, every benchmark in benchmarks/README.md, and every path, script and config key that a
page names exists."""

import re
import subprocess

from conftest import REPO

from configs.schema import JobConfig

# Files a reader does not look for in the layout: the recipes (named as configs/*.toml), the bundled
# corpus (named as data/sample/), project files, the tests (named as a folder).
UNLISTED_SUFFIXES = (".toml", ".jsonl", ".txt", ".md", ".gitignore")
# A file or folder name in the layout ("forward/backward" is neither).
NAME = re.compile(r"(?<![\w/.-])(?:[\w-]+/(?=[\s,)])|(?:[\w.-]+/)*[\w.-]+\.(?:py|sh|sbatch)\b)")
PATH = re.compile(r"(?<![\w./-])((?:\.\./)?(?:[\w-]+/)+[\w.-]*\.(?:py|sh|sbatch|md|toml|jsonl))\b")
PLACEHOLDERS = ("X.toml", "YYYY", "models/mymodel/", "models/yours/")  # files a reader makes
KEY = re.compile(r"(?<![\w-])--([a-z0-9_]+)\.([a-z0-9_]+)\b")
PAGES = ["README.md", "CONTRIBUTING.md", "benchmarks/README.md"]
PAGES += [f"docs/{page.name}" for page in (REPO / "docs").glob("*.md")]


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [path for path in out.split() if (REPO / path).exists()]


def layout_entries() -> dict[str, str]:
    """docs/architecture.md's layout block: {folder or file at the line's start: the entry's text}."""
    text = (REPO / "docs/architecture.md").read_text()
    block = text.split("## Layout", 1)[1].split("```")[1]
    entries: dict[str, str] = {}
    head = None
    for line in block.splitlines():
        if line and not line[0].isspace():
            head, _, line = line.partition(" ")
            entries[head] = ""
        if head is not None:
            entries[head] += " " + line
    return entries


def test_architecture_names_every_file_in_its_folder():
    entries = layout_entries()
    missing = []
    for path in tracked_files():
        if path.startswith((".ci/", "tests/", "benchmarks/")) or path.endswith(UNLISTED_SUFFIXES):
            continue
        if path.endswith("__init__.py") and (REPO / path).stat().st_size < 300:
            continue  # a package marker with a docstring only
        folder, _, name = path.rpartition("/")
        entry = entries.get(f"{folder}/" if folder else name)
        if entry is not None and not folder:
            continue  # a file of the root heads its own entry
        if entry is None or not re.search(rf"(?<![\w.-]){re.escape(name)}\b", entry):
            missing.append(path)
    assert not missing, f"not in docs/architecture.md's layout, under their folder: {missing}"


def test_architecture_layout_names_only_real_files():
    invented = []
    for head, entry in layout_entries().items():
        if not (REPO / head).exists():
            invented.append(head)
            continue
        folder = REPO / head if head.endswith("/") else REPO
        for name in NAME.findall(entry):
            if not ((folder / name).exists() or (REPO / name).exists()):
                invented.append(f"{head} {name}")
    assert not invented, f"docs/architecture.md names what does not exist: {invented}"


def test_benchmarks_readme_names_every_benchmark():
    readme = (REPO / "benchmarks/README.md").read_text()
    missing = [
        path for path in tracked_files()
        if path.startswith("benchmarks/") and path.count("/") == 1 and path.rsplit("/", 1)[1] not in readme
        and path not in ("benchmarks/__init__.py", "benchmarks/README.md")
    ]  # fmt: skip
    nested = [path for path in tracked_files() if path.startswith("benchmarks/") and path.count("/") == 2]
    folders = {path.split("/")[1] + "/" for path in nested}
    missing += [f"benchmarks/{folder}" for folder in folders if folder not in readme]
    assert not missing, f"not in benchmarks/README.md: {missing}"


def test_pages_name_real_paths():
    """A path in README.md, CONTRIBUTING.md, benchmarks/README.md or docs/*.md (anything like
    folder/file.py) exists, read from the repository root or from the page's folder (except the old
    paths of a "What moved where" section)."""
    wrong = []
    for page in PAGES:
        text = re.sub(r"## What moved where.*?(?=\n## |\Z)", "", (REPO / page).read_text(), flags=re.S)
        for path in set(PATH.findall(text)):
            if "*" in path or path.startswith("outputs/") or any(p in path for p in PLACEHOLDERS):
                continue
            if not ((REPO / path).exists() or (REPO / page).parent.joinpath(path).exists()):
                wrong.append(f"{page}: {path}")
    assert not wrong, f"paths that do not exist: {wrong}"


def test_pages_name_real_config_keys():
    """Every --section.key a page shows is a key of the config (a renamed key fails here), except
    on lines about torchtitan, whose commands take its own keys."""
    config = JobConfig()
    wrong = []
    for page in PAGES:
        for line in (REPO / page).read_text().splitlines():
            if "torchtitan" in line:
                continue  # torchtitan's own keys
            for section, key in KEY.findall(line):
                if section != "section" and not hasattr(getattr(config, section, None), key):
                    wrong.append(f"{page}: --{section}.{key}")
    assert not wrong, f"config keys that do not exist: {wrong}"
