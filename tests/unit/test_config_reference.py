"""The config reference in docs/configuration.md is generated from the schema: never stale."""

from __future__ import annotations

import dataclasses
import os

from dsnd.config import reference, schema
from dsnd.config.strict import key_of
from tests.procs import ROOT


def test_docs_reference_is_current():
    with open(os.path.join(ROOT, reference.PAGE), encoding="utf-8") as f:
        text = f.read()
    assert reference.replace_section(text) == text, (
        f"{reference.PAGE}'s config reference is stale: run python -m dsnd.config.reference"
    )


def test_reference_lists_every_field_with_its_doc():
    table = reference.render()
    count = 0
    for top in dataclasses.fields(schema.RunConfig):
        section = top.default_factory() if top.default_factory is not dataclasses.MISSING else None
        if section is None:
            assert f"| `{top.name}` |" in table
            count += 1
            continue
        for f in dataclasses.fields(section):
            row = next(
                line
                for line in table.splitlines()
                if line.startswith(f"| `{top.name}.{key_of(f)}` |")
            )
            assert f.metadata["doc"] in row and row.count(" | ") == 3, row
            count += 1
    assert len(table.splitlines()) == count + 2
