"""README is what a user needs first; reference pages live in docs/ and every link resolves."""

from __future__ import annotations

import os
import re

from tests.procs import ROOT

README_MAX_LINES = 200
DOCS = os.path.join(ROOT, "docs")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _pages() -> list[str]:
    return [os.path.join(ROOT, "README.md")] + sorted(
        os.path.join(DOCS, name) for name in os.listdir(DOCS) if name.endswith(".md")
    )


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    anchors = set()
    for line in text.splitlines():
        m = re.match(r"^#{1,6} (.+)$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            anchors.add(slug)
    return anchors


def test_readme_is_short_and_has_the_common_tasks():
    text = _read(os.path.join(ROOT, "README.md"))
    assert len(text.splitlines()) <= README_MAX_LINES, len(text.splitlines())
    tasks = text.split("## Common tasks", 1)[1].split("\n## ", 1)[0]
    for phrase in (
        "Hugging Face model",
        "DeepSpeed JSON",
        "hosts or on Slurm",
        "another layout",
        "tokenizer",
        "Export",
    ):
        assert phrase in tasks, phrase
    for command in ("dsnd launch --nprocs 2", "python -m pytest -q", "pip install torch==2.13.0"):
        assert command in text, command


def test_every_docs_page_is_linked_from_readme():
    readme = _read(os.path.join(ROOT, "README.md"))
    for page in _pages()[1:]:
        assert f"](docs/{os.path.basename(page)})" in readme, page


def test_every_relative_link_resolves():
    broken = []
    for page in _pages():
        for target in _LINK.findall(_read(page)):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s)://, mailto:
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(full):
                broken.append(f"{page}: {target}")
            elif anchor and full.endswith(".md") and anchor not in _anchors(_read(full)):
                broken.append(f"{page}: {target} (no such heading)")
    assert not broken, broken
