"""`dsnd ckpt inspect | verify | export` on real checkpoints, built here without training.

A fixture writes what a save writes (per-layer safetensors of a seeded `build_model` and its
optimizer state, an RNG file, a manifest through `commit.write_manifest`, a root with `latest`);
then every file in turn is damaged and each command must say which, with exact exit codes. The
export must load in `transformers` and give the dsnd model's logits.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from dsnd import cli
from dsnd.checkpoint.commit import write_manifest
from dsnd.checkpoint.files import FORMAT, model_file, optim_file, rng_file, step_dir_name
from dsnd.model.export_dir import EXPORT_MARKER
from dsnd.model.stack import build_model
from tests.models import spec_of

STEP = 10
PRESET_NAMES = ("llama-tiny", "gpt2-tiny")
MODEL_1, OPTIM_1, RNG_0 = model_file(1), optim_file(1), rng_file(0)
FILES = [MODEL_1, OPTIM_1, RNG_0, "manifest.json", "manifest.sha256"]
KEYS = ("exp_avg", "exp_avg_sq")
# what checkpoints written before model configs were recorded hold: the shape only
LEGACY_MODEL = {
    "llama-tiny": {
        "family": "llama",
        "hidden_size": 64,
        "num_layers": 4,
        "num_heads": 4,
        "num_kv_heads": 2,
        "ffn_size": 176,
        "vocab_size": 256,
        "max_seq_len": 128,
        "tie_embeddings": False,
        "init_std": 0.02,
    },
    "gpt2-tiny": {
        "family": "gpt2",
        "hidden_size": 64,
        "num_layers": 4,
        "num_heads": 4,
        "num_kv_heads": 4,
        "ffn_size": 256,
        "vocab_size": 256,
        "max_seq_len": 128,
        "tie_embeddings": True,
        "init_std": 0.02,
    },
}


def _layer_of(name: str) -> int:
    return 0 if name.startswith("tied_modules.embed.") else int(name.split(".")[1])


def write_checkpoint(root: str, preset: str) -> str:
    """A committed checkpoint of `build_model(spec_of(preset), seed=3)` under `root`."""
    dims = spec_of(preset)
    step_dir = os.path.join(root, step_dir_name(STEP))
    os.makedirs(os.path.join(step_dir, "rng"))
    by_layer: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in build_model(dims, seed=3).state_dict().items():
        by_layer.setdefault(_layer_of(name), {})[name] = tensor.contiguous()
    files, params = [], {}
    for layer, tensors in sorted(by_layer.items()):
        save_file(tensors, os.path.join(step_dir, model_file(layer)))
        optim = {f"{n}.{k}": torch.full_like(t, 0.5) for n, t in tensors.items() for k in KEYS}
        save_file(optim, os.path.join(step_dir, optim_file(layer)))
        files += [model_file(layer), optim_file(layer)]
        params |= {
            n: {"file": model_file(layer), "shape": list(t.shape), "dtype": "F32"}
            for n, t in tensors.items()
        }
    with open(os.path.join(step_dir, RNG_0), "w", encoding="utf-8") as f:
        json.dump({"python": [3, [1, 2, 3], None], "torch": [0, 1, 2], "numpy": None}, f)
    n = dims.num_layers + 3
    manifest = {
        "format": FORMAT,
        "step": STEP,
        "consumed_samples": 160,
        "topology": {"pp": 2, "tp": 1, "dp": 2, "world_size": 4},
        "zero_stage": 3,
        "parts": [0, 3, n],
        "model": dims.manifest(),
        "versions": {"dsnd": "0.0-test", "torch": torch.__version__},
        "config": {"run": {}, "deepspeed": {}},
        "corpus": {"name": "t", "tokens": 1, "sha256": ""},
        "trainer": {"optimizer_step": STEP, "lr": 1e-3, "lr_scheduler": None, "betas": [0.9, 0.95]},
        "params": params,
        "optim_keys": list(KEYS),
    }
    write_manifest(step_dir, manifest, [*files, RNG_0])
    with open(os.path.join(root, "latest"), "w", encoding="utf-8") as f:
        f.write(step_dir_name(STEP) + "\n")
    return step_dir


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict[str, str]:
    """preset -> checkpoint root (never modified; tests damage copies)."""
    roots = {}
    for preset in PRESET_NAMES:
        roots[preset] = str(tmp_path_factory.mktemp(preset) / "ckpt")
        write_checkpoint(roots[preset], preset)
    return roots


@pytest.fixture
def ckpt(pristine, tmp_path) -> tuple[str, str]:
    """(root, step dir): a private copy of the llama-tiny checkpoint."""
    root = str(tmp_path / "ckpt")
    shutil.copytree(pristine["llama-tiny"], root)
    return root, os.path.join(root, step_dir_name(STEP))


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def flip_byte(path: str, mask: int = 0x01) -> None:
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= mask
        f.seek(0)
        f.write(data)


def test_verify_ok_on_root_and_step_dir(capsys, ckpt, pristine):
    root, step_dir = ckpt
    for where in (root, step_dir):
        rc, out, err = run(capsys, "ckpt", "verify", where)
        assert (rc, err) == (0, "")
        # 7 layers (embedding, 4 blocks, norm, head) x (model, optim) + rng + the manifest's two
        assert out == f"ok: {step_dir} (17 files)\n"
    gpt2 = pristine["gpt2-tiny"]  # tied: the head's layer holds no tensor, so no files
    rc, out, _ = run(capsys, "ckpt", "verify", gpt2)
    assert (rc, out) == (0, f"ok: {os.path.join(gpt2, step_dir_name(STEP))} (15 files)\n")


@pytest.mark.parametrize("file", FILES)
def test_verify_names_each_damaged_file(capsys, ckpt, file):
    _, step_dir = ckpt
    flip_byte(os.path.join(step_dir, file))
    rc, out, err = run(capsys, "ckpt", "verify", step_dir)
    assert (rc, out) == (1, "")
    assert err.count("\n") == 1, err
    if file == "manifest.sha256":  # the pair no longer matches: named from manifest.json's side
        assert err.startswith(f"{step_dir}/manifest.json: SHA-256 "), err
        assert "does not match manifest.sha256" in err
    elif file == "manifest.json":
        assert err.startswith(f"{step_dir}/manifest.json: SHA-256 "), err
    else:
        assert err == f"{step_dir}/{file}: SHA-256 does not match the manifest (corrupt)\n"


def test_verify_non_utf8_damage_to_manifest_sha256(capsys, ckpt):
    _, step_dir = ckpt
    flip_byte(os.path.join(step_dir, "manifest.sha256"), mask=0xFF)
    rc, _, err = run(capsys, "ckpt", "verify", step_dir)
    assert rc == 1
    assert err.startswith(f"{step_dir}/manifest.json: SHA-256 "), err


def test_verify_detects_a_damaged_newline_in_manifest_sha256(capsys, ckpt):
    _, step_dir = ckpt
    path = os.path.join(step_dir, "manifest.sha256")
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x0b")
    rc, _, err = run(capsys, "ckpt", "verify", step_dir)
    assert rc == 1
    assert err.startswith(f"{step_dir}/manifest.json: SHA-256 "), err


def test_verify_reports_every_problem_and_missing_files(capsys, ckpt):
    root, step_dir = ckpt
    os.remove(os.path.join(step_dir, model_file(3)))
    flip_byte(os.path.join(step_dir, RNG_0))
    rc, out, err = run(capsys, "ckpt", "verify", root)
    assert (rc, out) == (1, "")
    assert err.splitlines() == [
        f"{step_dir}/{model_file(3)}: missing",
        f"{step_dir}/{RNG_0}: SHA-256 does not match the manifest (corrupt)",
    ]


def test_verify_truncated_file_gives_sizes(capsys, ckpt):
    _, step_dir = ckpt
    path = os.path.join(step_dir, OPTIM_1)
    size = os.path.getsize(path)
    os.truncate(path, size - 8)
    rc, _, err = run(capsys, "ckpt", "verify", step_dir)
    assert rc == 1
    assert err == f"{path}: {size - 8} bytes, the manifest says {size}\n"


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_not_a_checkpoint_is_a_usage_error(capsys, tmp_path, command):
    missing = str(tmp_path / "nope")
    rc, out, err = run(capsys, "ckpt", command, missing)
    assert (rc, out) == (2, "")
    assert err == f"dsnd: error: {missing}: no such checkpoint directory\n"
    rc, out, err = run(capsys, "ckpt", command, str(tmp_path))  # a directory, no `latest`
    assert (rc, out) == (2, "")
    assert err == (f"dsnd: error: {tmp_path}: neither a step directory nor a root with 'latest'\n")


def test_latest_naming_a_missing_step_is_a_usage_error(capsys, ckpt):
    root, step_dir = ckpt
    shutil.rmtree(step_dir)
    rc, out, err = run(capsys, "ckpt", "verify", root)
    assert (rc, out) == (2, "")
    name = os.path.basename(step_dir)
    assert err == f"dsnd: error: {root}/latest names {name}, which is missing\n"


def test_inspect_summary(capsys, ckpt):
    root, step_dir = ckpt
    rc, out, err = run(capsys, "ckpt", "inspect", root)
    assert (rc, err) == (0, "")
    lines = out.splitlines()
    assert lines[:8] == [
        f"step dir  {step_dir}",
        "step      10",
        "samples   160",
        "topology  pp=2 tp=1 dp=2 (world 4), ZeRO stage 3",
        "model     llama (preset llama-tiny): hidden 64, 4 layers, 4 heads (2 kv), vocab 256",
        f"versions  dsnd 0.0-test, torch {torch.__version__}",
        "stage 0   layers 0-2",
        "stage 1   layers 3-6",
    ]
    assert lines[8] == "files"
    rows = {line.split()[0]: line.split() for line in lines[9:-1]}
    assert len(rows) == 17
    embed = os.path.getsize(os.path.join(step_dir, model_file(0)))  # 256 x 64 fp32 + header
    assert rows[model_file(0)][1:] == [f"{embed / 1024:.1f}", "KiB", "ok"]
    assert all(row[-1] == "ok" for row in rows.values())
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(step_dir) for f in fs)
    assert lines[-1] == f"total  17 files, {total / 2**20:.1f} MiB"


def test_inspect_json(capsys, ckpt):
    _, step_dir = ckpt
    rc, out, _ = run(capsys, "ckpt", "inspect", "--json", step_dir)
    assert rc == 0
    r = json.loads(out)
    assert (r["ok"], r["problems"], r["step"], r["consumed_samples"]) == (True, [], 10, 160)
    assert r["topology"] == {"pp": 2, "tp": 1, "dp": 2, "world_size": 4}
    assert (r["zero_stage"], r["stages"]) == (3, [[0, 2], [3, 6]])
    assert r["model"] == json.loads(json.dumps(spec_of("llama-tiny").manifest()))  # as written
    files = {row["file"]: row for row in r["files"]}
    assert files[RNG_0] == {
        "file": RNG_0,
        "bytes": os.path.getsize(os.path.join(step_dir, RNG_0)),
        "status": "ok",
    }
    assert r["total_bytes"] == sum(row["bytes"] for row in r["files"])


def test_inspect_marks_the_damaged_file(capsys, ckpt):
    _, step_dir = ckpt
    flip_byte(os.path.join(step_dir, model_file(2)))
    os.remove(os.path.join(step_dir, RNG_0))
    rc, out, err = run(capsys, "ckpt", "inspect", step_dir)
    assert (rc, err) == (1, "")
    status = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert status[model_file(2)].endswith("  SHA-256 does not match the manifest (corrupt)")
    assert status[RNG_0].split()[1:] == ["-", "missing"]
    assert status[model_file(1)].endswith("  ok")
    assert out.splitlines()[1] == "step      10"  # the summary is still printed
    assert out.endswith("NOT INTACT: 2 problem(s)\n")
    rc, out, _ = run(capsys, "ckpt", "inspect", "--json", step_dir)
    r = json.loads(out)
    assert (rc, r["ok"]) == (1, False)
    assert r["problems"] == [
        f"{model_file(2)}: SHA-256 does not match the manifest (corrupt)",
        f"{RNG_0}: missing",
    ]


def test_inspect_damaged_manifest_shows_it_unchecked(capsys, ckpt):
    _, step_dir = ckpt
    flip_byte(os.path.join(step_dir, "manifest.sha256"))
    rc, out, _ = run(capsys, "ckpt", "inspect", "--json", step_dir)
    r = json.loads(out)
    assert (rc, r["ok"], r["step"]) == (1, False, 10)
    files = {row["file"]: row["status"] for row in r["files"]}
    assert files["manifest.json"].startswith("SHA-256 ")
    assert files[model_file(0)] == "not checked: the manifest failed"


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_export_loads_in_transformers_with_the_same_logits(capsys, pristine, tmp_path, preset):
    out_dir = str(tmp_path / "hf")
    rc, out, err = run(capsys, "ckpt", "export", pristine[preset], out_dir)
    assert (rc, err) == (0, "")
    step_dir = os.path.join(pristine[preset], step_dir_name(STEP))
    count = len(build_model(spec_of(preset), seed=3).state_dict())
    family = spec_of(preset).family.name
    assert out == f"wrote {out_dir}: {family}, {count} tensors from {step_dir}\n"
    assert sorted(os.listdir(out_dir)) == ["config.json", EXPORT_MARKER, "model.safetensors"]
    with open(os.path.join(out_dir, EXPORT_MARKER), encoding="utf-8") as f:
        marker = json.load(f)
    assert marker == {
        "format": "dsnd-export/1",
        "checkpoint_root": pristine[preset],
        "step": STEP,
        "files": ["config.json", "model.safetensors"],
    }
    hf, info = AutoModelForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
    want = _logits(build_model(spec_of(preset), seed=3).eval(), tokens)
    got = _logits(hf.eval(), tokens)
    assert got.shape == want.shape == (2, 24, 256)
    assert (got - want).abs().max().item() < 1e-5
    assert want.abs().max().item() > 1e-3  # not a trivially zero model


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_a_checkpoint_from_before_model_configs_is_the_same_model(
    capsys, pristine, tmp_path, preset
):
    """Checkpoints written before manifests recorded the model's config hold only its shape
    (the old presets' fields): inspect, export and generate see the same model as today's."""
    root = str(tmp_path / "old")
    shutil.copytree(pristine[preset], root)
    step_dir = os.path.join(root, step_dir_name(STEP))
    with open(os.path.join(step_dir, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    files = sorted(manifest.pop("files"))
    manifest["model"] = LEGACY_MODEL[preset]
    write_manifest(step_dir, manifest, files)
    rc, out, _ = run(capsys, "ckpt", "verify", root)
    assert (rc, out) == (0, f"ok: {step_dir} ({len(files) + 2} files)\n")
    rc, out, err = run(capsys, "ckpt", "inspect", root)
    assert (rc, err) == (0, "")
    assert out.splitlines()[4] == f"model     {spec_of(preset).describe()}"
    exports = {}
    for name, where in (("old", root), ("new", pristine[preset])):
        exports[name] = str(tmp_path / f"hf-{name}")
        rc, _, err = run(capsys, "ckpt", "export", where, exports[name])
        assert (rc, err) == (0, "")
    for file in ("config.json", "model.safetensors"):
        with (
            open(os.path.join(exports["old"], file), "rb") as old,
            open(os.path.join(exports["new"], file), "rb") as new,
        ):
            assert old.read() == new.read(), file
    args = ("--prompt", "def main(", "--tokens", "8", "--seed", "5")
    assert run(capsys, "generate", root, *args) == run(capsys, "generate", pristine[preset], *args)


def test_export_of_a_damaged_checkpoint_writes_nothing(capsys, ckpt, tmp_path):
    root, step_dir = ckpt
    flip_byte(os.path.join(step_dir, model_file(4)))
    out_dir = tmp_path / "hf"
    rc, out, err = run(capsys, "ckpt", "export", root, str(out_dir))
    assert (rc, out) == (2, "")
    assert err == (
        f"dsnd: error: {step_dir}/{model_file(4)}: SHA-256 does not match the manifest (corrupt)\n"
    )
    assert not out_dir.exists()


def test_export_refuses_a_non_empty_output(capsys, ckpt, tmp_path):
    root, _ = ckpt
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    rc, out, err = run(capsys, "ckpt", "export", root, str(tmp_path / "hf"))
    assert (rc, out) == (2, "")
    assert err == (
        f"dsnd: error: {tmp_path / 'hf'}: holds keep.txt and no {EXPORT_MARKER}, so it "
        "is not an export dsnd wrote; name a new or empty directory (dsnd replaces "
        "only its own earlier export of the same run)\n"
    )
    assert os.listdir(tmp_path / "hf") == ["keep.txt"]


def _contents(path) -> dict[str, bytes]:
    return {name: (path / name).read_bytes() for name in sorted(os.listdir(path))}


def test_export_replaces_its_own_earlier_export_whole(capsys, pristine, tmp_path):
    """An export of the same run (checkpoint root) into its earlier export replaces the whole
    directory: afterwards it holds exactly what an export into a new directory holds, and
    nothing is left beside it."""
    root = tmp_path / "run"
    shutil.copytree(pristine["llama-tiny"], root)
    hf = tmp_path / "hf"
    assert run(capsys, "ckpt", "export", str(root), str(hf))[0] == 0
    assert sorted(os.listdir(hf)) == ["config.json", EXPORT_MARKER, "model.safetensors"]
    shutil.rmtree(root)  # the run went on: its root now holds another model's weights
    shutil.copytree(pristine["gpt2-tiny"], root)
    rc, out, err = run(capsys, "ckpt", "export", str(root), str(hf))
    assert (rc, err) == (0, ""), err
    assert out.endswith(
        f"from {root / step_dir_name(STEP)} (replacing the export of step {STEP} there)\n"
    )
    fresh = tmp_path / "fresh"
    assert run(capsys, "ckpt", "export", str(root), str(fresh))[0] == 0
    assert _contents(hf) == _contents(fresh)  # nothing of the llama export is left
    assert sorted(os.listdir(tmp_path)) == ["fresh", "hf", "run"]


def test_export_refuses_another_runs_export_and_files_it_did_not_write(capsys, pristine, tmp_path):
    hf = tmp_path / "hf"
    assert run(capsys, "ckpt", "export", pristine["llama-tiny"], str(hf))[0] == 0
    before = _contents(hf)
    rc, out, err = run(capsys, "ckpt", "export", pristine["gpt2-tiny"], str(hf))
    assert (rc, out) == (2, "")
    assert err == (
        f"dsnd: error: {hf}: holds dsnd's export of another run (checkpoint root "
        f"{pristine['llama-tiny']}, step {STEP}); this run's is "
        f"{pristine['gpt2-tiny']}: name another directory, or remove that "
        "export\n"
    )
    (hf / "notes.txt").write_text("mine")
    rc, out, err = run(capsys, "ckpt", "export", pristine["llama-tiny"], str(hf))
    assert (rc, out) == (2, "")
    assert err == (
        f"dsnd: error: {hf}: holds notes.txt, which dsnd's export there did not "
        "write (replacing the export would delete it); move it away or name another "
        "directory\n"
    )
    assert _contents(hf) == before | {"notes.txt": b"mine"}


def test_an_export_that_fails_midway_leaves_the_earlier_one_whole(pristine, tmp_path):
    """safetensors refuses tensors sharing memory while writing, after config.json was written:
    the earlier export stays as it was, and no partial directory is left beside it."""
    from dsnd.model.hf_io import ExportOrigin, write_hf_dir

    spec, origin = spec_of("llama-tiny"), ExportOrigin(pristine["llama-tiny"], STEP)
    hf = tmp_path / "hf"
    tensors = build_model(spec, seed=3).state_dict()
    write_hf_dir(str(hf), spec, tensors, origin=origin)
    before = _contents(hf)
    shared = dict(tensors, **{"layers.6.lm_head.weight": tensors["layers.0.embed_tokens.weight"]})
    with pytest.raises(RuntimeError, match="share memory"):
        write_hf_dir(str(hf), spec, shared, origin=origin)
    assert _contents(hf) == before
    assert os.listdir(tmp_path) == ["hf"]


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_generate_samples_from_the_checkpointed_weights(capsys, pristine, preset):
    """`dsnd generate` continues the prompt exactly as the model the checkpoint was written from
    (seeded sampling at temperature 1 depends on every logit); seed 4's weights differ."""
    from dsnd.commands.generate import generate
    from dsnd.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    prompt = torch.as_tensor(tok.encode("def main("), dtype=torch.long).view(1, -1)
    args = (
        "generate",
        pristine[preset],
        "--prompt",
        "def main(",
        "--tokens",
        "24",
        "--temperature",
        "1.0",
        "--seed",
        "5",
    )
    rc, out, _ = run(capsys, *args)
    assert rc == 0
    texts = {}
    for seed in (3, 4):
        model = build_model(spec_of(preset), seed=seed).eval()
        ids = generate(
            model, prompt, 24, spec_of(preset).max_seq_len, 1.0, torch.Generator().manual_seed(5)
        )
        texts[seed] = tok.decode(ids[0].tolist()) + "\n"
    assert out == texts[3] and out.startswith("def main(")
    assert texts[4] != texts[3]


# --- `dsnd ckpt import`: refusals, before anything is written (the conversion itself is
# tests/distributed/test_ckpt_import.py, on checkpoints DeepSpeed's engines wrote) ---


def _ds_tag(root, **state) -> str:
    """A tag directory as a ZeRO-1/2 DeepSpeedEngine writes it, holding `state` in its model-state
    file (default: llama-tiny's parameter shapes at step 3; keys as DeepSpeed names them)."""
    from collections import OrderedDict

    from dsnd.model.count import full_shapes

    tag = root / "global_step3"
    tag.mkdir(parents=True)
    shapes = OrderedDict((n, torch.Size(s)) for n, s in full_shapes(spec_of("llama-tiny")).items())
    torch.save(
        {
            "param_shapes": [shapes],
            "global_steps": 3,
            "lr_scheduler": None,
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
            **state,
        },
        tag / "mp_rank_00_model_states.pt",
    )
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"not read before the checks")
    (root / "latest").write_text("global_step3")
    return str(tag)


def _import_refused(capsys, tmp_path, source: str, *sets: str, out=None) -> str:
    """`dsnd ckpt import` exits 2 with one line and writes nothing beside the checkpoint."""
    out = str(out or tmp_path / "out")
    before = sorted(os.listdir(tmp_path))
    rc, said, err = run(capsys, "ckpt", "import", source, out, *[f"--set={s}" for s in sets])
    assert (rc, said) == (2, "") and err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path)) == before
    return err.removeprefix("dsnd: error: ").removesuffix("\n")


def test_import_refuses_what_is_not_a_zero_checkpoint(capsys, tmp_path):
    assert (
        _import_refused(capsys, tmp_path, str(tmp_path / "none"))
        == f"{tmp_path / 'none'}: no such directory"
    )
    (tmp_path / "empty").mkdir()
    assert _import_refused(capsys, tmp_path, str(tmp_path / "empty")).endswith(
        "empty: not a DeepSpeed checkpoint (no *_model_states.pt, and no 'latest' naming a tag "
        "directory)"
    )
    (tmp_path / "empty" / "latest").write_text("global_step9\n")
    assert _import_refused(capsys, tmp_path, str(tmp_path / "empty")).endswith(
        "latest: names 'global_step9', which is not a tag directory holding *_model_states.pt"
    )
    tag = _ds_tag(tmp_path / "ds")
    os.remove(os.path.join(tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    assert _import_refused(capsys, tmp_path, str(tmp_path / "ds")) == (
        f"{tag}: no ZeRO optimizer files (*_optim_states.pt): saved without ZeRO; DeepSpeed's "
        "universal-checkpoint conversion needs ZeRO stage 1, 2 or 3"
    )


def test_import_loads_weights_only(capsys, tmp_path):
    """A pickled class outside the allow-list (Megatron-DeepSpeed saves its `args` so) is
    refused by torch before it is built; damaged bytes are one line too."""
    import argparse

    tag = _ds_tag(tmp_path / "ds", args=argparse.Namespace(seed=1))
    err = _import_refused(capsys, tmp_path, tag)
    assert err == (
        f"{tag}/mp_rank_00_model_states.pt: holds a pickled argparse.Namespace; dsnd loads "
        "DeepSpeed checkpoints with torch.load(weights_only=True), allowing only tensors and "
        "deepspeed.runtime.fp16.loss_scaler.LossScaler, deepspeed.runtime.zero.config."
        "ZeroStageEnum, deepspeed.utils.tensor_fragment.fragment_address"
    )
    with open(os.path.join(tag, "mp_rank_00_model_states.pt"), "r+b") as f:
        f.truncate(100)
    err = _import_refused(capsys, tmp_path, tag)
    assert re.fullmatch(
        r".*/mp_rank_00_model_states\.pt: not readable by torch\.load "
        r"\(RuntimeError: .*\)",
        err,
    )


def test_the_allow_list_holds_what_deepspeed_pickles_and_nothing_more(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from dsnd.engine import ds_checkpoint

    saved = {
        "loss_scaler": LossScaler(1.0),
        "zero_stage": ZeroStageEnum.gradients,
        "mappings": [{"w": fragment_address(numel=4, start=0)}],
    }
    torch.save(saved, tmp_path / "ok.pt")
    back = ds_checkpoint.load(str(tmp_path / "ok.pt"))
    assert back["zero_stage"] == ZeroStageEnum.gradients and back["mappings"] == saved["mappings"]
    # fp16's dynamic scaler: no fp16 checkpoint was measured here, so it stays refused
    torch.save(
        {"loss_scaler": DynamicLossScaler(2.0**16, 1000, 1.0, 2, False)}, tmp_path / "dynamic.pt"
    )
    with pytest.raises(Exception) as e:
        ds_checkpoint.load(str(tmp_path / "dynamic.pt"))
    assert (
        ds_checkpoint.refused_global(e.value)
        == "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"
    )
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ  # restored after each load


@pytest.mark.parametrize(
    ("state", "want"),
    [
        (
            {"checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 2}},
            "saved with tensor parallelism (tp_degree 2); dsnd imports DeepSpeed checkpoints "
            "without it",
        ),
        (
            {"frozen_param_shapes": {"layers.0.embed_tokens.weight": torch.Size([256, 64])}},
            "holds 1 frozen parameter(s) (layers.0.embed_tokens.weight, ...); dsnd trains every "
            "parameter",
        ),
        ({"global_steps": None}, "no 'global_steps' (not written by DeepSpeed's save_checkpoint)"),
        (
            {"lr_scheduler": {"last_epoch": 3, "_step_count": 4}},
            "the LR scheduler's state (_step_count, last_epoch) is not one of DeepSpeed's "
            "schedulers",
        ),
    ],
)
def test_import_refuses_what_dsnd_cannot_continue(capsys, tmp_path, state, want):
    _ds_tag(tmp_path / "ds", **state)
    assert want in _import_refused(capsys, tmp_path, str(tmp_path / "ds"))


STEP_RANGE = "expected an integer in [0, 99999999] (a step directory's name holds 8 digits)"


@pytest.mark.parametrize(
    ("state", "want"),
    [
        ({"global_steps": True}, f"'global_steps' is True, {STEP_RANGE}"),
        ({"global_steps": -3}, f"'global_steps' is -3, {STEP_RANGE}"),
        ({"global_steps": 10**12}, f"'global_steps' is 1000000000000, {STEP_RANGE}"),
        (
            {"global_samples": -48},
            "'global_samples' is -48, expected null or a non-negative integer",
        ),
        (
            {"lr_scheduler": {"last_batch_iteration": -(10**9)}},
            "'lr_scheduler.last_batch_iteration' is -1000000000, expected an integer in "
            "[-1, 99999999]",
        ),
        (
            {"lr_scheduler": {"last_batch_iteration": 2.5}},
            "'lr_scheduler.last_batch_iteration' is 2.5, expected an integer in [-1, 99999999]",
        ),
    ],
)
def test_import_refuses_trainer_numbers_dsnd_cannot_resume(capsys, tmp_path, state, want):
    """Blamed on the DeepSpeed file and key they come from (not on the manifest dsnd would
    have written from them), before anything is written."""
    tag = _ds_tag(tmp_path / "ds", **state)
    assert _import_refused(capsys, tmp_path, tag) == f"{tag}/mp_rank_00_model_states.pt: {want}"


def test_import_refuses_another_model_and_an_existing_out(capsys, tmp_path):
    tag = _ds_tag(tmp_path / "ds")
    assert _import_refused(capsys, tmp_path, tag, "model.preset=gpt2-tiny") == (
        f"{tag}: parameter layers.0.embed_tokens.weight is not one of preset gpt2-tiny's (gpt2 "
        "(preset gpt2-tiny): hidden 64, 4 layers, 4 heads (4 kv), vocab 256)"
    )
    assert _import_refused(capsys, tmp_path, tag, "model.ffn_size=128") == (
        f"{tag}: layers.1.mlp.down_proj.weight has shape [64, 176], preset llama-tiny's "
        "layers.1.mlp.down_proj.weight has [64, 128]"
    )
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert _import_refused(capsys, tmp_path, tag, out=tmp_path / "out") == (
        f"{tmp_path / 'out'}: already exists and is not an empty directory (dsnd never writes "
        "over a checkpoint; name a new OUT)"
    )
    assert os.listdir(tmp_path / "out") == ["keep.txt"]
