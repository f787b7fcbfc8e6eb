"""Render the config reference, docs/configuration.md, from the field docstrings in configs/schema.py.

`python -m configs.docs` prints the reference tables; `python -m configs.docs --write` writes the
whole page (the introduction below, then the tables between the `<!-- config-reference -->`
markers). tests/test_config.py fails when the page differs from what this module renders, so the
reference cannot drift from the schema: change a docstring in configs/schema.py, then run --write.
"""

import ast
import dataclasses
import inspect
import sys
from pathlib import Path

from configs.loader import _toml_value
from configs.schema import JobConfig

BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"
PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
INTRODUCTION = """\
# Configuration reference

Every config key, its default and its meaning, one table per TOML section. A recipe
(`configs/*.toml`) sets some of them; every key it does not set keeps the default shown here.

Any key can be overridden on the command line after `--config`, as `--section.key value` or
`--section.key=value`; booleans also as a bare `--section.key`, lists as `a,b` or TOML `[1, 2]`:

```bash
python train.py --config configs/llama3_debug.toml --training.steps 200 --optimizer.lr=1e-3
```

A key that does not exist, a wrong type or a value out of range stops the run with one
`error: ...` line naming the key (and the key you probably meant). The resolved config of a run is
written to `config.toml` in its `job.dump_folder` and loads again with `--config`.

This page is generated from the field docstrings in `configs/schema.py` by `configs/docs.py`: edit
the docstring, then run `python -m configs.docs --write`. `tests/test_config.py` fails while the
page is stale.
"""


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
    """The tables: one per config section, a row per key (name, default, docstring)."""
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


def configuration_page() -> str:
    """The whole of docs/configuration.md: the introduction, then the tables between the markers."""
    return f"{INTRODUCTION}\n{BEGIN}\n{reference_markdown()}{END}\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        PAGE.write_text(configuration_page())
    elif sys.argv[1:]:
        sys.exit("usage: python -m configs.docs [--write]")
    else:
        print(reference_markdown())
