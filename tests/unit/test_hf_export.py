"""`export_hf` streams: a safetensors file written one tensor at a time is byte for byte
`save_file`'s; the plan sends each piece once, in layer order; and an export holds at most one
layer at a time (a one-rank gloo group in this process, every tensor's bytes counted), while
writing the same files as `write_hf_dir` of the whole state dict."""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch._C._distributed_c10d import ProcessGroup
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dsnd.model import build_model, hf_export
from dsnd.model.export_dir import ExportOrigin
from dsnd.model.hf_export import Piece, export_hf, make_plan, stage_layers, stream
from dsnd.model.hf_io import write_hf_dir
from dsnd.model.safetensors_stream import StreamedSafetensors
from dsnd.tp import Shard
from tests.models import spec_of
from tests.one_rank import one_rank_world

torch.set_num_threads(1)


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "b.weight": torch.randn(3, 5, generator=gen),
        "a": torch.randn(7, generator=gen).bfloat16(),
        "c": torch.randn(2, 2, generator=gen).half(),
        "z": torch.randn(1, generator=gen).double(),
        "i": torch.arange(3),
        "u": torch.arange(5, dtype=torch.uint8),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.0),
    }


@pytest.mark.parametrize("metadata", [{"format": "pt"}, None])
def test_a_streamed_file_is_save_files_byte_for_byte(tmp_path, metadata):
    tensors = _tensors()
    save_file(tensors, tmp_path / "whole", metadata=metadata)
    specs = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    with StreamedSafetensors(str(tmp_path / "streamed"), specs, metadata) as out:
        for name in reversed(list(tensors)):  # any order
            out.write(name, tensors[name])
    assert (tmp_path / "streamed").read_bytes() == (tmp_path / "whole").read_bytes()


def test_a_streamed_file_refuses_a_wrong_twice_written_or_missing_tensor(tmp_path):
    specs = {"a": (torch.float32, (2,)), "b": (torch.float32, (3,))}
    with pytest.raises(ValueError, match="b: never written|1 tensors never written, e.g. b"):
        with StreamedSafetensors(str(tmp_path / "f"), specs) as out:
            with pytest.raises(ValueError, match=r"a: torch.float16 \[2\], declared"):
                out.write("a", torch.zeros(2, dtype=torch.float16))
            out.write("a", torch.zeros(2))
            with pytest.raises(ValueError, match="written twice"):
                out.write("a", torch.zeros(2))


def _piece(name, layer, rank, shard=None, position=0):
    return Piece(name, (layer, position), rank, (4, 2), torch.float32, shard)


def test_the_plan_sends_each_piece_once_in_layer_order():
    """A whole tensor held on two tensor-parallel ranks comes from the lower; a split one from
    each shard's lowest holder; names in (layer, position) order, whatever rank offered them."""
    col = [Shard(0, r, 2, 8) for r in range(2)]
    every = [
        [_piece("layers.0.w", 0, 0, col[0]), _piece("layers.0.norm", 0, 0, position=1)],
        [_piece("layers.0.w", 0, 1, col[1]), _piece("layers.0.norm", 0, 1, position=1)],
        [_piece("layers.1.w", 1, 2, col[0]), _piece("layers.1.e", 1, 2, col[0], 1)],
        [_piece("layers.1.w", 1, 3, col[1]), _piece("layers.1.e", 1, 3, col[1], 1)],
        [_piece("layers.1.e", 1, 4, col[0], 1)],  # another replica's copy of an expert shard
    ]
    plan = make_plan(every[::-1])
    assert list(plan) == ["layers.0.w", "layers.0.norm", "layers.1.w", "layers.1.e"]
    assert {name: [p.rank for p in pieces] for name, pieces in plan.items()} == {
        "layers.0.w": [0, 1],
        "layers.0.norm": [0],
        "layers.1.w": [2, 3],
        "layers.1.e": [2, 3],
    }
    assert plan["layers.0.w"][0].full_shape == (8, 2)
    with pytest.raises(ValueError, match="layers.0.w: 1 of its 2 shards"):
        make_plan([every[0]])


class LiveBytes(TorchDispatchMode):
    """The most bytes of tensors created inside the block that were alive at once (storages
    counted once, however many views of them; the model's own parameters not counted)."""

    def __init__(self, exclude: set[int]) -> None:
        super().__init__()
        self.exclude, self.peak = exclude, 0
        self.live: dict[int, tuple[list[weakref.ref], int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if storage.data_ptr() not in self.exclude and storage.nbytes():
                    refs, _ = self.live.setdefault(storage.data_ptr(), ([], storage.nbytes()))
                    refs.append(weakref.ref(t))
        self.live = {
            ptr: (refs, n)
            for ptr, (refs, n) in self.live.items()
            if any(r() is not None for r in refs)
        }
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


_CALLS = ("allgather", "gather", "broadcast", "allreduce", "send", "recv", "scatter", "alltoall")


@pytest.fixture
def payloads(monkeypatch) -> list[tuple[str, int]]:
    """(operation, bytes of its tensors) of every communication call this process makes: every
    `torch.distributed` function, object ones included, ends in a `ProcessGroup` method."""
    calls: list[tuple[str, int]] = []

    def recording(name: str, original):
        def call(pg, *args, **kwargs):
            calls.append(
                (
                    name,
                    sum(
                        t.numel() * t.element_size()
                        for t in tree_leaves(args[:2])
                        if isinstance(t, torch.Tensor)
                    ),
                )
            )
            return original(pg, *args, **kwargs)

        return call

    for name in _CALLS:
        monkeypatch.setattr(ProcessGroup, name, recording(name, getattr(ProcessGroup, name)))
    return calls


@pytest.fixture
def one_rank(tmp_path) -> Iterator[None]:
    with one_rank_world(str(tmp_path)):
        yield


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny", "qwen3-moe-tiny"])
def test_an_export_holds_one_layer_at_a_time_and_writes_write_hf_dirs_files(
    tmp_path, one_rank, payloads, preset
):
    """The old export copied every parameter to the CPU and sent a stage's dict through
    `gather_object`: a whole model held at once, and as one payload. Now neither the tensors a
    rank creates nor any one collective's payload exceeds the largest layer (the manifest
    object carries no tensor), and the files are `write_hf_dir`'s, byte for byte."""
    spec = spec_of(preset, num_layers=6)
    stack = build_model(spec, seed=3)
    layer_bytes = [_bytes(m.parameters()) for _, _, m in stage_layers(stack)]
    assert _bytes(stack.parameters()) > 4 * max(layer_bytes)  # the bound means something
    counter = LiveBytes({p.untyped_storage().data_ptr() for p in stack.parameters()})
    with counter:
        said = export_hf(
            stack,
            str(tmp_path / "streamed"),
            spec,
            dist.group.WORLD,
            ExportOrigin(None, 5),
            torch.device("cpu"),
        )
    assert said is not None and said.startswith("exported step 5 as a transformers directory")
    assert counter.peak <= max(layer_bytes), (counter.peak, max(layer_bytes))
    assert payloads and max(n for _, n in payloads) <= max(layer_bytes), payloads
    assert "gather" not in {name for name, _ in payloads}  # gather_object's, to one rank
    write_hf_dir(str(tmp_path / "whole"), spec, stack.state_dict(), origin=ExportOrigin(None, 5))
    names = sorted(os.listdir(tmp_path / "whole"))
    assert names == sorted(os.listdir(tmp_path / "streamed"))
    for name in names:
        whole, streamed = (tmp_path / d / name for d in ("whole", "streamed"))
        assert streamed.read_bytes() == whole.read_bytes(), name


def test_a_failed_write_still_takes_every_tensor_then_raises(one_rank, monkeypatch):
    """Rank 0 keeps receiving after its writer failed (senders would wait forever otherwise)
    and raises the first error once every tensor is in."""
    spec = spec_of("llama-tiny")
    stack = build_model(spec, seed=3)
    plan = make_plan(
        [
            [
                Piece(prefix + n, (layer, i), 0, tuple(p.shape), p.dtype, None)
                for layer, prefix, m in stage_layers(stack)
                for i, (n, p) in enumerate(m.named_parameters())
            ]
        ]
    )
    received, taken = [], []
    real = hf_export._receive

    def receive(pieces, *args):
        received.append(pieces[0].name)
        return real(pieces, *args)

    monkeypatch.setattr(hf_export, "_receive", receive)

    def take(name: str, full: torch.Tensor) -> None:
        taken.append(name)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        stream(stack, plan, torch.device("cpu"), take)
    assert taken == list(plan)[:1] and received == list(plan)
