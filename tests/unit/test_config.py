"""The config layer in-process: YAML, DeepSpeed JSON and --set; strict checks, batch math, lr.

No processes start here. Every error is a `UserError` whose text is asserted concretely: the file,
line, key and numbers a user needs to fix the input.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shlex

import pytest

from dsnd.config import deepspeed_json, strict
from dsnd.config.batch import Batch, resolve_batch
from dsnd.config.load import default_config_path, load, parse_set
from dsnd.config.resolve import resolve
from dsnd.config.schema import RunConfig
from dsnd.errors import UserError
from dsnd.model.source import presets

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ZERO0 = os.path.join(ROOT, "ds_configs", "zero0.json")
# the packaged default YAML names its own zero0.json (a link to ds_configs/zero0.json)
PACKAGED_DS = os.path.join(os.path.dirname(default_config_path()), "zero0.json")


@pytest.fixture(autouse=True)
def _cpu_accelerator(monkeypatch):
    # DeepSpeed's config classes are imported lazily by the checks; name the accelerator so its
    # auto-detection neither warns nor depends on the machine
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


def error(fn, *args, **kwargs) -> str:
    """The UserError message `fn(*args)` raises (fails the test if it raises nothing)."""
    with pytest.raises(UserError) as e:
        fn(*args, **kwargs)
    message = str(e.value)
    assert "\n" not in message
    return message


def write_run(tmp_path, yaml_text: str, ds: dict | None = None, ds_name: str = "ds.json") -> str:
    """A run YAML in tmp_path (and its DeepSpeed JSON, by default a copy of zero0.json)."""
    if ds is None:
        with open(ZERO0) as f:
            ds = json.load(f)
    (tmp_path / ds_name).write_text(json.dumps(ds, indent=2))
    path = tmp_path / "run.yaml"
    path.write_text(yaml_text)
    return str(path)


def zero0(**changes) -> dict:
    with open(ZERO0) as f:
        ds = json.load(f)
    ds.update(changes)
    return ds


# ---- defaults ------------------------------------------------------------------------------------


def test_packaged_default_is_llama_tiny_zero0_batch_16_micro_2():
    loaded = load(None)
    assert loaded.yaml_path == default_config_path()
    assert loaded.ds_path == PACKAGED_DS
    run = loaded.run
    # no model named: llama-tiny, and model.config or model.init_from may name another one
    assert (run.model.config, run.model.preset, run.parallel.pp, run.parallel.tp) == (
        None,
        None,
        1,
        1,
    )
    assert resolve(loaded, 1).model.source == "preset llama-tiny"
    assert resolve(load(None, ["model.config=gpt2-tiny"]), 1).model.source == "preset gpt2-tiny"
    assert loaded.ds["zero_optimization"]["stage"] == 0
    assert loaded.ds["train_batch_size"] == 16
    assert loaded.ds["train_micro_batch_size_per_gpu"] == 2
    assert "gradient_accumulation_steps" not in loaded.ds  # derived by resolve, not stored
    with open(ZERO0) as f:
        assert loaded.ds == json.load(f)


def test_packaged_yaml_matches_the_schema_defaults():
    assert load(None).run == RunConfig()


@pytest.mark.parametrize("world, gas", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_default_resolves_for_data_parallel_worlds(world, gas):
    res = resolve(load(None), world)
    assert res.batch == Batch(16, 2, gas)
    assert (res.topology.pp, res.topology.dp, res.topology.tp) == (1, world, 1)
    assert res.ds["train_batch_size"] == 16
    assert res.ds["train_micro_batch_size_per_gpu"] == 2
    assert res.ds["gradient_accumulation_steps"] == gas
    assert (res.model.hidden_size, res.model.num_heads, res.model.num_kv_heads) == (64, 4, 2)


def test_default_does_not_divide_over_16_ranks():
    # 16 ranks x micro 2 = 32 > train_batch_size 16
    msg = error(resolve, load(None), 16)
    assert msg == (
        f"{PACKAGED_DS}: cannot derive gradient_accumulation_steps: train_batch_size=16 / "
        "(train_micro_batch_size_per_gpu=2 * dp=16) does not divide exactly"
    )


REQUIRED = {
    "parallel.pp": ("2", 2),
    "parallel.tp": ("2", 2),
    "train.steps": ("7", 7),
    "train.seed": ("99", 99),
    "model.preset": ("gpt2-tiny", "gpt2-tiny"),
    "log.dir": ("/tmp/some/run", "/tmp/some/run"),
    "checkpoint.dir": ("ckpts", "ckpts"),
    "checkpoint.every": ("5", 5),
    "dist.timeout_s": ("12.5", 12.5),
    "train.lr_scaling": ("sqrt", "sqrt"),
    "train.lr_reference_batch": ("64", 64),
}


def test_every_required_key_is_in_the_schema_with_a_doc():
    keys = strict.schema_keys(RunConfig)
    assert set(REQUIRED) <= set(keys)
    assert "deepspeed" in keys
    for section in dataclasses.fields(RunConfig):
        assert section.metadata.get("doc"), section.name
        if dataclasses.is_dataclass(section.default_factory):
            for f in dataclasses.fields(section.default_factory):
                assert f.metadata.get("doc"), f"{section.name}.{f.name}"


@pytest.mark.parametrize("key", sorted(REQUIRED))
def test_every_required_key_can_be_set(key):
    text, expected = REQUIRED[key]
    run = load(None, [f"{key}={text}"]).run
    section, name = key.split(".")
    value = getattr(getattr(run, section), name)
    assert value == expected
    assert type(value) is type(expected)


# ---- --set parsing and coercion ------------------------------------------------------------------


@pytest.mark.parametrize(
    "item, key, value",
    [
        ("a.b=1", "a.b", 1),
        ("a=1.5", "a", 1.5),
        ("a=abc", "a", "abc"),
        ("a=null", "a", None),
        ("a=true", "a", True),
        ('a="7"', "a", "7"),
        ('a={"x": [1, 2]}', "a", {"x": [1, 2]}),
        ("a=", "a", ""),
        ("a=b=c", "a", "b=c"),
        (" a =2", "a", 2),
    ],
)
def test_parse_set(item, key, value):
    assert parse_set(item) == (key, value)


@pytest.mark.parametrize("item", ["noequals", "=3", " =3"])
def test_parse_set_needs_key_and_equals(item):
    assert error(parse_set, item) == f"--set {item}: expected KEY=VALUE".replace("  ", " ")


def test_set_coerces_int_to_float():
    run = load(None, ["dist.timeout_s=10"]).run
    assert run.dist.timeout_s == 10.0 and type(run.dist.timeout_s) is float


@pytest.mark.parametrize(
    "text, expected", [("2024", "2024"), ("1e3", "1e3"), ("1.50", "1.50"), ("true", "true")]
)
def test_set_takes_numbers_for_strings_as_written(text, expected):
    assert load(None, [f"log.dir={text}"]).run.log.dir == expected
    assert load(None, [f"checkpoint.dir={text}"]).run.checkpoint.dir == expected


def test_set_null_for_an_optional_field():
    loaded = load(None, ["model.hidden_size=null", "data.path=null"])
    assert loaded.run.model.hidden_size is None and loaded.run.data.path is None
    assert resolve(loaded, 1).model.hidden_size == 64  # the preset's


def test_set_optional_int_field():
    loaded = load(None, ["model.hidden_size=128", "model.num_heads=8", "model.num_kv_heads=4"])
    model = resolve(loaded, 1).model
    assert (model.hidden_size, model.num_heads, model.num_kv_heads) == (128, 8, 4)


@pytest.mark.parametrize(
    "item, message",
    [
        ("train.steps=abc", "--set train.steps=abc: train.steps must be an int, got str 'abc'"),
        ("train.steps=1.5", "--set train.steps=1.5: train.steps must be an int, got float 1.5"),
        ("train.steps=true", "--set train.steps=true: train.steps must be an int, got bool True"),
        ('train.steps="3"', "--set train.steps=\"3\": train.steps must be an int, got str '3'"),
        ("train.steps=null", "--set train.steps=null: train.steps must be an int, got null"),
        ("log.dir=null", "--set log.dir=null: log.dir must be a string, got null"),
        ("dist.timeout_s=abc", "--set dist.timeout_s=abc: dist.timeout_s must be a float, got str"),
        ("model.hidden_size=big", "--set model.hidden_size=big: model.hidden_size must be an int"),
        ("log.dir=[1]", "--set log.dir=[1]: log.dir must be a string, got list [1]"),
        (
            "train.lr_scaling=cubic",
            "--set train.lr_scaling=cubic: train.lr_scaling must be one of none, linear, sqrt, "
            "got 'cubic'",
        ),
        ("parallel.ppp=2", "--set parallel.ppp=2: unknown key 'parallel.ppp' (did you mean"),
        ("trian.steps=2", "--set trian.steps=2: unknown key 'trian.steps' (did you mean 'train."),
        ("parallel=3", "--set parallel=3: unknown key 'parallel'"),
    ],
)
def test_set_errors(item, message):
    assert message in error(load, None, [item])


def test_an_unknown_preset_lists_the_shipped_ones():
    # any string is a valid model.preset to --set; resolve names the shipped presets
    loaded = load(None, ["model.preset=llama-tinny"])
    assert {"llama-tiny", "gpt2-tiny"} <= set(presets())
    assert error(resolve, loaded, 1) == (
        f"model.preset='llama-tinny' is not a preset ({', '.join(presets())}); name a model "
        "directory or config.json with model.config"
    )


def test_later_set_wins():
    assert load(None, ["train.steps=3", "train.steps=4"]).run.train.steps == 4


# ---- ds.* overrides --------------------------------------------------------------------------


def test_ds_set_deep_merges_into_the_json():
    ds = load(
        None,
        [
            "deepspeed=ds_configs/zero1.json",
            "ds.zero_optimization.stage=2",
            "ds.gradient_clipping=0.5",
        ],
    ).ds
    assert ds["zero_optimization"] == {
        "stage": 2,
        "reduce_bucket_size": 5000000,
        "use_multi_rank_bucket_allreduce": False,
    }
    assert ds["gradient_clipping"] == 0.5
    assert ds["optimizer"]["params"]["lr"] == "auto"  # untouched siblings stay


def test_ds_set_object_value_replaces_the_object():
    # the JSON's scheduler is WarmupLR with warmup_* params: none of them may survive
    sets = [
        'ds.scheduler={"type": "OneCycle", "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01}}'
    ]
    ds = load(None, sets).ds
    assert ds["scheduler"] == {
        "type": "OneCycle",
        "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01},
    }
    ds = load(None, ['ds.zero_optimization={"stage": 1}']).ds
    assert ds["zero_optimization"] == {"stage": 1}  # reduce_bucket_size is gone


def test_ds_set_dotted_key_changes_one_key():
    ds = load(None, ["ds.scheduler.params.warmup_num_steps=7"]).ds
    assert ds["scheduler"] == {"type": "auto", "params": {"warmup_num_steps": 7}}


def test_ds_set_creates_parents():
    ds = load(None, ["ds.bf16.enabled=true"]).ds
    assert ds["bf16"] == {"enabled": True}
    node: dict = {}
    deepspeed_json.merge_override(node, "a.b.c", 1)
    assert node == {"a": {"b": {"c": 1}}}


def test_ds_set_null_deletes():
    ds = load(None, ["ds.scheduler=null", "ds.optimizer.params.weight_decay=null"]).ds
    assert "scheduler" not in ds
    assert "weight_decay" not in ds["optimizer"]["params"]
    assert ds["optimizer"]["params"]["lr"] == "auto"
    node = {"a": 1}
    deepspeed_json.merge_override(node, "missing.key", None)  # deleting nothing creates nothing
    assert node == {"a": 1}


def test_ds_set_null_below_a_missing_refused_key_is_no_error():
    assert "fp16" not in load(None, ["ds.fp16.enabled=null"]).ds


def test_ds_set_null_batch_key_is_then_derived():
    res = resolve(load(None, ["ds.train_batch_size=null", "ds.gradient_accumulation_steps=3"]), 4)
    assert res.batch == Batch(24, 2, 3)


def test_ds_set_into_a_non_object_is_an_error():
    assert error(load, None, ["ds.gradient_clipping.max=1"]) == (
        "--set ds.gradient_clipping.max: ds.gradient_clipping is float 1.0, not an object"
    )
    assert error(load, None, ["ds.optimizer.type.x.y=1"]) == (
        "--set ds.optimizer.type.x.y: ds.optimizer.type is str 'AdamW', not an object"
    )


def test_ds_set_without_a_key():
    assert error(load, None, ["ds.=1"]) == "--set ds.=1: expected ds.KEY=VALUE"


def test_ds_set_does_not_change_the_file(tmp_path):
    path = write_run(tmp_path, "deepspeed: ds.json\n")
    before = (tmp_path / "ds.json").read_text()
    load(path, ["ds.zero_optimization.stage=3"])
    assert (tmp_path / "ds.json").read_text() == before


def test_merge_override_copies_values():
    value = {"x": [1]}
    node: dict = {}
    deepspeed_json.merge_override(node, "a", value)
    value["x"].append(2)
    assert node == {"a": {"x": [1]}}


# ---- YAML errors carry file:line -----------------------------------------------------------------


def test_unknown_nested_key_names_its_line(tmp_path):
    path = write_run(
        tmp_path,
        "deepspeed: ds.json\n"
        "\n"
        "model:\n"
        "  preset: llama-tiny\n"
        "  hiden_size: 64\n"
        "parallel:\n"
        "  pp: 1\n",
    )
    assert error(load, path) == (
        f"{path}:5: unknown key 'model.hiden_size' (did you mean 'hidden_size'?)"
    )


def test_unknown_key_deeper_in_the_file(tmp_path):
    path = write_run(tmp_path, "deepspeed: ds.json\nmodel:\n  seq_len: 32\ntrain:\n  stpes: 3\n")
    assert error(load, path) == f"{path}:5: unknown key 'train.stpes' (did you mean 'steps'?)"


def test_unknown_top_level_key_points_deepspeed_settings_to_the_json(tmp_path):
    path = write_run(tmp_path, "deepspeed: ds.json\ntrain_batch_size: 8\n")
    assert error(load, path) == (
        f"{path}:2: unknown key 'train_batch_size' "
        "(DeepSpeed settings belong in the JSON named by 'deepspeed:')"
    )


def test_top_level_typo_gets_did_you_mean(tmp_path):
    path = write_run(tmp_path, "deepspeed: ds.json\nparalel:\n  pp: 1\n")
    assert error(load, path) == f"{path}:2: unknown key 'paralel' (did you mean 'parallel'?)"


def test_duplicate_keys(tmp_path):
    path = write_run(tmp_path, "deepspeed: ds.json\nmodel:\n  seq_len: 32\n  seq_len: 16\n")
    assert error(load, path) == f"{path}:4: duplicate key 'model.seq_len' (first on line 3)"
    path = write_run(tmp_path, "model:\n  seq_len: 32\ndeepspeed: ds.json\nmodel:\n  x: 1\n")
    assert error(load, path) == f"{path}:4: duplicate key 'model' (first on line 1)"


def test_invalid_yaml_names_the_line(tmp_path):
    path = write_run(tmp_path, "deepspeed: ds.json\nmodel:\n  seq_len: [1,\n  2\nparallel: {\n")
    msg = error(load, path)
    assert re.fullmatch(re.escape(f"{path}:") + r"\d+: invalid YAML: .+", msg), msg
    path = write_run(tmp_path, "deepspeed: ds.json\nmodel: seq_len: 3\n")
    assert error(load, path) == f"{path}:2: invalid YAML: mapping values are not allowed here"


def test_wrong_type_in_yaml_names_the_line(tmp_path):
    path = write_run(tmp_path, "deepspeed: ds.json\nmodel:\n  seq_len: '32'\n")
    assert error(load, path) == f"{path}:3: model.seq_len must be an int, got str '32'"
    path = write_run(tmp_path, "deepspeed: ds.json\nparallel: 2\n")
    assert error(load, path) == f"{path}:2: parallel must be a mapping, got int"


def test_yaml_must_be_a_mapping(tmp_path):
    path = write_run(tmp_path, "- a\n- b\n")
    assert error(load, path) == f"{path}: a run config must be a YAML mapping, got list"


def test_missing_yaml(tmp_path):
    path = str(tmp_path / "nope.yaml")
    assert error(load, path) == f"{path}: cannot read run config: No such file or directory"


def test_set_overrides_a_bad_yaml_value_and_names_set_in_errors(tmp_path):
    path = write_run(tmp_path, "deepspeed: ds.json\ntrain:\n  steps: 3\n")
    assert load(path, ["train.steps=9"]).run.train.steps == 9
    assert error(load, path, ["train.steps=x"]).startswith("--set train.steps=x: train.steps")


def test_yaml_fields_not_given_keep_defaults(tmp_path):
    path = write_run(tmp_path, "deepspeed: ds.json\nparallel:\n  tp: 2\n")
    run = load(path).run
    assert (run.parallel.pp, run.parallel.tp, run.train.steps) == (1, 2, 20)


# ---- where the DeepSpeed JSON is found -------------------------------------------------------


def test_deepspeed_path_relative_to_yaml_and_set_relative_to_cwd(tmp_path, monkeypatch):
    conf, other = tmp_path / "conf", tmp_path / "other"
    conf.mkdir()
    other.mkdir()
    path = write_run(conf, "deepspeed: ds.json\n", zero0(zero_optimization={"stage": 1}))
    (other / "ds.json").write_text(json.dumps(zero0(zero_optimization={"stage": 2})))
    monkeypatch.chdir(other)

    loaded = load(path)
    assert loaded.ds_path == str(conf / "ds.json")
    assert loaded.ds["zero_optimization"]["stage"] == 1

    loaded = load(path, ["deepspeed=ds.json"])
    assert loaded.ds_path == str(other / "ds.json")
    assert loaded.ds["zero_optimization"]["stage"] == 2

    monkeypatch.chdir(tmp_path)  # a relative YAML path: still next to the YAML, not the cwd
    assert load("conf/run.yaml").ds_path == str(conf / "ds.json")


def test_deepspeed_path_in_a_subdirectory_and_absolute(tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "z.json").write_text(json.dumps(zero0()))
    (tmp_path / "run.yaml").write_text("deepspeed: ds/z.json\n")
    assert load(str(tmp_path / "run.yaml")).ds_path == str(tmp_path / "ds" / "z.json")
    (tmp_path / "abs.yaml").write_text(f"deepspeed: {ZERO0}\n")
    assert load(str(tmp_path / "abs.yaml")).ds_path == ZERO0


def test_missing_or_bad_deepspeed_json(tmp_path):
    (tmp_path / "run.yaml").write_text("deepspeed: gone.json\n")
    assert error(load, str(tmp_path / "run.yaml")) == (
        f"{tmp_path / 'gone.json'}: cannot read DeepSpeed config: No such file or directory"
    )
    (tmp_path / "bad.json").write_text('{\n  "train_batch_size": 16,\n}\n')
    msg = error(load, str(tmp_path / "run.yaml"), ["deepspeed=" + str(tmp_path / "bad.json")])
    assert msg.startswith(f"{tmp_path / 'bad.json'}:3: invalid JSON: ")
    (tmp_path / "list.json").write_text("[1]")
    msg = error(load, str(tmp_path / "run.yaml"), ["deepspeed=" + str(tmp_path / "list.json")])
    assert msg == f"{tmp_path / 'list.json'}: a DeepSpeed config must be a JSON object"


# ---- batch math ----------------------------------------------------------------------------------

T, M, G = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"

# (train, micro, gas, dp) -> Batch, covering all 7 combinations of present keys
BATCH_OK = [
    # three keys: they must agree
    (16, 2, 8, 1, Batch(16, 2, 8)),
    (16, 2, 4, 2, Batch(16, 2, 4)),
    (16, 2, 1, 8, Batch(16, 2, 1)),
    # train + micro -> gas
    (16, 2, None, 1, Batch(16, 2, 8)),
    (16, 2, None, 4, Batch(16, 2, 2)),
    (24, 4, None, 3, Batch(24, 4, 2)),
    # train + gas -> micro
    (16, None, 2, 1, Batch(16, 8, 2)),
    (16, None, 2, 4, Batch(16, 2, 2)),
    (36, None, 3, 3, Batch(36, 4, 3)),
    # micro + gas -> train
    (None, 2, 3, 1, Batch(6, 2, 3)),
    (None, 2, 3, 4, Batch(24, 2, 3)),
    # train alone: gas 1, micro = train / dp
    (16, None, None, 1, Batch(16, 16, 1)),
    (16, None, None, 4, Batch(16, 4, 1)),
    # micro alone: gas 1, train = micro * dp
    (None, 3, None, 1, Batch(3, 3, 1)),
    (None, 3, None, 4, Batch(12, 3, 1)),
]


@pytest.mark.parametrize("train, micro, gas, dp, expected", BATCH_OK)
def test_batch_math(train, micro, gas, dp, expected):
    got = resolve_batch(train, micro, gas, dp, "x.json")
    assert got == expected
    assert got.train == got.micro * got.gas * dp


@pytest.mark.parametrize("train, micro, gas, dp, expected", [c for c in BATCH_OK if c[3] == 1])
def test_batch_math_agrees_with_deepspeed_for_one_rank(train, micro, gas, dp, expected):
    from deepspeed.runtime.config import DeepSpeedConfig

    given = {k: v for k, v in ((T, train), (M, micro), (G, gas)) if v is not None}
    cfg = DeepSpeedConfig(given)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == expected[:2]
    assert cfg.gradient_accumulation_steps == expected.gas


# (train, micro, gas, dp) -> every number that must appear in the message
BATCH_BAD = [
    (16, 2, 4, 4, ["train_batch_size=16", "=2", "=4", "dp=4", "(= 32)", "!="]),
    (16, 2, 3, 2, ["train_batch_size=16", "per_gpu=2", "steps=3", "dp=2", "(= 12)"]),
    (16, 2, None, 3, ["cannot derive gradient_accumulation_steps", "=16", "=2", "dp=3"]),
    (12, 4, None, 4, ["cannot derive gradient_accumulation_steps", "=12", "=4", "dp=4"]),
    (16, None, 3, 2, ["cannot derive train_micro_batch_size_per_gpu", "=16", "=3", "dp=2"]),
    (8, None, 4, 4, ["cannot derive train_micro_batch_size_per_gpu", "=8", "=4", "dp=4"]),
    (16, None, None, 3, ["cannot derive train_micro_batch_size_per_gpu", "=16", "dp=3"]),
    (2, None, None, 4, ["cannot derive train_micro_batch_size_per_gpu", "=2", "dp=4"]),
]


@pytest.mark.parametrize("train, micro, gas, dp, parts", BATCH_BAD)
def test_batch_math_errors_print_every_number(train, micro, gas, dp, parts):
    msg = error(resolve_batch, train, micro, gas, dp, "x.json")
    assert msg.startswith("x.json: ")
    for part in parts:
        assert part in msg, (part, msg)
    for key, value in ((T, train), (M, micro), (G, gas)):
        if value is not None:
            assert f"{key}={value}" in msg


def test_batch_math_needs_train_or_micro():
    for gas in (None, 4):
        assert error(resolve_batch, None, None, gas, 2, "x.json") == (
            "x.json: set train_batch_size or train_micro_batch_size_per_gpu (or both)"
        )


# one rule for a huge integer and a huge float: neither is a batch anyone can train
@pytest.mark.parametrize(
    "bad", [0, -2, True, 2.0, "16", [16], 99999999999999999999999, 1e300, 2**31]
)
@pytest.mark.parametrize("key", ["train", "micro", "gas"])
def test_batch_values_must_be_positive_integers(key, bad):
    values = {"train": 16, "micro": 2, "gas": 8}
    values[key] = bad
    name = {"train": T, "micro": M, "gas": G}[key]
    assert error(resolve_batch, values["train"], values["micro"], values["gas"], 1, "x.json") == (
        f"x.json: {name} must be an integer in 1..2147483647, got {bad!r}"
    )


def test_batch_math_runs_after_the_merge_with_dp_from_the_layout():
    # 8 ranks, tp=2 -> dp=4; train 32 from the JSON's micro 2 and the --set gas 4
    loaded = load(
        None, ["parallel.tp=2", "ds.train_batch_size=null", "ds.gradient_accumulation_steps=4"]
    )
    res = resolve(loaded, 8)
    assert res.topology.dp == 4 and res.batch == Batch(32, 2, 4)
    msg = error(resolve, load(None, ["parallel.tp=2", "ds.gradient_accumulation_steps=3"]), 8)
    assert msg == (
        "--set ds.gradient_accumulation_steps=3: train_batch_size=16 != "
        "train_micro_batch_size_per_gpu=2 * gradient_accumulation_steps=3 * dp=4 (= 24)"
    )


# ---- DeepSpeed JSON: refused features, unknown keys, types ------------------------------------


FP16_HERE = "fp16 is not supported on this device (DeepSpeed: Type fp16 is not supported on your"


@pytest.mark.parametrize(
    "item, message",
    [
        ('ds.fp16={"enabled": true}', FP16_HERE),
        ('ds.pipeline={"stages": 2}', "'pipeline' is refused: dsnd runs its own pipeline"),
        ("ds.amp.enabled=true", "'amp' is refused: apex AMP is not supported"),
        ("ds.tensor_parallel.autotp_size=2", "'tensor_parallel' is refused"),
        ("ds.checkpoint.load_universal=true", "'checkpoint' is refused: dsnd writes its own"),
        ("ds.sequence_parallel_size=2", "'sequence_parallel_size' is refused"),
        (
            'ds.zero_optimization.offload_optimizer={"device": "nvme"}',
            "zero_optimization.offload_optimizer.device='nvme' needs zero_optimization.stage 3, "
            "got 0",
        ),
        (
            'ds.zero_optimization.offload_param={"device": "cpu"}',
            "zero_optimization.offload_param.device='cpu' needs zero_optimization.stage 3, got 0",
        ),
        (
            "ds.zero_optimization.zero_quantized_weights=true",
            "'zero_quantized_weights' is refused: ZeRO++ quantized weights (qwZ) need DeepSpeed's "
            "quantizer op (QuantizerBuilder), which its CPU accelerator does not implement",
        ),
        (
            "ds.zero_optimization.zero_quantized_gradients=true",
            "'zero_quantized_gradients' is refused: ZeRO++ quantized gradients (qgZ)",
        ),
        (
            "ds.train_batch_szie=16",
            "unknown key 'train_batch_szie' (did you mean 'train_batch_size'?)",
        ),
    ],
)
def test_refused_deepspeed_features_by_name(item, message):
    msg = error(load, None, [item])
    assert msg.startswith(f"--set {item}: ")  # the --set, not the packaged JSON
    assert message in msg


def _nvme(path, key: str = "offload_param") -> list[str]:
    return [
        "deepspeed=ds_configs/zero3.json",
        f'ds.zero_optimization.{key}={{"device": "nvme", "nvme_path": "{path}"}}',
    ]


def test_nvme_offload_needs_a_writable_directory(tmp_path):
    missing = tmp_path / "missing"
    msg = error(load, None, _nvme(missing))
    assert msg.endswith(
        f"zero_optimization.offload_param.nvme_path: '{missing}' is not a writable directory"
    )
    (tmp_path / "file").write_text("")
    assert "is not a writable directory" in error(load, None, _nvme(tmp_path / "file"))
    msg = error(
        load,
        None,
        [
            *_nvme(tmp_path, "offload_optimizer"),
            "ds.zero_optimization.offload_optimizer.nvme_path=null",
        ],
    )
    assert "offload_optimizer.nvme_path must be the path of a directory, got None" in msg


def test_nvme_offload_is_accepted_and_its_aio_section_read(tmp_path):
    res = resolve(
        load(
            None,
            [
                *_nvme(tmp_path),
                *_nvme(tmp_path, "offload_optimizer"),
                'ds.aio={"block_size": 262144, "thread_count": 1}',
            ],
        ),
        1,
    )
    assert res.ds["aio"] == {"block_size": 262144, "thread_count": 1}
    assert "aio.thread_count: not a key DeepSpeed reads; ignored, as DeepSpeed does" in res.ds_notes
    assert not [n for n in res.ds_notes if n.startswith("aio: ignored")]
    msg = error(load, None, [*_nvme(tmp_path), 'ds.aio={"single_submit": 1}'])
    assert msg.endswith("aio.single_submit must be bool, got 1")
    msg = error(load, None, [*_nvme(tmp_path), 'ds.aio={"use_gds": true}'])
    assert "aio.use_gds needs CUDA (GPUDirect Storage)" in msg


@pytest.mark.parametrize(
    "sets, world, message",
    [
        (
            ["ds.zero_optimization.zero_hpz_partition_size=2"],
            2,
            "zero_hpz_partition_size=2 needs zero_optimization.stage 3, got 0",
        ),
        (
            ["deepspeed=ds_configs/zero3.json", "ds.zero_optimization.zero_hpz_partition_size=3"],
            4,
            "zero_hpz_partition_size=3 must divide each stage's data-parallel size dp=4",
        ),
        (
            [
                "deepspeed=ds_configs/zero3.json",
                "parallel.pp=2",
                "ds.train_batch_size=24",
                "ds.zero_optimization.zero_hpz_partition_size=2",
            ],
            6,
            "zero_hpz_partition_size=2 must divide each stage's data-parallel size dp=3",
        ),
    ],
)
def test_hpz_needs_zero3_and_a_size_that_divides_dp(sets, world, message):
    msg = error(resolve, load(None, sets), world)
    assert msg.startswith(f"--set {sets[-1]}: ") and msg.endswith(message)


def test_hpz_is_accepted_at_zero3():
    sets = ["deepspeed=ds_configs/zero3.json", "ds.zero_optimization.zero_hpz_partition_size=8"]
    for world in (2, 4, 8):  # a size past dp is dp, as DeepSpeed caps it at its world
        assert (
            resolve(load(None, sets), world).ds["zero_optimization"]["zero_hpz_partition_size"] == 8
        )


def test_refused_feature_in_the_json_file(tmp_path):
    path = write_run(tmp_path, "deepspeed: ds.json\n", zero0(fp16={"enabled": True}))
    assert error(load, path) == (f"{tmp_path / 'ds.json'}: {FP16_HERE} device); use bf16 or fp32")


@pytest.mark.parametrize(
    "item, message",
    [
        (
            "ds.train_batch_szie=16",
            ": unknown key 'train_batch_szie' (did you mean 'train_batch_size'?)",
        ),
        (
            "ds.gradient_clip=1.0",
            ": unknown key 'gradient_clip' (did you mean 'gradient_clipping'?)",
        ),
        (
            "ds.zero_optimization.stgae=1",
            ": zero_optimization: unknown key 'stgae' (did you mean 'stage'?)",
        ),
        (
            "ds.zero_optimization.reduce_bucket_sise=1",
            ": zero_optimization: unknown key 'reduce_bucket_sise' "
            "(did you mean 'reduce_bucket_size'?)",
        ),
        (
            "ds.optimizer.params.weight_decy=0.1",
            ": optimizer.params: unknown key 'weight_decy' (did you mean 'weight_decay'?)",
        ),
        ("ds.optimizer.parms.lr=1", ": optimizer: unknown key 'parms' (did you mean 'params'?)"),
        (
            "ds.scheduler.params.warmup_max_lrr=0.1",
            ": scheduler.params: unknown key 'warmup_max_lrr' (did you mean 'warmup_max_lr'?)",
        ),
        (
            "ds.scheduler.params.warmup_nums_steps=3",
            ": scheduler.params: unknown key 'warmup_nums_steps' "
            "(did you mean 'warmup_num_steps'?)",
        ),
        ("ds.bf16.enable=true", ": bf16: unknown key 'enable' (did you mean 'enabled'?)"),
        (
            "ds.scheduler.type=WarmupLr",
            "scheduler.type 'WarmupLr' is not a DeepSpeed scheduler (did you mean 'WarmupLR'?)",
        ),
        (
            "ds.optimizer.type=SDG",
            "optimizer.type 'SDG' is neither one of DeepSpeed's optimizers nor a torch.optim "
            "optimizer (did you mean 'SGD'?)",
        ),
    ],
)
def test_unknown_deepspeed_keys_with_did_you_mean(item, message):
    msg = error(load, None, [item])
    assert msg.startswith(f"--set {item}: ")
    assert message in msg


def test_unknown_deepspeed_key_in_the_json_file(tmp_path):
    ds = zero0()
    ds["zero_optimization"]["stgae"] = 2
    path = write_run(tmp_path, "deepspeed: ds.json\n", ds)
    assert error(load, path) == (
        f"{tmp_path / 'ds.json'}: zero_optimization: unknown key 'stgae' (did you mean 'stage'?)"
    )


def test_deepspeed_aliases_and_real_zero_keys_are_accepted():
    ds = load(
        None,
        [
            "ds.zero_optimization.stage=3",
            "ds.zero_optimization.stage3_param_persistence_threshold=0",
            "ds.zero_optimization.use_multi_rank_bucket_allreduce=false",
            "ds.bf16.enabled=true",
            "ds.gradient_accumulation_steps=8",
        ],
    ).ds
    assert ds["zero_optimization"]["stage"] == 3


@pytest.mark.parametrize(
    "item, message",
    [
        ('ds.gradient_clipping="1"', "gradient_clipping must be int or float, got '1'"),
        ("ds.gradient_clipping=true", "gradient_clipping must be int or float, got True"),
        ("ds.steps_per_print=1.5", "steps_per_print must be int, got 1.5"),
        ("ds.wall_clock_breakdown=1", "wall_clock_breakdown must be bool, got 1"),
        ("ds.zero_optimization=3", "zero_optimization must be object, got 3"),
        ("ds.optimizer=[1]", "optimizer must be object, got [1]"),
        ("ds.optimizer.params=[1]", "optimizer.params must be an object, got [1]"),
        ("ds.scheduler.params=5", "scheduler.params must be an object, got 5"),
        ("ds.optimizer.params.lr=abc", "optimizer.params.lr must be a number, got 'abc'"),
        ("ds.optimizer.params.lr=true", "optimizer.params.lr must be a number, got True"),
        ("ds.optimizer.params.betas=0.9", "optimizer.params.betas must be [beta1, beta2], got 0.9"),
        ("ds.optimizer.params.torch_adam=1", "optimizer.params.torch_adam must be bool, got 1"),
        ('ds.scheduler.params.warmup_num_steps="5"', "warmup_num_steps must be a number, got '5'"),
        ('ds.scheduler.params.warmup_max_lr="x"', "warmup_max_lr must be a number, got 'x'"),
        ("ds.scheduler.params.warmup_type=1", "warmup_type must be str, got 1"),
        (
            "ds.scheduler.type=WarmupDecayLR",
            "scheduler.params.total_num_steps is required by WarmupDecayLR",
        ),
        ("ds.train_batch_size=0", "train_batch_size must be an integer in 1..2147483647, got 0"),
        (
            'ds.train_micro_batch_size_per_gpu="2"',
            "train_micro_batch_size_per_gpu must be an integer in 1..2147483647, got '2'",
        ),
    ],
)
def test_wrong_deepspeed_types(item, message):
    def go():
        resolve(load(None, [item]), 1)

    msg = error(go)
    assert msg.startswith(f"--set {item}: ")
    assert message in msg


def test_deepspeed_itself_checks_values_before_any_rank():
    msg = error(resolve, load(None, ["ds.zero_optimization.reduce_bucket_size=-5"]), 1)
    assert msg == (
        "--set ds.zero_optimization.reduce_bucket_size=-5: DeepSpeed rejects the config: "
        "zero_optimization.reduce_bucket_size: Input should be greater than 0 (got -5)"
    )


def test_no_optimizer_or_scheduler_takes_dsnds_default_and_says_so(tmp_path):
    ds = zero0()
    del ds["optimizer"], ds["scheduler"]
    path = write_run(tmp_path, "deepspeed: ds.json\n", ds)
    res = resolve(load(path), 1)
    assert res.ds["optimizer"] == resolve(load(None), 1).ds["optimizer"]  # the packaged "auto"s
    assert res.ds["scheduler"] == resolve(load(None), 1).ds["scheduler"]
    assert res.ds_notes[:2] == [
        'optimizer: none in the JSON -> AdamW {"lr": 0.003, "betas": [0.9, 0.95], "eps": 1e-08, '
        '"weight_decay": 0.1, "torch_adam": true} (dsnd\'s default)',
        'scheduler: none in the JSON -> WarmupLR {"warmup_min_lr": 0.0003, "warmup_max_lr": '
        '0.003, "warmup_num_steps": 5, "warmup_type": "linear"} (dsnd\'s default)',
    ]


# ---- layout checks -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sets, world, message",
    [
        # tp splits the heads (hidden_size itself need not divide: the heads' width is split)
        (["parallel.tp=3"], 3, "preset llama-tiny: num_heads=4 is not divisible by parallel.tp=3"),
        (["parallel.tp=8"], 8, "preset llama-tiny: num_heads=4 is not divisible by parallel.tp=8"),
        (
            ["parallel.tp=4"],
            4,
            "preset llama-tiny: num_kv_heads=2 is not divisible by parallel.tp=4",
        ),
        (
            ["parallel.tp=2", "model.num_kv_heads=1"],
            2,
            "preset llama-tiny: num_kv_heads=1 is not divisible by parallel.tp=2",
        ),
        (
            ["parallel.tp=4", "model.hidden_size=96", "model.num_heads=6", "model.num_kv_heads=6"],
            4,
            "preset llama-tiny: num_heads=6 is not divisible by parallel.tp=4",
        ),
        (
            ["parallel.tp=2", "model.preset=gpt2-tiny", "model.ffn_size=255"],
            2,
            "preset gpt2-tiny: ffn_size=255 is not divisible by parallel.tp=2",
        ),
        (
            ["model.num_kv_heads=3"],
            1,
            "preset llama-tiny: num_attention_heads=4 is not divisible by num_key_value_heads=3",
        ),
        (
            ["model.preset=gpt2-tiny", "model.hidden_size=66"],
            1,
            "preset gpt2-tiny: hidden_size=66 is not divisible by num_attention_heads=4",
        ),
        (  # refused by transformers' own LlamaConfig check, in one line
            ["model.hidden_size=66"],
            1,
            "model.preset=llama-tiny: transformers refuses the config: The hidden size (66) is "
            "not a multiple of the number of attention heads (4).",
        ),
    ],
)
def test_tp_must_divide_the_heads_and_the_heads_the_model(sets, world, message):
    assert error(resolve, load(None, sets), world) == message


@pytest.mark.parametrize(
    "preset, tp, world", [("llama-tiny", 2, 2), ("gpt2-tiny", 4, 4), ("llama-tiny", 2, 8)]
)
def test_tp_that_divides_everything(preset, tp, world):
    res = resolve(load(None, [f"model.preset={preset}", f"parallel.tp={tp}"]), world)
    assert (res.topology.tp, res.topology.dp) == (tp, world // tp)


@pytest.mark.parametrize(
    "pp, tp, world, message",
    [
        (2, 2, 6, "world size 6 is not divisible by parallel.pp * parallel.tp = 2 * 2 = 4"),
        (1, 2, 3, "world size 3 is not divisible by parallel.pp * parallel.tp = 1 * 2 = 2"),
        (4, 1, 2, "world size 2 is not divisible by parallel.pp * parallel.tp = 4 * 1 = 4"),
        (0, 1, 2, "parallel.pp and parallel.tp must be >= 1, got pp=0 tp=1"),
        (1, -1, 2, "parallel.pp and parallel.tp must be >= 1, got pp=1 tp=-1"),
        (8, 1, 8, "parallel.pp=8 exceeds the 4 blocks of preset llama-tiny"),
    ],
)
def test_world_must_divide_by_pp_times_tp(pp, tp, world, message):
    assert error(resolve, load(None, [f"parallel.pp={pp}", f"parallel.tp={tp}"]), world) == message


def test_pp_tp_dp_layout():
    res = resolve(load(None, ["parallel.pp=2", "parallel.tp=2"]), 8)
    assert (res.topology.pp, res.topology.dp, res.topology.tp) == (2, 2, 2)
    assert res.batch == Batch(16, 2, 4)


@pytest.mark.parametrize(
    "item, message",
    [
        ("train.steps=-1", "train.steps must be >= 0, got -1"),
        ("checkpoint.every=-1", "checkpoint.every must be >= 0, got -1"),
        ("checkpoint.keep=-2", "checkpoint.keep must be >= 0, got -2"),
        ("train.lr_reference_batch=0", "train.lr_reference_batch must be >= 1, got 0"),
        ("dist.timeout_s=0", "dist.timeout_s must be > 0 and at most 31536000 (a year), got 0.0"),
        (
            "dist.timeout_s=1e300",
            "dist.timeout_s must be > 0 and at most 31536000 (a year), got 1e+300",
        ),
        (
            "model.seq_len=129",
            "model.seq_len=129 must be in 1..128, the max_position_embeddings of preset "
            "llama-tiny; raise it with model.max_position_embeddings if the model may run "
            "longer sequences",
        ),
        (
            "model.seq_len=0",
            "model.seq_len=0 must be in 1..128, the max_position_embeddings of preset "
            "llama-tiny; raise it with model.max_position_embeddings if the model may run "
            "longer sequences",
        ),
        ("model.num_heads=0", "preset llama-tiny: num_heads must be >= 1, got 0"),
        ("data.max_bytes=0", "data.max_bytes must be >= 1, got 0"),
        ("train.seed=-1", "train.seed must be in 0..9223372036854775807, got -1"),
        (f"train.seed={2**63}", f"train.seed must be in 0..9223372036854775807, got {2**63}"),
        ("log.peak_flops=0", "log.peak_flops must be a FLOP/s rate > 0, got 0.0"),
        ("log.peak_flops=-1e12", "log.peak_flops must be a FLOP/s rate > 0, got -1000000000000.0"),
        ("log.every=0", "log.every must be >= 1, got 0"),
        ("eval.every=-1", "eval.every must be >= 0, got -1"),
        ("eval.batches=0", "eval.batches must be >= 1, got 0"),
        (
            "log.expert_load_warn=1",
            "log.expert_load_warn must be > 1 (times the mean expert load) or 0 (never), got 1.0",
        ),
        ("log.dir=", "log.dir must not be empty"),
        (
            "parallel.activation_checkpoint_interval=-1",
            "parallel.activation_checkpoint_interval must be >= 0, got -1",
        ),
    ],
)
def test_value_ranges(item, message):
    assert error(resolve, load(None, [item]), 1) == message


def test_a_dropout_refusal_says_a_set_that_works():
    sets = ["model.preset=gpt2-tiny", 'model.overrides={"resid_pdrop": 0.1}']
    message = error(resolve, load(None, sets), 1)
    assert message.startswith(
        "preset gpt2-tiny: resid_pdrop=0.1: dsnd trains without dropout (layouts would draw "
        "different masks); set it to 0 (--set "
    )
    (advice,) = shlex.split(re.fullmatch(r".*\(--set (.+)\)", message).group(1))
    model = resolve(load(None, [*sets, advice]), 1).model
    assert model.config.resid_pdrop == 0


def test_max_position_embeddings_raises_the_longest_seq_len():
    loaded = load(None, ["model.seq_len=129", "model.max_position_embeddings=256"])
    assert resolve(loaded, 1).model.max_seq_len == 256
    loaded = load(None, ["model.seq_len=257", "model.max_position_embeddings=256"])
    assert error(resolve, loaded, 1).startswith("model.seq_len=257 must be in 1..256, ")


# ---- learning-rate scaling -----------------------------------------------------------------------

LR, MIN_LR, MAX_LR = 0.003, 0.0003, 0.003  # zero0.json's "auto"s: dsnd's default


@pytest.mark.parametrize(
    "scaling, batch, reference, factor",
    [
        ("none", 64, 16, 1.0),
        ("linear", 16, 16, 1.0),
        ("linear", 64, 16, 4.0),
        ("linear", 16, 64, 0.25),
        ("sqrt", 64, 16, 2.0),
        ("sqrt", 32, 16, math.sqrt(2.0)),
        ("sqrt", 16, 64, 0.5),
    ],
)
def test_lr_scaling(scaling, batch, reference, factor):
    loaded = load(
        None,
        [
            f"train.lr_scaling={scaling}",
            f"train.lr_reference_batch={reference}",
            f"ds.train_batch_size={batch}",
        ],
    )
    res = resolve(loaded, 2)
    assert res.batch.train == batch
    params = res.ds["optimizer"]["params"]
    sched = res.ds["scheduler"]["params"]
    assert params["lr"] == pytest.approx(LR * factor, rel=1e-12)
    assert sched["warmup_min_lr"] == pytest.approx(MIN_LR * factor, rel=1e-12)
    assert sched["warmup_max_lr"] == pytest.approx(MAX_LR * factor, rel=1e-12)
    # nothing else changes: not the step counts, not the other optimizer numbers
    assert sched["warmup_num_steps"] == 5 and sched["warmup_type"] == "linear"
    assert (params["eps"], params["weight_decay"], params["betas"]) == (1e-8, 0.1, [0.9, 0.95])
    # the loaded (user's) dict is left as it was
    assert loaded.ds["optimizer"]["params"]["lr"] == "auto"


def test_lr_scaling_covers_every_scheduler_lr():
    sets = [
        "train.lr_scaling=linear",
        "ds.train_batch_size=32",
        'ds.scheduler={"type": "OneCycle", "params": null}',
        'ds.scheduler.params={"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "decay_lr_rate": 0.5}',
    ]
    res = resolve(load(None, sets), 1)
    assert res.ds["scheduler"]["params"] == {
        "cycle_min_lr": pytest.approx(0.002, rel=1e-12),
        "cycle_max_lr": pytest.approx(0.02, rel=1e-12),
        "decay_lr_rate": 0.5,  # a rate, not a learning rate
    }
    assert res.ds["optimizer"]["params"]["lr"] == pytest.approx(0.006, rel=1e-12)


def test_lr_scaling_without_an_lr():
    sets = ["train.lr_scaling=sqrt", "ds.optimizer.params.lr=null"]
    res = resolve(load(None, sets), 1)
    assert "lr" not in res.ds["optimizer"]["params"]


def test_user_error_is_always_one_line():
    assert str(UserError("a\n  b\tc\n")) == "a b c"
