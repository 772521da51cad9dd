"""The manual speaks to users: no word of how the project was built in any tracked text file, every `python launch.py`
line of the README and the docs composes into a config (nothing run), and every `make` target they name exists."""

from __future__ import annotations

import re
import shlex
import subprocess

import pytest

from conftest import REPO

PROCESS = re.compile(r"\b(stop|issue)s? [0-9]+|re-measurement is owed|my other light work|loaded by other agents|"
                     r"no GPU lent|this task drew none|the brief's|this session's|the seed reports?\b|\b(this|the) stop('s)?\b", re.I)
"""What a user of the product has no use for: the team's steps and tickets, its sessions and machines."""

TEXT = (".md", ".py", ".yaml", ".yml", ".toml", ".cfg", ".txt", ".sh", "Makefile", ".ci/run")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [f for f in out if f.endswith(TEXT) and f != "tests/test_manual.py"]  # its own pattern, spelled out


def test_no_process_words_in_any_tracked_text_file():
    word, ticket = "st" + "op", "iss" + "ue"  # spelled apart so that this file says no such phrase itself
    assert PROCESS.search(f"measured at {word} 49") and PROCESS.search(f"{ticket} 38's ablation")  # the pattern bites
    found = []
    for f in _tracked():
        if not (REPO / f).is_file():
            continue
        text = (REPO / f).read_text(errors="replace")
        found += [f"{f}:{i}: {line.strip()[:100]}" for i, line in enumerate(text.splitlines(), 1) if PROCESS.search(line)]
        flat = " ".join(text.replace("#", " ").split())  # a phrase broken across lines (of prose or comments)
        found += [f"{f}: ... {m.group(0)} ..." for m in PROCESS.finditer(flat) if not any(m.group(0) in x for x in found)]
    assert not found, found


def _launch_lines() -> list[str]:
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    lines = []
    for p in docs:
        for m in re.finditer(r"python launch\.py([^`|\n]*)", p.read_text()):
            lines.append(m.group(1).split("#")[0].strip())
    return sorted(set(lines))


def _overrides(line: str) -> list[str] | None:
    """A documented launch line's overrides as one composition (a sweep's first value); None for a line with a
    placeholder (``<name>``, ``...``, a shell variable or a continued line)."""
    if any(t in line for t in ("<", "...", "$", "\\")):
        return None
    out = []
    for tok in shlex.split(line):
        if tok == "-m" or tok.startswith("hydra"):
            continue
        key, _, value = tok.partition("=")
        if "," in value and not value.startswith("["):
            value = value.split(",")[0]  # a sweep: its first point
        out.append(f"{key}={value}")
    return out


def test_every_launch_line_of_the_docs_composes(compose_cfg):
    lines = _launch_lines()
    assert len(lines) >= 30
    composed = 0
    for line in lines:
        ov = _overrides(line)
        if ov is None:
            continue
        try:
            compose_cfg(ov)
        except Exception as exc:  # noqa: BLE001 - any failure to compose is the finding
            pytest.fail(f"`python launch.py {line}` does not compose: {type(exc).__name__}: {exc}")
        composed += 1
    assert composed >= 25


def test_every_make_target_the_docs_name_exists():
    targets = set(re.findall(r"^([a-z][a-z-]*):", (REPO / "Makefile").read_text(), re.M))
    named = set()
    for p in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        named |= set(re.findall(r"`make ([a-z][a-z-]*)", p.read_text()))
    assert named and not named - targets, sorted(named - targets)


def test_no_absolute_machine_path_in_the_set_up():
    """The set-up works from any folder: no absolute path of one machine in CI's script, the Makefile or the docs."""
    machine = re.compile(r"(?<![\w.])/(work|root|home|Users)/")
    files = [REPO / ".ci" / "run", REPO / "Makefile", REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = [f"{p.name}:{i}: {line.strip()[:80]}" for p in files if p.is_file()
             for i, line in enumerate(p.read_text().splitlines(), 1) if machine.search(line)]
    assert not found, found
