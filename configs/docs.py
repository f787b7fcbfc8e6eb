"""Render the config reference from the field docstrings in configs/schema.py.

`python -m configs.docs` prints the Markdown that README.md holds between the
`<!-- config-reference -->` markers; tests/test_config.py fails when the two differ, so the README
cannot drift from the schema. `python -m configs.docs --write` updates the README in place.
"""

import ast
import dataclasses
import inspect
import sys
from pathlib import Path

from configs.loader import _toml_value
from configs.schema import JobConfig

BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"


def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under each field of a dataclass, keyed by field name."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def reference_markdown() -> str:
    config = JobConfig()
    out = []
    for section in dataclasses.fields(config):
        obj = getattr(config, section.name)
        docs = field_docs(type(obj))
        out += [f"**[{section.name}]**", "", "| key | default | meaning |", "| --- | --- | --- |"]
        for f in dataclasses.fields(obj):
            default = _toml_value(getattr(obj, f.name)).replace("|", "\\|")
            out.append(f"| `{f.name}` | `{default}` | {docs.get(f.name, '')} |")
        out.append("")
    return "\n".join(out)


def readme_with_reference(readme: str) -> str:
    head, _, rest = readme.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{reference_markdown()}{END}{tail}"


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        readme = Path(__file__).resolve().parent.parent / "README.md"
        readme.write_text(readme_with_reference(readme.read_text()))
    else:
        print(reference_markdown())
