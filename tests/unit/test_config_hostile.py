"""Hostile and nonsensical configs through the real entry point, ``dsnd train``, in-process.

Each one must end as one line ``dsnd: error: ...`` and exit code 2 before any process group
starts: alias bombs, nesting 100k deep, duplicate JSON keys, NaN and Infinity, numbers out of
range, and ``--set ds.*`` errors named by their ``--set`` item. Also: a run's saved config.yaml
and deepspeed.json rerun the same run.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from dsnd import cli
from dsnd.config import ds_effect, json_lines
from dsnd.config.load import default_config_path, load
from dsnd.config.resolve import resolve
from dsnd.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ZERO0 = os.path.join(ROOT, "ds_configs", "zero0.json")
PACKAGED_DS = os.path.join(os.path.dirname(default_config_path()), "zero0.json")


@pytest.fixture
def train(capsys, monkeypatch, tmp_path):
    """``dsnd train ARGV`` as rank 0 of 1 -> its one error line, after 'dsnd: error: '."""
    import torch.distributed as dist

    env = dict(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29999",
        DS_ACCELERATOR="cpu",
    )
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(cli, "setup_logging", lambda rank: None)  # keep pytest's logging as is
    monkeypatch.chdir(tmp_path)

    def go(*argv: str) -> str:
        rc = cli.main(["train", *argv])
        out, err = capsys.readouterr()
        assert rc == 2, (rc, err)
        assert out == ""
        assert err.count("\n") == 1 and err.startswith("dsnd: error: "), err
        assert "Traceback" not in err
        assert not dist.is_initialized()
        return err[len("dsnd: error: ") : -1]

    return go


@pytest.fixture(autouse=True)
def _cpu_accelerator(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


def zero0(**changes) -> dict:
    with open(ZERO0) as f:
        return {**json.load(f), **changes}


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def run_yaml(tmp_path, body: str = "", ds_text: str | None = None) -> str:
    """run.yaml (``deepspeed: ds.json`` + `body`) and ds.json (zero0.json unless given)."""
    write(tmp_path, "ds.json", ds_text if ds_text is not None else json.dumps(zero0(), indent=2))
    return write(tmp_path, "run.yaml", "deepspeed: ds.json\n" + body)


# ---- YAML: alias bombs, cycles, depth -------------------------------------------------------


def billion_laughs() -> str:
    """~900 bytes: ten levels of nine aliases each, 9^10 (3.5 billion) key paths when expanded."""
    lines = ["a0: &a0 {" + ", ".join(f"k{i}: x" for i in range(9)) + "}"]
    for n in range(1, 10):
        lines.append(f"a{n}: &a{n} {{" + ", ".join(f"k{i}: *a{n - 1}" for i in range(9)) + "}")
    return "\n".join(lines) + "\n"


def test_yaml_alias_bomb_is_refused_without_expanding_it(tmp_path, train):
    path = run_yaml(tmp_path, billion_laughs())
    assert len(billion_laughs()) < 1000
    assert train("--config", path) == (
        f"{path}:5: aliases expand to more than 10000 values (a run config has about a hundred)"
    )


def test_yaml_alias_inside_its_own_anchor_is_refused(tmp_path, train):
    path = run_yaml(tmp_path, "model: &a {k: *a}\n")
    assert train("--config", path) == f"{path}:2: alias *a is inside its own anchor"


def test_ordinary_yaml_anchors_and_aliases_still_work(tmp_path):
    path = run_yaml(
        tmp_path, "train: {steps: &n 7, seed: 5}\ncheckpoint: {every: *n}\nlog: &log {every: 2}\n"
    )
    run = load(path).run
    assert (run.train.steps, run.checkpoint.every, run.log.every) == (7, 7, 2)


@pytest.mark.parametrize(
    "body, line",
    [
        ("model: " + "[" * 100_000 + "]" * 100_000 + "\n", 2),
        ("model: " + "{a: " * 100_000 + "1" + "}" * 100_000 + "\n", 2),
        ("".join("  " * i + f"k{i}:\n" for i in range(40)), 34),  # block style, 33rd level
    ],
    ids=["flow lists 100k deep", "flow mappings 100k deep", "block mappings 40 deep"],
)
def test_yaml_nesting_deeper_than_32_levels(tmp_path, train, body, line):
    path = run_yaml(tmp_path, body)
    assert train("--config", path) == f"{path}:{line}: nested deeper than 32 levels"


def test_yaml_32_levels_pass_the_depth_check(tmp_path):
    path = run_yaml(tmp_path, "model:\n  x: " + "[" * 30 + "]" * 30 + "\n")  # 32 with the top
    with pytest.raises(UserError, match=r"run.yaml:3: unknown key .model.x."):
        load(path)


def test_yaml_aliases_count_their_depth(tmp_path, train):
    deep = "[" * 20 + "]" * 20
    path = run_yaml(tmp_path, f"a: &a {deep}\nb: {'[' * 15}*a{']' * 15}\n")
    assert train("--config", path) == f"{path}:3: nested deeper than 32 levels"


def test_yaml_integer_too_long_to_convert(tmp_path, train):
    path = run_yaml(tmp_path, "train:\n  seed: " + "1" * 5000 + "\n")
    assert train("--config", path) == (
        f"{path}:3: invalid YAML: an integer of 5000 digits is out of range"
    )


def test_yaml_not_utf8(tmp_path, train):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"deepspeed: ds.json\n# caf\xe9\n")
    assert train("--config", str(path)) == (
        f"{path}: cannot read run config: not UTF-8 text (invalid continuation byte at byte 24)"
    )


# ---- DeepSpeed JSON: depth, duplicate keys, non-finite numbers ------------------------------


@pytest.mark.parametrize(
    "text, line",
    [
        ("[" * 100_000 + "]" * 100_000, 1),
        ('{"a":' * 100_000 + "1" + "}" * 100_000, 1),
        ('{\n "flops_profiler": {"x": ' + "[" * 40 + "]" * 40 + "}}", 2),
    ],
    ids=["lists 100k deep", "objects 100k deep", "33 levels"],
)
def test_json_nesting_deeper_than_32_levels(tmp_path, train, text, line):
    path = run_yaml(tmp_path, ds_text=text)
    ds = str(tmp_path / "ds.json")
    assert train("--config", path) == f"{ds}:{line}: nested deeper than 32 levels"


def test_json_duplicate_keys_name_both_lines_at_any_level(tmp_path, train):
    text = (
        '{\n  "train_batch_size": 16,\n  "train_micro_batch_size_per_gpu": 2,\n'
        '  "optimizer": {"type": "AdamW", "params": {"lr": 0.003}},\n'
        '  "zero_optimization": {"stage": 3},\n  "gradient_clipping": 1.0,\n'
        '  "train_batch_size": 32\n}\n'
    )
    path = write(tmp_path, "run.yaml", "deepspeed: zero3.json\n")
    ds = write(tmp_path, "zero3.json", text)
    assert train("--config", path) == (
        f"{ds}:7: duplicate key 'train_batch_size' (first on line 2)"
    )
    write(
        tmp_path,
        "zero3.json",
        '{"optimizer": {"type": "AdamW",\n "params": {"lr": 1,\n  "lr": 2}}}',
    )
    assert (
        train("--config", path) == f"{ds}:3: duplicate key 'optimizer.params.lr' (first on line 2)"
    )


@pytest.mark.parametrize(
    "value, shown",
    [("NaN", "NaN"), ("Infinity", "Infinity"), ("-Infinity", "-Infinity"), ("1e400", "1e400")],
)
def test_json_non_finite_numbers(tmp_path, train, value, shown):
    text = json.dumps(zero0(), indent=2).replace('"lr": "auto"', f'"lr": {value}')
    path = run_yaml(tmp_path, ds_text=text)
    line = text[: text.index(f'"lr": {value}')].count("\n") + 1
    assert train("--config", path) == (
        f"{tmp_path / 'ds.json'}:{line}: optimizer.params.lr: {shown} is not a finite number"
    )


def test_json_integer_too_long_and_not_utf8(tmp_path, train):
    path = run_yaml(tmp_path, ds_text='{"steps_per_print": ' + "9" * 5000 + "}")
    assert train("--config", path) == (
        f"{tmp_path / 'ds.json'}:1: steps_per_print: an integer of 5000 digits is out of range"
    )
    (tmp_path / "ds.json").write_bytes(b'{"a": "\xff"}')
    assert train("--config", path) == (
        f"{tmp_path / 'ds.json'}: cannot read DeepSpeed config: not UTF-8 text (invalid start "
        "byte at byte 7)"
    )


def test_json_parser_agrees_with_pythons_on_real_configs():
    for name in ("zero0", "zero1", "zero2", "zero3"):
        with open(os.path.join(ROOT, "ds_configs", f"{name}.json")) as f:
            text = f.read()
        assert json_lines.loads(text) == json.loads(text)
    text = '{"a": [1, 2.5, -3e-2, "x\\u00e9\\"", true, false, null, {}, []], "b": {"c": {}}}'
    assert json_lines.loads(text) == json.loads(text)


# ---- --set: non-finite, too deep, too long ----------------------------------------------------


@pytest.mark.parametrize(
    "item, message",
    [
        ("ds.optimizer.params.lr=NaN", "optimizer.params.lr must be a finite number, got nan"),
        ("ds.gradient_clipping=Infinity", "gradient_clipping must be a finite number, got inf"),
        ("ds.gradient_clipping=-Infinity", "gradient_clipping must be a finite number, got -inf"),
        (
            "ds.scheduler.params.warmup_max_lr=1e400",
            "scheduler.params.warmup_max_lr must be a finite number, got inf",
        ),
        (
            "ds.optimizer.params.betas=[0.9, NaN]",
            "optimizer.params.betas[1] must be a finite number, got nan",
        ),
        ("dist.timeout_s=NaN", "dist.timeout_s must be a finite number, got nan"),
        ("log.peak_flops=Infinity", "log.peak_flops must be a finite number, got inf"),
        ("eval.fraction=1e400", "eval.fraction must be a finite number, got inf"),
        (f"dist.timeout_s={10**400}", "dist.timeout_s must be a finite number, got inf"),
        ('ds.optimizer={"type": "Adam", "type": "AdamW"}', "duplicate key 'type'"),
    ],
)
def test_set_non_finite_and_duplicate_values(train, item, message):
    label = item if len(item) <= 100 else item[:97] + "..."
    assert train("--set", item) == f"--set {label}: {message}"


@pytest.mark.parametrize(
    "item, message",
    [
        ("ds.flops_profiler.x=" + "[" * 100_000, "nested deeper than 32 levels"),
        ("train.seed=" + "1" * 5000, "an integer of 5000 digits is out of range"),
        ("ds." + ".".join(["a"] * 40) + "=1", "key nested deeper than 32 levels"),
        (
            "ds.flops_profiler." + ".".join(["a"] * 20) + "=" + "[" * 20 + "]" * 20,
            "nested deeper than 32 levels",
        ),
    ],
    ids=["value 100k deep", "integer of 5000 digits", "key 40 deep", "key and value 42 deep"],
)
def test_set_too_deep_or_too_long(train, item, message):
    label = item if len(item) <= 100 else item[:97] + "..."
    assert train("--set", item) == f"--set {label}: {message}"


@pytest.mark.parametrize(
    "key, value, got",
    [
        ("dist.timeout_s", ".nan", "nan"),
        ("log.peak_flops", "-.inf", "-inf"),
        ("eval.fraction", ".inf", "inf"),
        ("dist.timeout_s", "1.0e+400", "inf"),
    ],
)
def test_yaml_non_finite_floats(tmp_path, train, key, value, got):
    section, name = key.split(".")
    path = run_yaml(tmp_path, f"{section}:\n  {name}: {value}\n")
    assert train("--config", path) == f"{path}:3: {key} must be a finite number, got {got}"


# ---- run keys out of range ------------------------------------------------------------------


@pytest.mark.parametrize(
    "item, message",
    [
        ("train.seed=-1", "train.seed must be in 0..9223372036854775807, got -1"),
        (f"train.seed={2**63}", f"train.seed must be in 0..9223372036854775807, got {2**63}"),
        ("log.peak_flops=0", "log.peak_flops must be a FLOP/s rate > 0, got 0.0"),
        (
            "log.peak_flops=-3e14",
            "log.peak_flops must be a FLOP/s rate > 0, got -300000000000000.0",
        ),
        ("log.every=0", "log.every must be >= 1, got 0"),
        ("checkpoint.keep=-1", "checkpoint.keep must be >= 0, got -1"),
        (
            "dist.timeout_s=1e9",
            "dist.timeout_s must be > 0 and at most 31536000 (a year), got 1000000000.0",
        ),
        ("model.hidden_size=0", "preset llama-tiny: hidden_size must be >= 1, got 0"),
        ("model.num_kv_heads=0", "preset llama-tiny: num_kv_heads must be >= 1, got 0"),
        ("model.ffn_size=0", "preset llama-tiny: ffn_size must be >= 1, got 0"),
        ("model.head_dim=0", "preset llama-tiny: head_dim must be >= 1, got 0"),
        ("log.dir=", "log.dir must not be empty"),
    ],
)
def test_run_keys_out_of_range(train, item, message):
    assert train("--set", item) == message


def test_eval_fraction_is_checked_and_eval_needs_something_to_evaluate_on(train):
    # held out by default (evaluated at the end): checked without eval.every
    assert train("--set", "eval.fraction=1.5") == "eval.fraction must be in [0, 1), got 1.5"
    assert train("--set", "eval.every=5", "--set", "eval.fraction=0") == (
        "eval.every=5: nothing to evaluate on (eval.fraction is 0 and data.eval_path is unset)"
    )
    assert train("--set", "data.eval_path=held.txt") == "data.eval_path: file not found: held.txt"


# ---- DeepSpeed values out of range; ZeRO stage; pydantic errors in one line -------------------


@pytest.mark.parametrize(
    "item, message",
    [
        ("ds.zero_optimization.stage=4", "zero_optimization.stage must be 0, 1, 2 or 3, got 4"),
        ("ds.zero_optimization.stage=-1", "zero_optimization.stage must be 0, 1, 2 or 3, got -1"),
        (
            "ds.zero_optimization.stage=true",
            "zero_optimization.stage must be 0, 1, 2 or 3, got True",
        ),
        ("ds.gradient_clipping=-1", "gradient_clipping must be >= 0 (0 = off), got -1"),
        ("ds.steps_per_print=0", "steps_per_print must be >= 1, got 0"),
        ("ds.optimizer.params.lr=-0.1", "optimizer.params.lr must be >= 0, got -0.1"),
        (
            "ds.optimizer.params.weight_decay=-1",
            "optimizer.params.weight_decay must be >= 0, got -1",
        ),
        (
            "ds.optimizer.params.betas=[0.9, 1.0]",
            "optimizer.params.betas must each be in [0, 1), got [0.9, 1.0]",
        ),
        (
            "ds.zero_optimization.reduce_bucket_size=-5",
            "DeepSpeed rejects the config: zero_optimization.reduce_bucket_size: Input should be "
            "greater than 0 (got -5)",
        ),
        (
            'ds.zero_optimization={"stage": 1, "reduce_bucket_size": "x", "overlap_comm": "maybe"}',
            "DeepSpeed rejects the config: zero_optimization.reduce_bucket_size: Input should be a "
            "valid integer, unable to parse string as an integer (got 'x') and 1 more",
        ),
        (
            "ds.bf16.enabled=[1]",
            "DeepSpeed rejects the config: bf16.enabled: Input should be a valid boolean (got [1])",
        ),
    ],
)
def test_deepspeed_values_out_of_range(train, item, message):
    assert train("--set", item) == f"--set {item}: {message}"


def test_zero_stage_in_the_json_file(tmp_path, train):
    path = run_yaml(tmp_path, ds_text=json.dumps(zero0(zero_optimization={"stage": 4})))
    assert train("--config", path) == (
        f"{tmp_path / 'ds.json'}: zero_optimization.stage must be 0, 1, 2 or 3, got 4"
    )


# ---- --set ds.*: an object replaces; errors name the --set, not the packaged JSON -------------


def test_set_object_replaces_and_the_error_names_the_set(train):
    item = 'ds.scheduler={"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5}}'
    assert train("--set", item) == (
        f"--set {item}: scheduler.params.total_num_steps is required by WarmupDecayLR"
    )
    # merged into the old section, WarmupLR's warmup_min_lr, warmup_max_lr and warmup_type stayed
    sets = [item.replace("5}", '5, "total_num_steps": 20}')]
    assert load(None, sets).ds["scheduler"] == {
        "type": "WarmupDecayLR",
        "params": {"warmup_num_steps": 5, "total_num_steps": 20},
    }


@pytest.mark.parametrize(
    "sets, blamed, message",
    [
        (
            ["ds.train_batch_size=16", "ds.gradient_accumulation_steps=3"],
            1,
            "train_batch_size=16 != train_micro_batch_size_per_gpu=2 * "
            "gradient_accumulation_steps=3 * dp=1 (= 6)",
        ),
        (
            ["ds.optimizer.type=SGD", "ds.optimizer.type=Adam", "ds.optimizer.params.lr=x"],
            2,
            "optimizer.params.lr must be a number, got 'x'",
        ),
        (
            ["ds.optimizer=null", "ds.scheduler.params.warmup_num_steps=x"],
            1,
            "scheduler.params.warmup_num_steps must be a number, got 'x'",
        ),
        (
            ["ds.fp16.enabled=true"],
            0,
            "fp16 is not supported on this device (DeepSpeed: Type fp16 is not supported on your "
            "device); use bf16 or fp32",
        ),
    ],
)
def test_error_names_the_first_set_that_causes_it(train, sets, blamed, message):
    argv = [a for item in sets for a in ("--set", item)]
    assert train(*argv) == f"--set {sets[blamed]}: {message}"


def test_a_set_completed_by_a_later_one_is_not_blamed(train):
    sets = ["ds.scheduler.type=WarmupDecayLR", "ds.scheduler.params.total_num_steps=20"]
    assert load(None, sets).ds["scheduler"]["type"] == "WarmupDecayLR"
    # the later lr error is the one blamed, not the scheduler that lacked a parameter for a moment
    argv = ["--set", sets[0], "--set", "ds.optimizer.params.lr=x", "--set", sets[1]]
    assert train(*argv) == (
        "--set ds.optimizer.params.lr=x: optimizer.params.lr must be a number, got 'x'"
    )


def test_a_bad_file_is_blamed_even_with_sets(tmp_path, train):
    path = run_yaml(tmp_path, ds_text=json.dumps(zero0(fp16={"enabled": True})))
    assert train("--config", path, "--set", "ds.gradient_clipping=2") == (
        f"{tmp_path / 'ds.json'}: fp16 is not supported on this device (DeepSpeed: Type fp16 is "
        "not supported on your device); use bf16 or fp32"
    )
    # ... and a set that fixes the file is fine
    assert load(path, ["ds.fp16=null"]).ds.get("fp16") is None


def test_world_size_batch_error_blames_the_file(monkeypatch, train):
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert train("--set", "ds.gradient_clipping=2") == (
        f"{PACKAGED_DS}: cannot derive gradient_accumulation_steps: train_batch_size=16 / "
        "(train_micro_batch_size_per_gpu=2 * dp=3) does not divide exactly"
    )


# ---- refusals name the run key that replaces them ---------------------------------------------


@pytest.mark.parametrize(
    "key, names",
    [
        ("checkpoint", "checkpoint.dir"),
        ("pipeline", "parallel.pp"),
        ("tensor_parallel", "parallel.tp"),
        ("sequence_parallel_size", "parallel.sequence_parallel"),
    ],
)
def test_refusal_names_the_run_key_to_use(train, key, names):
    value = {
        "sequence_parallel_size": "2",
        "checkpoint": '{"load_universal": true}',
        "tensor_parallel": '{"autotp_size": 2}',
    }
    item = f"ds.{key}=" + value.get(key, '{"enabled": true}')
    message = train("--set", item)
    assert message.startswith(f"--set {item}: '{key}' is refused: ")
    assert names in message


# ---- the saved configs rerun the same run -----------------------------------------------------


def test_saved_configs_rerun_the_same_run(tmp_path, monkeypatch):
    from dsnd.report.reporter import save_resolved_configs

    monkeypatch.chdir(tmp_path)
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "z.json").write_text(json.dumps(zero0()))
    (tmp_path / "conf" / "run.yaml").write_text(
        "deepspeed: z.json\ntrain:\n  lr_scaling: linear\n  lr_reference_batch: 8\n"
        "data:\n  path: corpus.txt\ncheckpoint:\n  dir: ckpts\n  export_hf: hf\n"
    )
    sets = [
        "ds.train_batch_size=32",
        "ds.optimizer.params.lr=0.002",
        "parallel.tp=2",
        'ds.zero_optimization={"stage": 1}',
        "log.dir=runs/x",
    ]
    res = resolve(load("conf/run.yaml", sets), 4)
    assert res.ds["optimizer"]["params"]["lr"] == pytest.approx(0.008)  # scaled by 32 / 8
    save_resolved_configs(res, res.run.log.dir)

    again = resolve(load("runs/x/config.yaml"), 4)
    assert again.ds == res.ds  # the lrs scaled once, not twice
    assert again.ds_user == res.ds_user
    assert again.ds_user["optimizer"]["params"]["lr"] == 0.002
    assert again.run == dataclasses.replace(res.run, deepspeed="deepspeed.json")
    assert (again.run.data.path, again.run.checkpoint.dir) == ("corpus.txt", "ckpts")
    assert again.batch == res.batch
    with open("runs/x/deepspeed.resolved.json") as f:
        assert json.load(f) == res.ds


def test_saved_configs_of_the_packaged_default_rerun(tmp_path):
    from dsnd.report.reporter import save_resolved_configs

    res = resolve(load(None, ["train.lr_scaling=sqrt", "ds.train_batch_size=64"]), 2)
    save_resolved_configs(res, str(tmp_path))
    again = resolve(load(str(tmp_path / "config.yaml")), 2)
    assert (again.ds, again.ds_user) == (res.ds, res.ds_user)
    assert again.run == dataclasses.replace(res.run, deepspeed="deepspeed.json")


# ---- notes on DeepSpeed's own printing --------------------------------------------------------


def test_notes_on_deepspeeds_own_numbers():
    assert zero0()["steps_per_print"] == ds_effect.PRINTS_NEVER  # silent: no note
    assert ds_effect.notes(zero0()) == []
    assert ds_effect.notes(zero0(wall_clock_breakdown=False)) == []
    steps, clock = ds_effect.notes(zero0(steps_per_print=10, wall_clock_breakdown=True))
    assert steps.startswith("steps_per_print: DeepSpeed's own progress lines count")
    assert "lr one step off" in steps
    assert clock.startswith("wall_clock_breakdown: ")
    assert "first micro-batch" in clock
    for note in (steps, clock):
        assert note.endswith(
            "dsnd's progress line, metrics.jsonl and TensorBoard are the numbers to trust"
        )
