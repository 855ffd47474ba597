"""``dsnd ckpt inspect | verify | export DIR``: look at, check and convert a saved checkpoint;
``dsnd ckpt import DS_CHECKPOINT_DIR OUT``: make one from a checkpoint DeepSpeed's engine saved.

DIR is a checkpoint root (the step directory its `latest` names) or one step directory (see
`dsnd.checkpoint.files`). No process group starts, and nothing is unpickled: JSON and
safetensors only.

- inspect: what the manifest says (step, samples, layout, model, versions, layer -> stage map)
  and every file with its size and checksum status; `--json` prints it as one object.
- verify: ``ok: <step dir> (<n> files)``, or one line per problem on stderr: the manifest's
  checksum and keys, each file's place (inside the step directory, listed, no symbolic links),
  size and SHA-256, then each tensor file's safetensors header against the manifest and its
  values (NaN or infinity is a problem).
- export: the weights of an intact checkpoint as a transformers directory (`write_hf_dir`): OUT
  new, empty, or an earlier export of the same checkpoint root, which is replaced whole.
- import: what DeepSpeed's `save_checkpoint` wrote (DS_CHECKPOINT_DIR: the directory, meaning
  the tag its `latest` names, or one tag directory; ZeRO 1-3, `PipelineEngine` or plain engine)
  as the dsnd checkpoint root OUT (OUT/step_<step>, OUT/latest), continued by any layout with
  `checkpoint.resume: OUT`. A DeepSpeed checkpoint names parameters and shapes but holds no
  model config, so the model is the run config's, as for `dsnd train`: ``--config RUN_YAML``
  and ``--set`` (e.g. ``--set model.config=DIR/config.json``); give the YAML the run will
  continue with, and its model must fit the checkpoint name by name and shape by shape (see
  `dsnd.checkpoint.import_ds`). The result passes `verify`.

Exit codes: 0 intact, 1 a file is missing or fails a check (inspect and verify still report
everything), 2 a usage error: DIR missing, not a checkpoint or a symbolic link to a step
directory, or, for export and import, any problem at all (the first bad file is named and
nothing is written; import never writes into an existing OUT that is not empty).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from itertools import pairwise

from dsnd.checkpoint import files
from dsnd.checkpoint.files import MANIFEST, MANIFEST_SUM, MODEL_SUFFIX, CheckpointError
from dsnd.checkpoint.members import Problem, member_problem, printable
from dsnd.checkpoint.verify import check_intact, read_manifest, verify

UNCHECKED = "not checked: the manifest failed"


def step_dir_of(path: str) -> str:
    """The step directory DIR means; CheckpointError (exit 2) when there is none."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    return files.resolve_step_dir(path)


def _manifest_as_is(step_dir: str) -> dict:
    """manifest.json without its checksum check (inspect shows a damaged one too); {} if
    unreadable."""
    try:
        with open(os.path.join(step_dir, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def _file_rows(step_dir: str, manifest: dict, problems: list[Problem]) -> list[dict]:
    bad = {p.file: p.what for p in problems}
    manifest_failed = any(p.file in (MANIFEST, MANIFEST_SUM) for p in problems)
    files = _table(manifest, "files")
    rows = []
    for rel in [MANIFEST, MANIFEST_SUM, *sorted(files)]:
        path = os.path.join(step_dir, rel)
        # sizes only of files a load could read (never of a path outside the step directory)
        inside = rel in (MANIFEST, MANIFEST_SUM) or not member_problem(step_dir, files, rel)
        size = os.path.getsize(path) if inside and os.path.isfile(path) else None
        shown = printable(rel)  # as problems name it: one line, whatever the name
        status = bad.get(shown) or (UNCHECKED if manifest_failed else "ok")
        rows.append({"file": shown, "bytes": size, "status": status})
    return rows


def _table(manifest: dict, key: str) -> dict:
    """manifest[key] when it is an object, else {} (inspect shows a malformed manifest too)."""
    value = manifest.get(key)
    return value if isinstance(value, dict) else {}


def _experts(step_dir: str, files: list[dict]) -> list[dict]:
    """Each MoE layer's expert tensors as its model file stores them (name and shape, read from
    the safetensors header of an intact file): what a reshape across expert layouts works on."""
    from safetensors import safe_open

    from dsnd.model.moe_config import EXPERT_WEIGHTS

    out = []
    for row in files:
        if row["status"] != "ok" or not row["file"].endswith(MODEL_SUFFIX):
            continue
        with safe_open(os.path.join(step_dir, row["file"]), framework="pt") as f:
            found = {
                name: list(f.get_slice(name).get_shape())
                for name in f.keys()
                if EXPERT_WEIGHTS.search(name)
            }
        if found:
            out.append({"file": row["file"], "tensors": found})
    return out


def report(step_dir: str) -> dict:
    """Everything `inspect` shows, as plain data."""
    problems = verify(step_dir)
    m = _manifest_as_is(step_dir)
    parts = m.get("parts")
    if not isinstance(parts, list) or not all(isinstance(p, int) for p in parts):
        parts = []
    files = _file_rows(step_dir, m, problems)
    return {
        "step_dir": step_dir,
        "ok": not problems,
        "problems": [str(p) for p in problems],
        "step": m.get("step"),
        "consumed_samples": m.get("consumed_samples"),
        "topology": _table(m, "topology"),
        "zero_stage": m.get("zero_stage"),
        "model": _table(m, "model"),
        "versions": _table(m, "versions"),
        "parts": parts,
        "stages": [[first, last - 1] for first, last in pairwise(parts)],
        "files": files,
        "total_bytes": sum(row["bytes"] or 0 for row in files),
        "experts": _experts(step_dir, files),
    }


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    value, units = float(n), ["B", "KiB", "MiB", "GiB"]
    while value >= 1024 and len(units) > 1:
        value, units = value / 1024, units[1:]
    return f"{n} B" if units[0] == "B" else f"{value:.1f} {units[0]}"


def format_report(r: dict) -> str:
    t, m = r["topology"], r["model"]
    topology = (
        f"pp={t.get('pp')} tp={t.get('tp')} dp={t.get('dp')} (world {t.get('world_size')}), "
        f"ZeRO stage {r['zero_stage']}"
    )
    from dsnd.checkpoint.schema import model_problems
    from dsnd.model.source import from_manifest

    bad = model_problems(m)  # the problems list below says so too; show what can be read
    model = f"{m.get('family')}: {bad[0]}" if bad else from_manifest(m).describe()
    rows = [
        ("step dir", r["step_dir"]),
        ("step", r["step"]),
        ("samples", r["consumed_samples"]),
        ("topology", topology),
        ("model", model),
        ("versions", ", ".join(f"{k} {v}" for k, v in r["versions"].items())),
        *[(f"stage {s}", f"layers {first}-{last}") for s, (first, last) in enumerate(r["stages"])],
    ]
    for layer in r["experts"]:  # a mixture of experts: E experts per layer, stored whole
        shapes = ", ".join(
            f"{name.rsplit('.', 1)[-1]} {shape}" for name, shape in sorted(layer["tensors"].items())
        )
        count = next(iter(layer["tensors"].values()))[0]
        rows.append((f"experts {layer['file'].split('-')[0]}", f"{count} experts: {shapes}"))
    width = max(len(key) for key, _ in rows)
    lines = [f"{key:<{width}}  {value}" for key, value in rows]
    name_width = max(len(row["file"]) for row in r["files"])
    lines.append("files")
    for row in r["files"]:
        lines.append(f"  {row['file']:<{name_width}}  {_size(row['bytes']):>10}  {row['status']}")
    lines.append(f"total  {len(r['files'])} files, {_size(r['total_bytes'])}")
    if not r["ok"]:
        lines.append(f"NOT INTACT: {len(r['problems'])} problem(s)")
    return "\n".join(lines)


def run_inspect(path: str, as_json: bool) -> int:
    r = report(step_dir_of(path))
    print(json.dumps(r, indent=1) if as_json else format_report(r))
    return 0 if r["ok"] else 1


def run_verify(path: str) -> int:
    step_dir = step_dir_of(path)
    problems = verify(step_dir)
    for _ in range(3):  # gone meanwhile: a running job's checkpoint.keep rotated it away
        if not problems or os.path.isdir(step_dir):
            break  # still there: what verify found is damage (a rotation renames it away first)
        if os.path.normpath(step_dir) == os.path.normpath(path):
            raise CheckpointError(
                f"{step_dir}: removed while it was verified (rotated away by "
                "checkpoint.keep?); nothing left to verify"
            )
        print(
            f"dsnd: {step_dir} was removed while it was verified (rotated away by "
            "checkpoint.keep); verifying what latest names now",
            file=sys.stderr,
        )
        step_dir = step_dir_of(path)
        problems = verify(step_dir)
    for p in problems:
        print(f"{os.path.join(step_dir, p.file)}: {p.what}", file=sys.stderr)
    if problems:
        return 1
    count = len(read_manifest(step_dir)["files"]) + 2  # and the manifest's own two
    print(f"ok: {step_dir} ({count} files)")
    return 0


def run_export(path: str, out: str) -> int:
    from dsnd.model.export_dir import ExportOrigin, check_target, replacing
    from dsnd.model.hf_io import write_hf_dir
    from dsnd.model.source import from_manifest

    step_dir = step_dir_of(path)
    check_intact(step_dir)
    manifest = read_manifest(step_dir)
    # the run is the checkpoint root the step directory lies in, as the trainer's export says
    origin = ExportOrigin(os.path.dirname(os.path.abspath(step_dir)), manifest["step"])
    check_target(out, origin, out)  # before reading every tensor
    model = from_manifest(manifest["model"])  # read_manifest checked its keys and types
    from dsnd.checkpoint.load import read_full_model  # torch/DeepSpeed: only for export

    tensors = read_full_model(step_dir, manifest)
    earlier = write_hf_dir(out, model, tensors, model.directory, origin)
    print(
        f"wrote {out}: {model.family.name}, {len(tensors)} tensors from {step_dir}"
        f"{replacing(earlier)}"
    )
    return 0


def run_import(path: str, out: str, config: str | None, sets: list[str]) -> int:
    from dsnd.checkpoint.import_ds import import_deepspeed  # torch/DeepSpeed: only for import
    from dsnd.config.load import load
    from dsnd.config.resolve import run_model

    loaded = load(config, sets)
    model = run_model(loaded.run)
    step_dir, manifest = import_deepspeed(path, out, loaded.run, model)
    t, imported = manifest["topology"], manifest["imported"]
    print(
        f"wrote {step_dir}: step {manifest['step']} of {imported['engine']} "
        f"{imported['tag']} (pp={t['pp']} dp={t['dp']}, ZeRO-{manifest['zero_stage']}), "
        f"{len(manifest['params'])} parameters of {model.describe()}; continue it with "
        f"checkpoint.resume={out}"
    )
    return 0


def run_ckpt(args: argparse.Namespace) -> int:
    if args.ckpt_command == "import":
        return run_import(args.dir, args.out, args.config, args.sets)
    if args.ckpt_command == "inspect":
        return run_inspect(args.dir, args.json)
    if args.ckpt_command == "verify":
        return run_verify(args.dir)
    return run_export(args.dir, args.out)
