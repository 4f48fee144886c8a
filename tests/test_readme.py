"""README.md's code runs as written. Each test reads the blocks from the README when it runs (no copy
here), so an edit to the README is what gets tested:

- a Python script block names its file and launch command on its first line (``# example.py: torchrun
  ...``) and is run by exactly that command; the GPU script and the rank-0 loading snippet run in
  tests/test_cuda.py;
- a bash block's commands are checked for what a test can check: the install and test commands against
  what ``.ci/run`` runs, the CLI's and benchmarks' flags by their own parsers, and ``explain`` run for real;
- ``text`` blocks are pictures. A block that none of these covers fails ``test_every_block_is_covered``.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_compile.__main__ import main as cli, parser as cli_parser

ROOT = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_LAUNCH = re.compile(r"# (?P<file>[\w-]+\.py): (?P<cmd>torchrun .*?(?P=file))")
CUDA_SCRIPTS, LOAD_SNIPPET = ("train.py",), "broadcast_from_rank0=True"  # run by tests/test_cuda.py


def readme() -> str:
    return (ROOT / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    """The README's code blocks fenced as ``lang``, in order."""
    return [body for fence, body in _FENCE.findall(readme()) if fence == lang]


def scripts() -> dict[str, tuple[str, str]]:
    """Python blocks that say how to launch them: file name -> (launch command, text)."""
    found = {}
    for body in blocks("python"):
        if (m := _LAUNCH.match(body)) is not None:
            found[m["file"]] = (m["cmd"], body)
    return found


def torchrun(argv: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``torchrun <argv>`` as this interpreter's ``torch.distributed.run``, this checkout first on the path."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": path})


def launch(file: str, cwd: Path, *, nproc: int | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Write the README's ``file`` block into ``cwd`` and run it by its launch command (``nproc``, where
    given, replaces the number of processes: fewer GPUs than the README's)."""
    cmd, body = scripts()[file]
    (cwd / file).write_text(body)
    argv = shlex.split(cmd)
    assert argv[0] == "torchrun", cmd
    if nproc is not None:
        argv = [re.sub(r"^(--nproc[-_]per[-_]node=)\d+$", rf"\g<1>{nproc}", a) for a in argv]
    return torchrun(argv[1:], cwd, timeout)


def test_every_block_is_covered() -> None:
    fences = [fence for fence, _ in _FENCE.findall(readme())]
    assert set(fences) <= {"python", "bash", "text"}, fences  # an unlabelled block would be tested by nobody
    launched = set(scripts())
    assert launched == {"example.py", *CUDA_SCRIPTS}, launched
    fragments = [b for b in blocks("python") if _LAUNCH.match(b) is None]
    assert len(fragments) == 1 and LOAD_SNIPPET in fragments[0], fragments


def test_the_example_trains_under_torchrun(tmp_path: Path) -> None:
    """Two gloo ranks; rank 0 alone prints one line a step, and the loss falls."""
    done = launch("example.py", tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"^step \d+: loss (\S+)$", done.stdout, re.M)]
    steps = int(re.search(r"for step in range\((\d+)\)", scripts()["example.py"][1])[1])
    assert len(losses) == steps, done.stdout  # once each: rank 1 prints nothing
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses


def commands() -> list[list[str]]:
    """Every command of the README's bash blocks (lines joined at ``\\``, split at ``&&``), as argv."""
    out = []
    for body in blocks("bash"):
        for line in body.replace("\\\n", " ").splitlines():
            out += [shlex.split(part) for part in line.split("&&") if part.strip()]
    return out


def _ci_commands() -> list[list[str]]:
    text = (ROOT / ".ci" / "run").read_text()
    return [[a for a in shlex.split(line) if a != "--quiet"] for line in text.splitlines()
            if line.startswith("python3 -m")]


def _extras() -> set[str]:
    """The names of pyproject.toml's ``[project.optional-dependencies]``."""
    section = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]\n", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^(\w+) = ", section, re.M))


def test_install_and_test_commands_are_what_ci_runs() -> None:
    """pip and pytest cannot run inside the suite: the test command must be .ci/run's (its options may
    follow), the pinned torch CI's, and each editable install of this repository name extras it has."""
    ci = _ci_commands()
    checked = 0
    for argv in commands():
        if argv[:3] == ["python3", "-m", "pytest"]:
            assert any(c[:len(argv)] == argv for c in ci), (argv, ci)
        elif argv[:4] == ["python3", "-m", "pip", "install"]:
            for spec in argv[4:]:
                if spec.startswith("torch=="):
                    assert ["python3", "-m", "pip", "install", spec] in ci, (spec, ci)
                elif spec != "-e":
                    assert (m := re.fullmatch(r"\.(?:\[([\w,]+)\])?", spec)) is not None, spec
                    assert set(filter(None, (m[1] or "").split(","))) <= _extras(), spec
        else:
            continue
        checked += 1
    assert checked >= 3


def test_cli_and_benchmark_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``explain`` runs for real (in a scratch directory; no GPU needed); ``demo`` (trained in
    tests/test_stack.py) and the GPU benchmarks have their flags checked by their own parsers."""
    monkeypatch.chdir(tmp_path)
    seen = set()
    for argv in commands():
        if argv[:3] == ["python3", "-m", "fsdp_compile"] and argv[3] == "explain":
            assert cli(argv[3:]) == 0
            assert "estimated step" in capsys.readouterr().out
            out = argv[argv.index("--out") + 1] if "--out" in argv else "out/explain"
            assert {"summary.json", "trace.json", "forward.txt", "backward.txt"} <= {p.name for p in Path(out).iterdir()}
        elif argv[:3] == ["python3", "-m", "fsdp_compile"]:
            cli_parser().parse_args(argv[3:])
        elif argv[:2] == ["python3", "-m"] and argv[2].startswith("benchmarks."):
            importlib.import_module(argv[2]).parse_args(argv[3:])  # exits on a flag it does not know
        elif argv[:2] == ["python3", "-m"] and argv[2] in ("pip", "pytest"):
            continue  # the test above
        else:
            raise AssertionError(f"no test knows how to check the README's command {shlex.join(argv)!r}")
        seen.add(argv[2] if argv[2] != "fsdp_compile" else argv[3])
    assert {"explain", "demo"} <= seen, seen


def test_names_in_the_prose_resolve_after_a_plain_import() -> None:
    """``fsdp_compile.a.b`` written outside the code blocks works after ``import fsdp_compile`` alone (in a
    fresh interpreter), and that import loads neither transformers nor safetensors."""
    names = sorted(set(re.findall(r"\bfsdp_compile(?:\.\w+)+", _FENCE.sub("", readme()))))
    assert "fsdp_compile.api.hf.load_pretrained" in names, names
    code = ("import functools, sys, fsdp_compile\n"
            "print([m for m in ('transformers', 'safetensors') if m in sys.modules])\n"
            f"for name in {names!r}:\n"
            "    functools.reduce(getattr, name.split('.')[1:], fsdp_compile)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", done.stdout
