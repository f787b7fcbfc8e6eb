"""docs/architecture.md says where everything is: every file of the tree is named there."""

import subprocess

from conftest import REPO

# Files a reader does not look for in the layout: package markers with no code, the recipes (named
# as configs/*.toml), the bundled corpus (named as data/sample/), project files.
UNLISTED_SUFFIXES = (".toml", ".jsonl", ".txt", ".md", ".gitignore")


def test_architecture_names_every_file():
    layout = (REPO / "docs/architecture.md").read_text()
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    missing = []
    for path in files.split():
        name = path.rsplit("/", 1)[-1]
        if (
            path.startswith((".ci/", "tests/"))
            and path != "tests/test_gpu.py"
            or path.endswith(UNLISTED_SUFFIXES)
        ):
            continue
        if name == "__init__.py" and (REPO / path).stat().st_size < 300:
            continue  # a package marker with a docstring only
        if name not in layout:
            missing.append(path)
    assert not missing, f"not in docs/architecture.md: {missing}"
