"""Tensor names as `transformers` keeps them in memory ↔ as its checkpoint files store them.

For dense families the two are the same. A mixture-of-experts family (`ExpertFiles`) fuses
each layer's experts in memory into `<layer>.mlp.experts.gate_up_proj` (E, 2I, H), expert e
being [gate_e; up_e], and `<layer>.mlp.experts.down_proj` (E, H, I), while files hold one 2-D
weight per expert, `<layer>.<block>.experts.<e>.<gate|up|down>.weight`, and the router as
`<layer>.<block>.gate.weight` (Mixtral's block is `block_sparse_moe` in files, `mlp` in memory).
These are the renamings `transformers`' conversion mapping applies inside `from_pretrained`
(and reverses in `save_pretrained`); they are written out here because that machinery works on
a whole model's state dict, while each dsnd stage reads only its own layers' tensors.
"""

from __future__ import annotations

import re

import torch

from dsnd.model.family import ExpertFiles

_FUSED = re.compile(
    r"(?P<layer>.+)\.mlp\.(?P<what>gate\.weight|experts\.gate_up_proj|"
    r"experts\.down_proj)"
)


def _fused(name: str, files: ExpertFiles | None) -> re.Match | None:
    return _FUSED.fullmatch(name) if files is not None else None


def file_names(name: str, files: ExpertFiles | None, experts: int) -> list[str]:
    """The file tensors that hold in-memory tensor `name`, in the order `join` takes them."""
    match = _fused(name, files)
    if match is None:
        return [name]
    assert files is not None
    block, what = f"{match['layer']}.{files.block}", match["what"]
    if what == "gate.weight":
        return [f"{block}.gate.weight"]
    projections = (files.down,) if what == "experts.down_proj" else (files.gate, files.up)
    return [f"{block}.experts.{e}.{p}.weight" for e in range(experts) for p in projections]


def file_shapes(
    name: str, shape: tuple[int, ...], files: ExpertFiles | None
) -> dict[str, tuple[int, ...]]:
    """Each file tensor of in-memory tensor `name` of full shape `shape`, with its shape."""
    match = _fused(name, files)
    if match is None or match["what"] == "gate.weight":
        return dict.fromkeys(file_names(name, files, 0), shape)
    experts, rows, cols = shape
    part = (rows, cols) if match["what"] == "experts.down_proj" else (rows // 2, cols)
    return dict.fromkeys(file_names(name, files, experts), part)


def join(name: str, parts: list[torch.Tensor], files: ExpertFiles | None) -> torch.Tensor:
    """In-memory tensor `name` from its file tensors (`file_names` order)."""
    match = _fused(name, files)
    if match is None or match["what"] == "gate.weight":
        (only,) = parts
        return only
    if match["what"] == "experts.down_proj":
        return torch.stack(parts)
    return torch.stack([torch.cat(parts[i : i + 2]) for i in range(0, len(parts), 2)])


def split(name: str, tensor: torch.Tensor, files: ExpertFiles | None) -> dict[str, torch.Tensor]:
    """The file tensors of in-memory tensor `name` (what `join` puts back together)."""
    match = _fused(name, files)
    names = file_names(name, files, tensor.shape[0])
    if match is None or match["what"] == "gate.weight":
        return {names[0]: tensor}
    pieces = list(tensor.unbind(0))
    if match["what"] == "experts.gate_up_proj":
        pieces = [half for expert in pieces for half in expert.chunk(2)]
    return {n: piece.contiguous() for n, piece in zip(names, pieces, strict=True)}
