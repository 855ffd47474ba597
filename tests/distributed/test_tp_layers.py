"""dsnd's tensor-parallel layers on 2 and 4 real gloo ranks (tp = world) against torch.nn.

One set of ranks per world size (tests/distributed/tp_worker.py) runs every case: outputs, input
gradients and each rank's parameter-gradient slice against a single-process reference built from
the same full weights, and the collectives each forward and backward issues.
"""

from __future__ import annotations

import json

import pytest

from tests.procs import run_ranks

WORLDS = [2, 4]
ATOL = 1e-5
VOCAB = 249


@pytest.fixture(scope="module", params=WORLDS, ids=[f"tp{w}" for w in WORLDS])
def found(request, tmp_path_factory) -> tuple[int, dict]:
    world = request.param
    out = tmp_path_factory.mktemp(f"tp{world}") / "out.json"
    run_ranks(world, ["tests/distributed/tp_worker.py", str(out)], timeout=120)
    return world, json.loads(out.read_text())


def rows(found, case: str) -> list[dict]:
    world, results = found
    assert len(results[case]) == world
    return results[case]


def assert_close(row: dict, keys: list[str], where) -> None:
    for key in keys:
        assert row[key] < ATOL, (where, key, row[key])


MLP_KEYS = ["out", "x_grad", "col_weight_grad", "col_bias_grad", "row_weight_grad", "row_bias_grad"]


@pytest.mark.dist
@pytest.mark.parametrize("case", ["mlp", "mlp_sp", "mlp_gather_scatter"])
def test_column_row_mlp_matches_reference(found, case):
    world, _ = found
    for rank, row in enumerate(rows(found, case)):
        assert_close(row, MLP_KEYS, (case, rank))
        # each rank holds 1/tp of the hidden features: rows of fc1, columns of fc2
        assert row["shapes"]["col_weight"] == [16 // world, 8]
        assert row["shapes"]["row_weight"] == [8, 16 // world]
        seq = 8 // world if case == "mlp_sp" else 8
        assert row["shapes"]["y"] == [2, seq, 8]


@pytest.mark.dist
def test_parallel_parameters_are_marked_for_deepspeed(found):
    for case in ("mlp", "mlp_sp"):
        for row in rows(found, case):
            attrs = row["attrs"]
            assert attrs["col_weight"] == [True, 0]
            assert attrs["col_bias"] == [True, 0]
            assert attrs["row_weight"] == [True, 1]
            assert attrs["row_bias_split"] is False  # replicated, added once after the reduction
            assert attrs["row_bias_sp"] is (case == "mlp_sp")
    for row in rows(found, "embedding"):
        assert row["weight_attrs"] == [True, 0]


@pytest.mark.dist
def test_sequence_parallel_bias_gradient_is_partial_until_reduced(found):
    """Under SP each rank adds the row bias to its own tokens only: its gradient is a partial sum
    (far from the reference) until allreduce_partial_grads sums it over the group."""
    for row in rows(found, "mlp_sp"):
        assert row["row_bias_grad_before_sp_reduce"] > 0.1
        assert row["row_bias_grad"] < ATOL


# Collectives of one column -> row block, forward then backward (the worker counts calls of
# torch.distributed.all_reduce / all_gather_into_tensor / reduce_scatter_tensor / all_gather):
# - plain (Megatron's f ... g): forward  f = identity, g = 1 all-reduce of the block output;
#                               backward g = identity, f = 1 all-reduce of the input gradient.
# - sequence parallel: f becomes an all-gather along the sequence and g a reduce-scatter, and
#   the backward mirrors them: the reduce-scatter's adjoint is an all-gather of the output
#   gradient, the all-gather's adjoint a reduce-scatter of the input gradient. No all-reduce
#   (the SP bias reduction is a separate, once-per-step call, outside this count).
# - gather_output then input_is_parallel=False: forward all-gathers the column output, splits it
#   (no collective) and all-reduces the row output; backward all-gathers the split's gradient
#   and all-reduces the input gradient (f), the gather's adjoint being a plain split.
BLOCK_CALLS = {
    "mlp": ({"all_reduce": 1}, {"all_reduce": 1}),
    "mlp_sp": (
        {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1},
        {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1},
    ),
    "mlp_gather_scatter": (
        {"all_gather_into_tensor": 1, "all_reduce": 1},
        {"all_gather_into_tensor": 1, "all_reduce": 1},
    ),
    # embedding: g after the masked lookup; its backward is the identity (or, with SP, the
    # reduce-scatter's adjoint all-gather)
    "embedding": ({"all_reduce": 1}, {}),
    "embedding_sp": ({"reduce_scatter_tensor": 1}, {"all_gather_into_tensor": 1}),
    # cross-entropy: max, then [sum of exp, target logit] together; backward is local
    "cross_entropy": ({"all_reduce": 2}, {}),
    # a whole transformer block = attention (f ... g) + MLP (f ... g): Megatron's 2 all-reduces
    # forward and 2 backward; with SP 2 all-gathers + 2 reduce-scatters each way
    **{f"{family}_block": ({"all_reduce": 2}, {"all_reduce": 2}) for family in ("llama", "gpt2")},
    **{
        f"{family}_block_sp": (
            {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2},
            {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2},
        )
        for family in ("llama", "gpt2")
    },
}


@pytest.mark.dist
@pytest.mark.parametrize("case", list(BLOCK_CALLS))
def test_collective_counts(found, case):
    forward, backward = BLOCK_CALLS[case]
    for rank, row in enumerate(rows(found, case)):
        assert row["forward_calls"] == forward, (case, rank)
        assert row["backward_calls"] == backward, (case, rank)


@pytest.mark.dist
@pytest.mark.parametrize("case", ["embedding", "embedding_sp"])
def test_vocab_parallel_embedding_matches_reference(found, case):
    world, _ = found
    padded = -(-VOCAB // world) * world
    assert padded > VOCAB  # 249 is padded at both tp sizes
    local = padded // world
    for rank, row in enumerate(rows(found, case)):
        assert row["padded_vocab"] == padded
        assert row["rows"] == [rank * local, (rank + 1) * local]
        # the weight gradient is compared over the padded slice: padding rows must stay zero
        assert_close(row, ["out", "weight_grad"], (case, rank))


@pytest.mark.dist
def test_vocab_parallel_cross_entropy_matches_reference(found):
    world, _ = found
    for rank, row in enumerate(rows(found, "cross_entropy")):
        assert row["shard_width"] == -(-VOCAB // world)
        assert row["loss"] == pytest.approx(row["loss_ref"], abs=ATOL), rank
        assert row["logits_grad"] < 1e-7, rank


@pytest.mark.dist
@pytest.mark.parametrize("case", ["llama_block", "llama_block_sp", "gpt2_block", "gpt2_block_sp"])
def test_transformer_blocks_match_the_unsplit_block(found, case):
    """Blocks split by their family's TP plan (Llama with grouped-query attention, GPT-2 with
    fused q|k|v) initialised from the same seed as the unsplit block: same names, same outputs
    and gradients (each rank's parameter gradient = its shard of the full one; replicated ones
    whole)."""
    for rank, row in enumerate(rows(found, case)):
        assert row["names_equal"], (case, rank)
        assert_close(row, ["out", "x_grad", "param_grads"], (case, rank))
