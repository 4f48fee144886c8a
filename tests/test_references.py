"""What the prose names exists, once: each ``NOTE [name]`` has one definition, and each file named in the
docs, the README, comments and docstrings is a file of this repository.

A NOTE is defined by a line that starts (after indentation and a ``#`` or a docstring's opening quotes)
with ``NOTE [name]:``; anywhere else, ``NOTE [name]`` refers to it. docs/design.md's index names the
file of each definition.
"""

from __future__ import annotations

import collections
import io
import re
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DEFINITION = re.compile(r'^\s*(?:#\s*|r?""")?NOTE \[([^\]]+)\]:')
REFERENCE = re.compile(r"NOTE\s+\[([^\]]+)\]")
# A file named in prose: a name ending in .py or .md, after folders or not, and not part of a URL or a dotted name.
FILE = re.compile(r"(?<![\w./:-])((?:\.\./)*[\w.-]*[\w-]+(?:/[\w.-]+)*\.(?:py|md))\b")
# Files named in prose that are not files of this repository, and why.
NOT_OURS = {
    "example.py": "the README's first example: the script its reader writes",
    "train.py": "the README's GPU example: the script its reader writes",
    "simple_fsdp.py": "torchtitan's SimpleFSDP, loaded from the installed torchtitan by benchmarks/baselines.py",
    "torchtitan/experiments/simple_fsdp/simple_fsdp.py": "the same file, by its path in torchtitan",
    "torch/optim/adam.py": "torch's source, where cost.py counts the optimizer's passes over its state",
    "torch/optim/sgd.py": "the same, for SGD",
}


def tracked(*patterns: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.split()


def prose(path: str) -> str:
    """A markdown file's text; a Python file's comments and docstrings (triple-quoted strings)."""
    text = (ROOT / path).read_text()
    if path.endswith(".md"):
        return text
    parts = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING
                                            and tok.string.lstrip("rbuRBU").startswith(('"""', "'''"))):
            parts.append(tok.string)
    return "\n".join(parts)


def notes() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """``(definitions, references)``: name -> ``file:line`` of each definition, name -> files referring."""
    definitions: dict[str, list[str]] = collections.defaultdict(list)
    references: dict[str, list[str]] = collections.defaultdict(list)
    for path in tracked("*.py", "*.md"):
        if path == "tests/test_references.py":
            continue  # (its examples name no NOTE)
        text = (ROOT / path).read_text()
        for number, line in enumerate(text.splitlines(), 1):
            if m := DEFINITION.match(line):
                definitions[m.group(1)].append(f"{path}:{number}")
        joined = re.sub(r"\n\s*#\s*", " ", text)  # a name wrapped onto the next comment line
        for m in REFERENCE.finditer(joined):
            references[" ".join(m.group(1).split())].append(path)
    return definitions, references


def test_every_note_has_one_definition() -> None:
    definitions, references = notes()
    twice = {name: where for name, where in definitions.items() if len(where) > 1}
    assert not twice, f"NOTEs defined more than once (keep one 'NOTE [name]:', refer to it elsewhere): {twice}"
    missing = {name: sorted(set(files)) for name, files in references.items() if name not in definitions}
    assert not missing, f"NOTEs referred to but defined nowhere: {missing}"


def test_the_index_of_notes_names_each_definition() -> None:
    definitions, _ = notes()
    index = {}
    for line in (ROOT / "docs/design.md").read_text().splitlines():
        if m := re.match(r"^\| ([^|`]+?) \| `([^`]+)`", line):
            index[m.group(1).strip()] = m.group(2)
    defined_in = {name: where[0].partition(":")[0] for name, where in definitions.items()}
    assert index == defined_in, (
        "docs/design.md's index of NOTEs differs from the definitions: "
        f"{ {n: (index.get(n), defined_in.get(n)) for n in index.keys() | defined_in.keys() if index.get(n) != defined_in.get(n)} }")


def test_files_named_in_prose_exist() -> None:
    files = tracked()
    names = {Path(f).name for f in files}
    missing = []
    for path in tracked("*.py", "*.md"):
        for m in FILE.finditer(prose(path)):
            named = m.group(1)
            if named in NOT_OURS:
                continue
            found = named in names if "/" not in named else any(f == named or f.endswith("/" + named) for f in files)
            if not found:
                missing.append(f"{path}: {named}")
    assert not missing, "files named in docs, comments or docstrings that this repository does not hold:\n" + \
        "\n".join(missing)


def test_nothing_points_outside_the_repository() -> None:
    outside = re.compile(r"(?<![\w/.])(?:\.\./)+[\w.-]+|(?<![\w/.])shared/")
    found = [f"{path}: {m.group(0)}" for path in tracked("*.py", "*.md", "*.toml", "*.json", ".ci/*")
             for m in outside.finditer(prose(path) if path.endswith((".py", ".md")) else (ROOT / path).read_text())]
    assert not found, "references to folders outside the repository:\n" + "\n".join(found)


def test_the_checks_read_what_they_should(tmp_path: Path) -> None:
    assert DEFINITION.match('    """NOTE [a b]: text') and DEFINITION.match("# NOTE [a b]: text")
    assert not DEFINITION.match("    see NOTE [a b]: text") and not DEFINITION.match('"""(NOTE [a b]) Text')
    assert [m.group(1) for m in FILE.finditer("``passes/lower/bucket.py``, flat.py; torch.optim.sgd, https://x.org/a.py")] \
        == ["passes/lower/bucket.py", "flat.py"]
