"""The DeepSpeed JSONs users have (tests/deepspeed_configs/, copied from public repositories; see
SOURCES.md there): each one trains 2 steps on 2 ranks (pp=2) or is refused before start, with
the reason DeepSpeed itself gives on this machine or the feature dsnd does not run yet.

The batch keys are set for the test (micro-batch 2, 2 micro-batches per step): the corpus is
about each JSON's sections, not its production batch size. The table of outcomes is printed
(``pytest -s``) and written to the test's temporary directory.
"""

from __future__ import annotations

import json
import math
import pathlib

import pytest

from dsnd.config.deepspeed_json import load_json
from dsnd.config.load import load
from dsnd.config.resolve import resolve
from dsnd.errors import UserError, problems_of
from tests.distributed.parity import run_cases

CORPUS = pathlib.Path(__file__).parent.parent / "deepspeed_configs"
BATCH = (
    "ds.train_batch_size=null",
    "ds.train_micro_batch_size_per_gpu=2",
    "ds.gradient_accumulation_steps=2",
)
LAYOUT = ("parallel.pp=2", "train.steps=2", "checkpoint.every=0", "checkpoint.resume=never")

REFUSED = {
    "fp16 is not supported on this device (DeepSpeed: Type fp16": "fp16 enabled on a CPU",
    "DeepSpeed rejects the config": "DeepSpeed's own config check",
    "ZeRO++ quantized": "ZeRO++ qwZ/qgZ: no quantizer op on this CPU",
    "the comet monitor is not supported": "comet: not in dsnd",
    "unknown key '": "a key DeepSpeed's config refuses too",
    "sub_group_size=0 splits a pipeline stage": "ZeRO-3 sub-groups that hang a pipeline",
    "'auto' is not a value dsnd can fill here": "an 'auto' the Hugging Face integration "
    "does not fill either",
}
"""Every reason a corpus JSON may be refused for, by the text of its message."""


def sets_for(path: pathlib.Path, log_dir: pathlib.Path) -> list[str]:
    run_dir = log_dir / path.stem
    return [
        f"deepspeed={path}",
        *LAYOUT,
        *BATCH,
        f"log.dir={run_dir}",
        *nvme_paths(path, run_dir / "nvme"),
    ]


def nvme_paths(path: pathlib.Path, directory: pathlib.Path) -> list[str]:
    """The JSON's NVMe offload sections pointed at `directory` (made here), not at the disk its
    authors named."""
    zero = load_json(str(path)).get("zero_optimization")
    keys = [
        k
        for k in ("offload_param", "offload_optimizer")
        if isinstance(zero, dict) and (zero.get(k) or {}).get("device") == "nvme"
    ]
    if keys:
        directory.mkdir(parents=True, exist_ok=True)
    return [f"ds.zero_optimization.{key}.nvme_path={directory}" for key in keys]


def outcome(path: pathlib.Path, log_dir: pathlib.Path) -> tuple[str, list[str]]:
    """("accepted", notes) or ("refused", the reasons by `REFUSED`'s names)."""
    try:
        res = resolve(load(None, sets_for(path, log_dir)), 2)
    except UserError as e:
        reasons = []
        for problem in problems_of(e):
            known = [name for text, name in REFUSED.items() if text in problem]
            reasons.append(known[0] if known else f"UNLISTED: {problem}")
        return "refused", sorted(set(reasons))
    return "accepted", res.ds_notes


@pytest.mark.dist
def test_every_corpus_json_trains_or_is_refused_for_a_listed_reason(tmp_path):
    paths = sorted(CORPUS.glob("*.json"))
    assert len(paths) >= 20
    outcomes = {p.name: outcome(p, tmp_path) for p in paths}
    unlisted = [
        r
        for kind, reasons in outcomes.values()
        if kind == "refused"
        for r in reasons
        if r.startswith("UNLISTED")
    ]
    assert not unlisted, "\n".join(unlisted)
    accepted = [p for p in paths if outcomes[p.name][0] == "accepted"]
    cases = [{"name": p.stem, "sets": sets_for(p, tmp_path), "reference": False} for p in accepted]
    rows = run_cases(tmp_path, 2, cases)
    table = []
    for p in paths:
        kind, detail = outcomes[p.name]
        if kind == "accepted":
            losses = [r["loss"] for r in rows[p.stem]]
            assert len(losses) == 2 and all(math.isfinite(x) for x in losses), p.name
            detail = [
                f"trained: loss {losses[0]:.4f} -> {losses[1]:.4f}",
                f"{len(outcomes[p.name][1])} notes",
            ]
        table.append(f"{p.name:48} {kind:9} {'; '.join(detail)}")
    text = "\n".join(table)
    # comms_logger on: DeepSpeed's summary of its collectives, written where dsnd logs
    summary = json.loads(
        (tmp_path / "deepspeed-docs-comms-logger" / "comms_summary.json").read_text()
    )
    assert summary and all(isinstance(op, str) for op in summary), summary
    (tmp_path / "corpus.txt").write_text(text + "\n")
    print("\n" + text)
    assert len(accepted) >= len(paths) // 2, text
