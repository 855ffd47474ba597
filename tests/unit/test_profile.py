"""Measured partitioning (`dsnd.plan.profile`): the exact balancer against brute force, the
layer measurements of a tiny model, the per-host cache (corrupt files, racing processes) and the
cache key."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import random
import time
from itertools import pairwise

import pytest
import torch

from dsnd.errors import UserError
from dsnd.model import layer_specs
from dsnd.plan.profile import (
    LayerCost,
    balance,
    cached_costs,
    measure_layers,
    profile_key,
    profile_partition,
)
from tests.models import spec_of

torch.set_num_threads(1)


# ---------------------------------------------------------------------------- balance


def _brute_force(seconds, memory, stages, cap):
    """Every split, best first by (slowest stage, sum of squared stage times, parts)."""
    n = len(seconds)
    found = []
    for cuts in itertools.combinations(range(1, n), stages - 1):
        parts = [0, *cuts, n]
        spans = list(pairwise(parts))
        if cap is not None and any(sum(memory[a:b]) > cap for a, b in spans):
            continue
        times = [sum(seconds[a:b]) for a, b in spans]
        found.append((max(times), sum(t * t for t in times), parts))
    return min(found) if found else None


def _cases(seed, count, integer_times):
    rng = random.Random(seed)
    for _ in range(count):
        n = rng.randint(1, 8)
        stages = rng.randint(1, min(4, n))
        if integer_times:
            seconds = [float(rng.randint(0, 9)) for _ in range(n)]
        else:
            seconds = [rng.uniform(0.001, 1.0) for _ in range(n)]
        memory = [rng.randint(0, 100) for _ in range(n)]
        cap = rng.choice([None, rng.randint(0, 300)])
        yield seconds, memory, stages, cap


def _stage_sums(values, parts):
    return [sum(values[a:b]) for a, b in pairwise(parts)]


def test_balance_is_exact_on_integer_times():
    """Integer times make every sum exact: the same split as brute force, tie-breaks included."""
    checked = 0
    for seconds, memory, stages, cap in _cases(0, 400, integer_times=True):
        best = _brute_force(seconds, memory, stages, cap)
        if best is None:
            with pytest.raises(UserError):
                balance(seconds, memory, stages, cap)
            continue
        assert balance(seconds, memory, stages, cap) == best[2], (seconds, memory, stages, cap)
        checked += 1
    assert checked > 200


def test_balance_reaches_the_least_slowest_stage_on_random_times():
    for seconds, memory, stages, cap in _cases(1, 400, integer_times=False):
        best = _brute_force(seconds, memory, stages, cap)
        if best is None:
            continue
        parts = balance(seconds, memory, stages, cap)
        assert len(parts) == stages + 1 and parts[0] == 0 and parts[-1] == len(seconds)
        assert all(a < b for a, b in pairwise(parts)), parts  # every stage non-empty
        if cap is not None:
            assert max(_stage_sums(memory, parts)) <= cap
        assert max(_stage_sums(seconds, parts)) == pytest.approx(best[0], abs=1e-12)


def test_balance_is_deterministic():
    for seconds, memory, stages, cap in _cases(2, 50, integer_times=False):
        try:
            first = balance(seconds, memory, stages, cap)
        except UserError:
            continue
        assert all(balance(list(seconds), list(memory), stages, cap) == first for _ in range(3))


def test_a_large_head_gets_a_stage_of_its_own():
    seconds = [1, 1, 1, 1, 1, 8]
    assert balance(seconds, [0] * 6, 2, None) == [0, 5, 6]
    parts = balance(seconds, [0] * 6, 3, None)
    assert parts == [0, 2, 5, 6]  # the head alone, the rest even, earliest boundaries on a tie


def test_the_memory_cap_moves_boundaries():
    seconds, memory = [1.0, 1.0, 1.0, 1.0], [10, 10, 10, 40]
    assert balance(seconds, memory, 2, None) == [0, 2, 4]
    assert balance(seconds, memory, 2, 50) == [0, 2, 4]  # the last stage needs exactly 50
    assert balance(seconds, memory, 2, 49) == [0, 3, 4]


def test_nothing_fits_the_cap_names_the_key_and_numbers():
    gib = 2**30
    with pytest.raises(UserError) as e:
        balance([1.0, 1.0, 1.0], [3 * gib, 3 * gib, 3 * gib], 2, 4 * gib)
    message = str(e.value)
    assert "parallel.profile_memory_cap_gb=4" in message
    assert "6 GiB" in message  # the best split: [3] [3, 3]
    assert "\n" not in message


def test_more_stages_than_layers_is_a_user_error():
    with pytest.raises(UserError, match="parallel.pp=4.*3 layers"):
        balance([1.0, 1.0, 1.0], [0, 0, 0], 4, None)


def test_balance_handles_a_few_hundred_layers_quickly():
    rng = random.Random(3)
    seconds = [rng.uniform(0.5, 1.5) for _ in range(200)]
    start = time.perf_counter()
    parts = balance(seconds, [1] * 200, 8, 30)
    assert time.perf_counter() - start < 5
    assert max(_stage_sums([1] * 200, parts)) <= 30


# ---------------------------------------------------------------------------- measuring


def test_measure_layers_of_a_tiny_model():
    model = spec_of("llama-tiny")
    costs = measure_layers(model, seq_len=16, micro=2, repeats=1)
    assert len(costs) == len(layer_specs(model)) == model.num_layers + 3
    assert all(c.seconds > 0 and c.memory_bytes > 0 for c in costs)
    # parameters: 16 bytes each; the embedding saves only its token ids (2 x 16 int64)
    assert costs[0].memory_bytes == 16 * model.vocab_size * model.hidden_size + 2 * 16 * 8
    assert costs[-1].memory_bytes > 16 * model.vocab_size * model.hidden_size
    assert len({c.memory_bytes for c in costs[1:-2]}) == 1  # the blocks are alike


def test_a_tied_head_is_timed_but_owns_no_parameters():
    model = spec_of("gpt2-tiny")
    assert model.tie_embeddings
    costs = measure_layers(model, seq_len=16, micro=2, repeats=1)
    assert costs[-1].seconds > 0
    logits = 2 * 16 * model.vocab_size * 4  # the fp32 logits the loss saves
    assert logits <= costs[-1].memory_bytes < 16 * model.vocab_size * model.hidden_size


def test_a_large_vocabulary_makes_the_head_the_slowest_layer():
    model = spec_of("llama-tiny", vocab_size=8192, hidden_size=32, num_layers=2)
    costs = measure_layers(model, seq_len=64, micro=4, repeats=3)
    seconds = [c.seconds for c in costs]
    assert max(seconds) == seconds[-1], seconds
    assert balance(seconds, [c.memory_bytes for c in costs], 2, None)[1] == len(costs) - 1


# ---------------------------------------------------------------------------- caching


COSTS = [LayerCost(0.5, 10), LayerCost(1.25, 20)]


def test_the_second_call_reads_the_cache(tmp_path):
    calls = []

    def measure():
        calls.append(1)
        return COSTS

    assert cached_costs(str(tmp_path), "k", measure) == COSTS
    assert cached_costs(str(tmp_path), "k", measure) == COSTS
    assert len(calls) == 1
    assert cached_costs(str(tmp_path), "other", measure) == COSTS
    assert len(calls) == 2


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "[]",
        '{"format": 1, "key": "k", "layers": []}',
        '{"format": 1, "key": "k", "layers": [{"seconds": -1, "memory_bytes": 3}]}',
        '{"format": 1, "key": "j", "layers": [{"seconds": 1, "memory_bytes": 3}]}',
    ],
)
def test_a_corrupt_cache_file_is_measured_again(tmp_path, caplog, text):
    (tmp_path / "k.json").write_text(text)
    calls = []

    def measure():
        calls.append(1)
        return COSTS

    with caplog.at_level("WARNING"):
        assert cached_costs(str(tmp_path), "k", measure) == COSTS
    assert len(calls) == 1
    assert "measuring again" in caplog.text
    assert cached_costs(str(tmp_path), "k", measure) == COSTS  # the file was replaced
    assert len(calls) == 1
    assert json.loads((tmp_path / "k.json").read_text())["layers"][1] == COSTS[1].to_json()


def _slow_measure(count_file: str) -> list[LayerCost]:
    with open(count_file, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(0.5)  # the others arrive meanwhile
    return [LayerCost(float(os.getpid()), os.getpid())]  # differs from process to process


def _race(cache_dir: str, count_file: str, barrier, results) -> None:
    barrier.wait()
    costs = cached_costs(cache_dir, "race", lambda: _slow_measure(count_file))
    results.put([c.to_json() for c in costs])


def test_racing_processes_measure_once(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    count_file = str(tmp_path / "measured")
    workers = 2  # each spawned process imports torch and DeepSpeed: seconds
    barrier, results = ctx.Barrier(workers), ctx.Queue()
    procs = [
        ctx.Process(target=_race, args=(str(tmp_path / "cache"), count_file, barrier, results))
        for _ in range(workers)
    ]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    with open(count_file) as f:
        assert len(f.readlines()) == 1
    assert all(g == got[0] for g in got)


# ---------------------------------------------------------------------------- key


def test_profile_key_follows_what_changes_the_costs():
    model = spec_of("llama-tiny")
    key = profile_key(model, 16, 2, "float32")
    assert key == profile_key(spec_of("llama-tiny"), 16, 2, "float32")
    assert len(key) == 64 and int(key, 16) >= 0
    others = {
        profile_key(model, 32, 2, "float32"),
        profile_key(model, 16, 4, "float32"),
        profile_key(model, 16, 2, "bfloat16"),
        profile_key(model, 16, 2, "float32", "cuda:NVIDIA H100"),
        profile_key(spec_of("llama-tiny", hidden_size=32), 16, 2, "float32"),
        profile_key(spec_of("llama-tiny", num_layers=2), 16, 2, "float32"),
        profile_key(spec_of("llama-tiny", vocab_size=512), 16, 2, "float32"),
    }
    assert key not in others and len(others) == 7


def test_profile_key_ignores_where_the_model_lives(tmp_path):
    model = spec_of("llama-tiny")
    moved = type(model)(model.family, model.config, str(tmp_path), directory=str(tmp_path))
    assert profile_key(moved, 16, 2, "float32") == profile_key(model, 16, 2, "float32")


def test_profile_partition_measures_once_and_balances(tmp_path):
    model = spec_of("llama-tiny", num_layers=2)
    parts, costs = profile_partition(model, 8, 1, 2, str(tmp_path), None, repeats=1)
    assert len(costs) == 5 and parts[0] == 0 and parts[-1] == 5 and len(parts) == 3
    assert len(list(tmp_path.glob("*.json"))) == 1
    again, cached = profile_partition(model, 8, 1, 2, str(tmp_path), None, repeats=1)
    assert (again, cached) == (parts, costs)


def test_layers_are_measured_where_the_run_computes():
    """`parallel.partition: profile` measures on the rank's own GPU where the run uses CUDA (not
    GPU 0 for every rank), on the CPU where CUDA is absent or DeepSpeed's accelerator is the
    CPU; in the JSON's precision (`DTYPES` by `dsnd.config.summary.precision`)."""
    from dsnd.plan.profile import DTYPES, target_device

    assert target_device({"LOCAL_RANK": "3"}, cuda_available=False) == "cpu"
    assert target_device({"DS_ACCELERATOR": "cpu", "LOCAL_RANK": "1"}, cuda_available=True) == "cpu"
    assert DTYPES == {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
