"""The launch path's CUDA + NCCL facts, checked on this CPU: which accelerator and backend dsnd's
own ranks get, CUDA_VISIBLE_DEVICES from the selected slots, each NCCL rank's GPU and its eager
communicator, a config check that opens no CUDA context, a SIGABRT (the NCCL watchdog) named as
such, the ops `dsnd ops build` chooses for a JSON, and ZeRO++'s quantized switches by the
accelerator's quantizer op."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from dsnd.config import deepspeed_json, ds_quantized
from dsnd.config.ds_optimizer import check_optimizer, trial_params
from dsnd.distributed import init
from dsnd.distributed.discover import WorldInfo
from dsnd.engine import public
from dsnd.errors import UserError
from dsnd.launcher import local_ranks
from dsnd.launcher.devices import ignored_note, mpirun_devices_env, visible_devices_env
from dsnd.launcher.protocol import AgentSpec, RankOutcome, describe_exit, diagnose

WATCHDOG = "NCCL watchdog abort (collective timeout?)"


class Stop(Exception):
    """Raised by a stand-in to end the code under test once it has been seen."""


# 1. dsnd's own CPU ranks: CPU accelerator, no GPU, gloo; `dsnd bench gpu`'s rank: CUDA


def test_auto_is_the_accelerators_backend_not_the_machines():
    assert init.backend_for("auto", "cpu", cuda_available=True) == "gloo"
    assert init.backend_for("auto", None, cuda_available=True) == "nccl"
    assert init.backend_for("auto", "cuda", cuda_available=True) == "nccl"
    assert init.backend_for("auto", None, cuda_available=False) == "gloo"
    assert init.backend_for("gloo", "cuda", cuda_available=True) == "gloo"
    with pytest.raises(UserError, match="dist.backend=nccl needs DeepSpeed's CUDA accelerator"):
        init.backend_for("nccl", "cpu", cuda_available=True)


def test_local_ranks_run_on_the_cpu_with_no_gpu_visible_even_on_a_gpu_machine(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    env = local_ranks.rank_env(1, 4, 29500)
    assert (env["DS_ACCELERATOR"], env["CUDA_VISIBLE_DEVICES"]) == ("cpu", "")
    assert init.backend_for("auto", env["DS_ACCELERATOR"], cuda_available=True) == "gloo"
    gpu = local_ranks.rank_env(0, 1, 29500, accelerator="cuda")
    assert (gpu["DS_ACCELERATOR"], gpu["CUDA_VISIBLE_DEVICES"]) == ("cuda", "0,1")  # inherited
    with pytest.raises(ValueError, match="accelerator"):
        local_ranks.accelerator_env("gpu")


@pytest.fixture(scope="module")
def gpu_layouts():
    from dsnd.bench import gpu
    from dsnd.layout_search.hardware import DEVICES
    from dsnd.layout_search.search import Problem, plan
    from dsnd.layout_search.source import load

    _, shape, split = load(gpu.MODEL)
    pr = Problem(shape, split, 1, DEVICES["h200"], gpu.SEQ, gpu.MICRO_BATCH, bf16=True)
    return pr, [x for x in plan(pr) if x.micro_batch == gpu.MICRO_BATCH]


def test_validate_names_gloo_and_the_cpu_and_bench_gpu_asks_for_cuda(
    monkeypatch, tmp_path, gpu_layouts
):
    from dsnd.bench import gpu
    from dsnd.layout_search import validate
    from dsnd.layout_search.hardware import DEVICES

    pr, layouts = gpu_layouts
    started = []

    def run_ranks(world, argv, timeout_s, cwd=None, accelerator="cpu"):
        started.append((world, accelerator, [a for a in argv if a.startswith("dist.")]))
        raise Stop

    monkeypatch.setattr(local_ranks, "run_ranks", run_ranks)
    for accelerator in ("cpu", "cuda"):
        with pytest.raises(Stop):
            validate.run_layout(
                gpu.MODEL, pr, layouts[0], 3, str(tmp_path / accelerator), accelerator=accelerator
            )
    assert started == [(1, "cpu", ["dist.backend=gloo"]), (1, "cuda", ["dist.backend=nccl"])]

    asked = []

    def run_layout(*args, **kwargs):
        asked.append(kwargs)
        raise Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu, "_device", lambda: (DEVICES["h200"], "NVIDIA H200"))
    monkeypatch.setattr(validate, "run_layout", run_layout)
    with pytest.raises(Stop):
        gpu.gpu(SimpleNamespace(steps=3), str(tmp_path))
    assert asked[0].get("accelerator") == "cuda"


# 2. CUDA_VISIBLE_DEVICES from the host's selected slots


def test_each_hosts_ranks_see_its_selected_slots_over_any_other_value():
    assert visible_devices_env([1, 3]) == {"CUDA_VISIBLE_DEVICES": "1,3"}
    spec = AgentSpec(
        "h",
        [4, 5],
        8,
        "a",
        1,
        ["py"],
        "/w",
        {"CUDA_VISIBLE_DEVICES": "7", "A": "1"},
        devices=[1, 3],
    )
    assert [spec.rank_env(i)["CUDA_VISIBLE_DEVICES"] for i in (0, 1)] == ["1,3", "1,3"]
    assert AgentSpec.from_line(spec.to_line()) == spec
    bare = AgentSpec("h", [0], 1, "a", 1, ["py"], "/w", {"CUDA_VISIBLE_DEVICES": "7"})
    assert bare.rank_env(0)["CUDA_VISIBLE_DEVICES"] == "7"  # no slots known: left as given
    assert mpirun_devices_env({"a": [0, 1, 2], "b": [0]}) == {"CUDA_VISIBLE_DEVICES": "0,1,2"}


def test_the_launching_shells_value_is_noted_when_the_ranks_will_not_get_it():
    slots = {"h1": [0, 1], "h2": [0, 1]}
    assert ignored_note({}, slots) is None
    assert ignored_note({"CUDA_VISIBLE_DEVICES": ""}, slots) is None
    assert ignored_note({"CUDA_VISIBLE_DEVICES": "0,1"}, slots) is None
    assert "CUDA_VISIBLE_DEVICES=2,3 of this shell is not passed" in ignored_note(
        {"CUDA_VISIBLE_DEVICES": "2,3"}, slots
    )


def test_dsnd_launch_gives_each_agent_its_hosts_slots(tmp_path):
    from dsnd.commands.launch import agent_launches

    args = SimpleNamespace(
        config=None,
        path_sets=[],
        job_id="j",
        master_addr=None,
        master_port=29500,
        cwd=str(tmp_path),
    )
    res = SimpleNamespace(run=SimpleNamespace(dist=SimpleNamespace(timeout_s=60.0)))
    slots = {"h1": [1, 3], "h2": [0]}
    launches = agent_launches(args, slots, res, {}, [])
    assert [(a.spec.ranks, a.spec.devices) for a in launches] == [([0, 1], [1, 3]), ([2], [0])]
    assert launches[1].spec.rank_env(0)["CUDA_VISIBLE_DEVICES"] == "0"


# 3. each NCCL rank's GPU, passed to init_process_group


def test_a_rank_binds_its_local_rank_among_the_devices_it_sees():
    assert [init.cuda_device_index(r, 4) for r in range(4)] == [0, 1, 2, 3]
    assert init.cuda_device_index(3, 1) == 0  # one GPU per task (Slurm --gpus-per-task=1)
    assert init.cuda_device_index(5, 2) == 1
    with pytest.raises(UserError, match="sees no CUDA device"):
        init.cuda_device_index(0, 0)


def test_an_nccl_rank_sets_its_device_and_starts_the_group_eagerly_on_it(monkeypatch, tmp_path):
    monkeypatch.setattr(
        os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("TORCH_")}
    )
    calls = []
    monkeypatch.setattr(init, "resolve_backend", lambda backend: "nccl")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))

    def init_process_group(backend, **kwargs):
        calls.append((backend, kwargs["device_id"]))
        raise Stop

    monkeypatch.setattr(init.dist, "init_process_group", init_process_group)
    info = WorldInfo(3, 4, 3, "127.0.0.1", 1, "env")
    with pytest.raises(Stop):
        init.init_world(info, 60.0, "auto", str(tmp_path))
    gpu0 = torch.device("cuda", 0)
    assert calls == [("set_device", gpu0), ("nccl", gpu0)]
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(
        tmp_path / "logs" / "nccl_trace_rank_"
    )


def test_gloo_binds_no_device(monkeypatch):
    monkeypatch.setattr(os, "environ", dict(os.environ))
    seen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append(d))

    def init_process_group(backend, **kwargs):
        seen.append((backend, kwargs["device_id"]))
        raise Stop

    monkeypatch.setattr(init.dist, "init_process_group", init_process_group)
    with pytest.raises(Stop):
        init.init_world(WorldInfo(0, 2, 0, "127.0.0.1", 1, "env"), 60.0, "gloo")
    assert seen == [("gloo", None)]


def test_the_flight_recorder_is_on_unless_the_user_set_it():
    got = init.flight_recorder_env({}, "/runs/a")
    assert got == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/runs/a/logs/nccl_trace_rank_",
    }
    user = {
        "TORCH_FR_BUFFER_SIZE": "10",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        "TORCH_FR_DUMP_TEMP_FILE": "/t/x",
    }
    assert init.flight_recorder_env(user, "/runs/a") == {}
    assert "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in init.flight_recorder_env({}, None)


# 4. the optimizer trial of the config checks opens no CUDA context


class _Accelerator:
    def __init__(self, name: str) -> None:
        self.name = name

    def device_name(self) -> str:
        return self.name


def test_the_optimizer_trial_builds_cpu_tensors_on_a_cuda_machine(monkeypatch):
    devices = []

    class SpySGD(torch.optim.SGD):
        __module__ = "torch.optim.sgd"  # the checks trial torch's own optimizers

        def step(self, closure=None):
            devices.extend(p.device.type for g in self.param_groups for p in g["params"])
            return super().step(closure)

    # DeepSpeed's accelerator says CUDA, to whoever asks it (dsnd or DeepSpeed)
    monkeypatch.setattr(public.accelerator(), "device_name", lambda *index: "cuda")
    monkeypatch.setattr(torch.optim, "SGD", SpySGD)
    check_optimizer({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, "ds.json")
    assert devices and set(devices) == {"cpu"}
    with pytest.raises(UserError, match="refuses them"):  # torch's own range check still runs
        check_optimizer({"type": "SGD", "params": {"lr": -1.0}}, "ds.json")


def test_flags_whose_answer_depends_on_the_device_are_left_to_the_engine_off_the_cpu():
    params = {"lr": 0.1, "capturable": True, "fused": True}
    assert trial_params(params, "cuda") == {"lr": 0.1}
    assert trial_params(params, "cpu") == params


# 5. a rank the NCCL watchdog aborts (SIGABRT) is named so


def test_a_real_sigabrt_is_named_as_an_nccl_watchdog_abort():
    code = "import os, resource; resource.setrlimit(resource.RLIMIT_CORE, (0, 0)); os.abort()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert proc.returncode == -6
    assert describe_exit(proc.returncode).startswith(f"was killed by SIGABRT: {WATCHDOG}")
    assert describe_exit(134).startswith(f"exited with code 134 (128 + SIGABRT): {WATCHDOG}")
    assert describe_exit(-9) == "was killed by SIGKILL"


def _outcome(rank, code, at):
    return RankOutcome(rank, "h", code, 0.0, False, at)


def test_a_watchdog_abort_comes_after_the_rank_that_failed_by_itself():
    # rank 1 raised (exit 1) while rank 0's NCCL communicator failed a little earlier
    assert (
        diagnose([_outcome(0, -6, 1.0), _outcome(1, 1, 1.2)]) == "rank 1 on host h exited "
        "with code 1"
    )
    assert diagnose([_outcome(0, -9, 2.0), _outcome(1, -6, 1.0)]).endswith("SIGKILL")
    got = diagnose([_outcome(0, 4, 1.0), _outcome(1, -6, 1.5)])
    assert got.startswith(f"rank 1 on host h was killed by SIGABRT: {WATCHDOG}")


# 6. `dsnd ops build` on CUDA: what the JSON will load


def test_ops_build_chooses_the_ops_the_json_needs_on_cuda_and_everything_on_the_cpu():
    from dsnd.commands.ops import DEFAULT_BUILDERS, KNOWN_BUILDERS, ops_for

    lamb = {"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}
    assert ops_for(lamb, "cpu") == (list(DEFAULT_BUILDERS), {})
    build, skipped = ops_for(lamb, "cuda")
    assert build == ["FusedLambBuilder"]
    assert sorted([*build, *skipped]) == sorted(KNOWN_BUILDERS)
    assert skipped["FusedAdamBuilder"] == "not needed: the JSON's optimizer 'Lamb' is FusedLamb"
    assert skipped["AsyncIOBuilder"] == "nothing is offloaded to NVMe"
    assert "CPU accelerator" in skipped["ShareMemCommBuilder"]
    assert ops_for({"optimizer": {"type": "lion"}}, "cuda")[0] == ["FusedLionBuilder"]
    assert ops_for({"optimizer": {"type": "AdamW"}}, "cuda")[0] == ["FusedAdamBuilder"]
    torch_adam = {"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}
    assert ops_for(torch_adam, "cuda")[0] == []
    offload = {
        "optimizer": {"type": "Adam"},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme"},
            "offload_param": {"device": "cpu"},
            "zero_quantized_weights": True,
        },
    }
    assert ops_for(offload, "cuda")[0] == ["CPUAdamBuilder", "AsyncIOBuilder", "QuantizerBuilder"]
    offload["zero_optimization"]["stage"] = 0  # nothing is offloaded without ZeRO
    assert ops_for(offload, "cuda")[0][0] == "FusedAdamBuilder"


def test_ops_build_on_cuda_loads_only_what_the_json_needs_and_says_what_it_skipped(
    monkeypatch, tmp_path, capsys
):
    from dsnd.commands import ops
    from dsnd.engine import compat

    loaded = []

    class Builder:
        def __init__(self, name):
            self.name = name

        def is_compatible(self, verbose=False):
            return True

        def load(self, verbose=False):
            loaded.append(self.name)

    class Cuda(_Accelerator):
        def create_op_builder(self, name):
            return Builder(name)

    path = tmp_path / "ds.json"
    path.write_text('{"optimizer": {"type": "Lamb", "params": {"lr": 0.001}}}')
    monkeypatch.setattr(public, "accelerator", lambda: Cuda("cuda"))
    monkeypatch.setattr(compat, "log_op_builds", lambda: None)
    assert ops.run_build([], str(path)) == 0
    assert loaded == ["FusedLambBuilder"]
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(ops.KNOWN_BUILDERS)
    assert (
        "FusedAdamBuilder     skipped: not needed: the JSON's optimizer 'Lamb' is FusedLamb" in out
    )
    assert out[-1].startswith("FusedLambBuilder     ready (FusedLambBuilder, ")


# 7. ZeRO++ qwZ / qgZ by the accelerator's quantizer op


def test_quantized_switches_are_refused_only_where_the_quantizer_cannot_build():
    cpu = ds_quantized.quantized_refusals("cpu", "This op had not been implemented on CPU backend.")
    assert cpu["zero_quantized_weights"] == (
        "ZeRO++ quantized weights (qwZ) need DeepSpeed's quantizer op (QuantizerBuilder), which "
        "its CPU accelerator does not implement (DeepSpeed: 'This op had not been implemented on "
        "CPU backend.'); not supported by dsnd"
    )
    assert set(cpu) == {"zero_quantized_weights", "zero_quantized_gradients"}
    assert ds_quantized.quantized_refusals("cuda", None) == {}
    assert (
        "cuda accelerator cannot build here (no nvcc)"
        in ds_quantized.quantized_refusals("cuda", "no nvcc")["zero_quantized_gradients"]
    )


def test_quantized_switches_pass_the_key_check_where_the_quantizer_builds(monkeypatch):
    ds = {
        "zero_optimization": {
            "stage": 3,
            "zero_quantized_weights": True,
            "zero_quantized_gradients": True,
        }
    }
    with pytest.raises(UserError, match="its CPU accelerator does not implement"):
        deepspeed_json._check_sections(ds, "ds.json")  # this machine's CPU accelerator
    monkeypatch.setattr(public, "accelerator", lambda: _Accelerator("cuda"))
    monkeypatch.setattr(ds_quantized, "quantizer_problem", lambda: None)
    deepspeed_json._check_sections(ds, "ds.json")
