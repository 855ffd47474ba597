"""dsnd.plan.partition: the same stages as DeepSpeed's PipelineModule, and clear refusals.

The reference is DeepSpeed's own `PipelineModule._partition_layers` (with its `_count_layer_params`
and `_find_layer_type`), run on the very same specs. A real `PipelineModule` cannot be built for
pp > 1 in one process: its `PipelineParallelGrid` asserts that the topology covers the world, so
a world of 1 only admits pp=1. The module is therefore made without `__init__`, given the four
attributes `_partition_layers` reads, and partitioned by DeepSpeed's unmodified method.
"""

from __future__ import annotations

import contextlib
import functools
import io

import pytest
import torch
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
from deepspeed.runtime.utils import partition_balanced as ds_balanced
from deepspeed.runtime.utils import partition_uniform as ds_uniform
from torch import nn

from dsnd.engine.pipe import deepspeed_specs
from dsnd.errors import UserError
from dsnd.model.layer_spec import LayerSpec
from dsnd.model.stack import layer_specs
from dsnd.plan.boundaries import partition_balanced, partition_uniform
from dsnd.plan.partition import (
    layer_param_counts,
    layer_type_names,
    partition,
    stage_layers,
)
from tests.models import spec_of

torch.set_num_threads(1)

METHODS = ["uniform", "parameters", "type:block", "type:embedding", "type:norm|head", "Uniform"]
# llama-tiny with a 4096-token vocabulary: embedding and head (262144 each) outweigh a block.
BIG_VOCAB = spec_of("llama-tiny", vocab_size=4096)
SPECS = {name: layer_specs(spec_of(name)) for name in ("llama-tiny", "gpt2-tiny")}
SPECS["llama-tiny-vocab4096"] = layer_specs(BIG_VOCAB)


def deepspeed_parts(specs, num_stages: int, method: str) -> list[int]:
    """`PipelineModule.parts` for `specs`, computed by DeepSpeed's own `_partition_layers`."""
    module = PipelineModule.__new__(PipelineModule)
    nn.Module.__init__(module)
    module._layer_specs = deepspeed_specs(specs)
    module.num_stages = num_stages
    module._topo = PipeDataParallelTopology(num_pp=num_stages, num_dp=1)
    module.global_rank = 0  # rank 0 = stage 0; it also prints the split, silenced below
    module.loss_fn = None
    with contextlib.redirect_stdout(io.StringIO()):
        module._partition_layers(method=method)
    return [int(p) for p in module.parts]


CASES = [(name, pp) for name, specs in SPECS.items() for pp in range(1, len(specs) + 1)]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("name", "pp"), CASES)
def test_parts_equal_deepspeed(name, pp, method):
    specs = SPECS[name]
    parts = partition(method, specs, pp)
    assert parts == deepspeed_parts(specs, pp, method)
    assert len(parts) == pp + 1 and parts[0] == 0 and parts[-1] == len(specs)
    assert all(parts[s] < parts[s + 1] for s in range(pp)), "every stage holds a layer"
    assert all(type(p) is int for p in parts)


@pytest.mark.parametrize("name", list(SPECS))
def test_param_counts_equal_deepspeed(name):
    specs = SPECS[name]
    module = PipelineModule.__new__(PipelineModule)
    nn.Module.__init__(module)
    module._layer_specs = deepspeed_specs(specs)
    assert layer_param_counts(specs) == module._count_layer_params()


def test_boundaries_are_deepspeeds_own():
    """dsnd's partition arithmetic (no DeepSpeed needed to import the Plan) against DeepSpeed's
    on random weights, ties included (small integers repeat)."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(300):
        n = int(torch.randint(1, 14, (1,), generator=gen))
        parts = int(torch.randint(1, 9, (1,), generator=gen))
        high = 4 if trial % 2 else 10**6
        weights = torch.randint(0, high, (n,), generator=gen).tolist()
        assert partition_balanced(weights, parts) == [int(p) for p in ds_balanced(weights, parts)]
        assert partition_uniform(n, parts) == ds_uniform(n, parts)


def test_llama_tiny_counts_and_parameter_splits():
    specs = SPECS["llama-tiny"]
    # embedding 256*64; block: attention q,o 64*64 each + k,v 64*32 each (2 kv heads of 16)
    # = 12288, MLP 3*64*176 = 33792, two RMSNorms 128 -> 46208; final norm 64; head 64*256.
    assert layer_param_counts(specs) == [16384, 46208, 46208, 46208, 46208, 64, 16384]
    # pp=2: 16384 + 2*46208 = 108800 | 2*46208 + 64 + 16384 = 108864
    assert partition("parameters", specs, 2) == [0, 3, 7]
    # pp=4: the tiny embedding rides with block 0 (62592), blocks 1 and 2 alone (46208 each),
    # block 3 + norm + head 62656: the embedding is too small to earn a stage of its own.
    assert partition("parameters", specs, 4) == [0, 2, 3, 4, 7]
    assert partition("uniform", specs, 4) == [0, 2, 4, 6, 7]


def test_big_embedding_and_head_get_their_own_stages():
    specs = SPECS["llama-tiny-vocab4096"]
    assert layer_param_counts(specs) == [262144, 46208, 46208, 46208, 46208, 64, 262144]
    # pp=3: 262144 | 4*46208 + 64 = 184896 | 262144 — embedding and head each alone.
    assert partition("parameters", specs, 3) == [0, 1, 6, 7]
    # pp=4: 262144 | 92416 | 92480 | 262144.
    assert partition("parameters", specs, 4) == [0, 1, 3, 6, 7]


def test_gpt2_tied_layer_counts_its_module_at_both_positions():
    specs = SPECS["gpt2-tiny"]
    counts = layer_param_counts(specs)
    # wte 256*64 + wpe 128*64 = 24576 at the embedding AND at the tied head, which owns none of
    # it: DeepSpeed builds every LayerSpec, TiedLayerSpec included, when counting.
    assert counts[0] == counts[-1] == 24576
    assert counts[1:-1] == [49984] * 4 + [128]


def test_type_names_mirror_deepspeed():
    assert layer_type_names(SPECS["llama-tiny"]) == (
        ["TokenEmbedding"] + ["LlamaBlock"] * 4 + ["LlamaRMSNormFinal", "LMHead"]
    )
    # The tied head is named after its module class, not after its forward_fn.
    assert layer_type_names(SPECS["gpt2-tiny"]) == (
        ["Embedding"] + ["Block"] * 4 + ["LayerNormFinal", "Embedding"]
    )


def double(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


def test_modules_and_callables_as_deepspeed_treats_them():
    specs = [
        LayerSpec(nn.Linear, 2, 3),
        nn.ReLU(),
        double,
        functools.partial(double),  # no __name__: DeepSpeed skips it when matching types
        nn.Linear(3, 1),
    ]
    assert layer_type_names(specs) == ["Linear", "ReLU", "double", None, "Linear"]
    assert layer_param_counts(specs) == [9, 0, 0, 0, 4]
    for method in ["parameters", "type:linear", "type:relu|double", "type:.*"]:
        for pp in (1, 2, 3):
            assert partition(method, specs, pp) == deepspeed_parts(specs, pp, method), method


class RecordsDevice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(1000, 1000)
        RecordsDevice.device = self.lin.weight.device


def test_counting_builds_on_meta():
    assert layer_param_counts([LayerSpec(RecordsDevice)]) == [1_001_000]
    assert RecordsDevice.device == torch.device("meta")


def test_seven_billion_shaped_model_counts_without_memory():
    dims = spec_of(
        "llama-tiny",
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        ffn_size=11008,
        vocab_size=32000,
    )
    counts = layer_param_counts(layer_specs(dims))
    block = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    assert counts == [32000 * 4096] + [block] * 32 + [4096, 32000 * 4096]
    assert sum(counts) == 6_738_415_616  # Llama-2-7B


@pytest.mark.parametrize(
    ("method", "pp", "parts"),
    [
        ([0, 3, 7], 2, [0, 3, 7]),
        ((0, 1, 2, 3, 4, 5, 6, 7), 7, [0, 1, 2, 3, 4, 5, 6, 7]),
        ([0, 7], 1, [0, 7]),
        ([[0, 1, 2], [3, 4, 5, 6]], 2, [0, 3, 7]),
        ([[0], [1, 2, 3, 4, 5], [6]], 3, [0, 1, 6, 7]),
        ([list(range(7))], 1, [0, 7]),
    ],
)
def test_explicit_lists_accepted(method, pp, parts):
    assert partition(method, SPECS["llama-tiny"], pp) == parts


@pytest.mark.parametrize(
    ("method", "pp", "expected"),
    [
        ([0, 3], 2, ["parallel.partition=[0, 3]", "2 boundaries", "parallel.pp=2", "needs 3"]),
        ([1, 3, 7], 2, ["start at 0", "end at 7"]),
        ([0, 3, 6], 2, ["end at 7"]),
        ([0, 3, 3, 7], 3, ["rise strictly", "stage 1", "3..2"]),
        ([0, 5, 3, 7], 3, ["rise strictly", "stage 1", "5..2"]),
        ([[0, 1, 2], [3, 4, 5, 6]], 3, ["lists 2 stages", "parallel.pp=3"]),
        ([[0, 1], [3, 4, 5, 6]], 2, ["layers [2] are in no stage"]),
        ([[0, 1, 2], [3, 4, 5]], 2, ["layers [6] are in no stage"]),
        ([[0, 1, 2], [2, 3, 4, 5, 6]], 2, ["layer 2 is in stages 0 and 1"]),
        ([[0, 1, 1, 2], [3, 4, 5, 6]], 2, ["layer 1 is twice in stage 0"]),
        ([[0, 1, 2], [3, 4, 5, 6, 7]], 2, ["layer 7 does not exist", "0..6"]),
        ([[0, 2, 1], [3, 4, 5, 6]], 2, ["stage 0", "contiguous run 0..2"]),
        ([[0, 1, 2, 4], [3, 5, 6]], 2, ["stage 0", "contiguous run 0..3"]),
        ([[3, 4, 5, 6], [0, 1, 2]], 2, ["stage 0", "contiguous run 0..3"]),
        ([[0, 1, 2], []], 2, ["stage 1 must be a non-empty list"]),
        ([0, [1], 7], 2, ["must be uniform, parameters, profile, type:<regex>"]),
        ([0, 3.5, 7], 2, ["must be uniform"]),
        ([], 1, ["must be uniform"]),
        (3, 1, ["parallel.partition=3 must be"]),
    ],
)
def test_explicit_lists_rejected(method, pp, expected):
    with pytest.raises(UserError) as err:
        partition(method, SPECS["llama-tiny"], pp)
    message = str(err.value)
    assert "\n" not in message
    for part in expected:
        assert part in message


@pytest.mark.parametrize(
    ("method", "pp", "expected"),
    [
        ("uniform", 8, ["parallel.pp=8", "7 pipeline layers", "parallel.partition='uniform'"]),
        ([0, 1, 2, 3, 4, 5, 6, 7, 7], 8, ["parallel.pp=8", "7 pipeline layers"]),
        ("parameters", 0, ["parallel.pp=0", "positive"]),
        ("unifrom", 2, ["parallel.partition='unifrom'", "did you mean 'uniform'"]),
        ("parameter", 2, ["did you mean 'parameters'"]),
        ("typ:Block", 2, ["did you mean 'type:Block'"]),
        ("profil", 2, ["'profil' is not a method", "did you mean 'profile'"]),
        ("type:(block", 2, ["parallel.partition='type:(block'", "bad regex '(block'"]),
        ("type:conv", 2, ["matches none", "TokenEmbedding, LlamaBlock, LlamaRMSNormFinal, LMHead"]),
        ("type:block:x", 2, ["may not contain ':'", "match 'block'"]),
        ("type:(?:block)", 2, ["may not contain ':'"]),
        (r"type:\S+Block", 2, [r"\S would mean \s"]),
    ],
)
def test_named_method_errors(method, pp, expected):
    with pytest.raises(UserError) as err:
        partition(method, SPECS["llama-tiny"], pp)
    message = str(err.value)
    assert "\n" not in message
    for part in expected:
        assert part in message


def test_type_regex_ignores_case_like_deepspeed():
    specs = SPECS["llama-tiny"]
    for method in ["type:LLAMABLOCK", "TYPE:llamablock", "type:^llama.*k$", r"type:\\?block"]:
        assert partition(method, specs, 3) == deepspeed_parts(specs, 3, method), method


def test_stage_layers():
    parts = [0, 2, 3, 4, 7]
    assert [stage_layers(parts, s) for s in range(4)] == [[0, 1], [2], [3], [4, 5, 6]]
    with pytest.raises(ValueError, match="stage 4 out of range for 4 stages"):
        stage_layers(parts, 4)
    with pytest.raises(ValueError):
        stage_layers(parts, -1)
