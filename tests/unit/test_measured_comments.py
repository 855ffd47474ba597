"""A comment or docstring in dsnd/ that says something was "measured" names where a reader can
repeat it: a test (a path under tests/), a row of docs/benchmarks.md, or a ``dsnd bench``
command, within the same comment block or docstring paragraph. A fact nothing in the repo shows
is stated as DeepSpeed's or torch's behaviour, or as observed outside the suite, without the
word. Uses of the word for what the code itself measures are allowed by `ALLOWED`.
"""

from __future__ import annotations

import ast
import io
import pathlib
import re
import tokenize

import dsnd

ROOT = pathlib.Path(dsnd.__file__).parent
WORD = re.compile(r"\bmeasured\b", re.IGNORECASE)
CITES = re.compile(r"(?<![\w/.])tests/[\w/.-]+|docs/benchmarks\.md|dsnd bench\b")
_NOUN = (
    r"(?:costs?|seconds|times?|bytes|memory|bubble|ratio|steps?|peak|partition(?:ing)?|"
    r"fraction|ones|ms|latency|forward|iteration)\b"
)
ALLOWED = [
    re.compile(p, re.IGNORECASE)
    for p in (
        # "measured X": a quantity the code itself measures or a bench reports (measured layer
        # costs of `partition: profile`, a bench's measured bubble or peak), not a claim
        rf"measured (?:\([^)]*\) )?(?:[\w-]+ )?{_NOUN}",
        # a ratio's name: measured ÷ predicted (the planner's calibration and --validate)
        r"measured ÷|÷ measured",
        # the baseline a figure is divided by (MFU's peak, the overhead bench's plain loop)
        r"measured against",
        # where and when the code measures, at run time (the profile, the CPU peak, the meter)
        r"measured (?:here|in this process|in turn|again|\(?once per host\)?|on sampled steps|"
        r"on this process)|else measured on this CPU",
        # passive or relative: what a step, the profile or the telemetry measures
        r"(?:is|are|have|them|it|run|where|peak) measured",
    )
]


def _comment_blocks(source: str) -> list[tuple[int, str]]:
    """(first line, text) of each comment block: a comment and the whole-line comments on the
    lines right after it."""
    blocks: list[list] = []
    last = -1
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        line = tok.start[0]
        whole_line = not tok.line[: tok.start[1]].strip()
        if blocks and whole_line and line == last + 1:
            blocks[-1][1] += " " + tok.string.lstrip("#").strip()
        else:
            blocks.append([line, tok.string.lstrip("#").strip()])
        last = line
    return [(line, text) for line, text in blocks]


def _docstring_paragraphs(source: str) -> list[tuple[int, str]]:
    """(first line, text) of each paragraph of every bare string statement (module, class,
    function and attribute docstrings)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            text = node.value.value
            for para in re.finditer(r"(?:(?!\n[ \t]*\n).)+", text, re.DOTALL):
                start = para.start() + len(para.group()) - len(para.group().lstrip())
                out.append((node.lineno + text[:start].count("\n"), para.group()))
    return out


def _allowed(text: str, at: int) -> bool:
    plain = text.replace("`", "")
    at -= text[:at].count("`")
    return any(m.start() <= at < m.end() for p in ALLOWED for m in p.finditer(plain))


def unbacked_claims(path: pathlib.Path) -> list[str]:
    """'file:line: text' of each block or paragraph of `path` that says "measured" without
    naming where it is shown."""
    source = path.read_text()
    found = []
    for line, text in _comment_blocks(source) + _docstring_paragraphs(source):
        text = " ".join(text.split())
        if CITES.search(text):
            continue
        if any(not _allowed(text, m.start()) for m in WORD.finditer(text)):
            found.append(f"{path.relative_to(ROOT.parent)}:{line}: {text}")
    return found


def test_every_measured_claim_names_the_test_or_benchmark_that_shows_it():
    found = [hit for path in sorted(ROOT.rglob("*.py")) for hit in unbacked_claims(path)]
    assert found == [], "\n\n".join(found)
