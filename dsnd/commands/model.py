"""``dsnd model list`` and ``dsnd model show NAME|DIR``: the shipped presets, and any model's
architecture, exact parameter count and per-layer table, counted on the meta device (a 70B
model allocates nothing)."""

from __future__ import annotations

import argparse

from dsnd.model.count import layer_table, matmul_params
from dsnd.model.source import check_model, load_model, presets


def run_list() -> int:
    for name in presets():
        model = load_model(name, "preset")
        total = sum(n for _, _, n in layer_table(model))
        print(
            f"{name:<16} {model.family.name:<8} {total:>15,} parameters  "
            f"{model.num_layers} layers, hidden {model.hidden_size}"
        )
    return 0


def run_show(name: str) -> int:
    model = load_model(name, "dsnd model show")
    check_model(model, 1, model.source)
    table = layer_table(model)
    c = model.config
    print(f"model: {model.describe()}")
    print(f"parameters: {sum(n for _, _, n in table):,}")
    print(f"matmul parameters (FLOPs 6N): {matmul_params(model):,}")
    print(
        f"layers: {model.num_layers} blocks (+ embedding, final norm, head: "
        f"{len(table)} pipeline layers)"
    )
    print(
        f"heads: {model.num_heads} x {model.head_dim} (kv {model.num_kv_heads}), "
        f"ffn {model.ffn_size}, tied head: {model.tie_embeddings}, "
        f"max positions {model.max_seq_len}"
    )
    rope = getattr(c, "rope_parameters", None)
    if rope:
        print(f"rope: {rope}")
    print(f"{'layer':>5}  {'kind':<30} {'parameters':>15}")
    for index, kind, count in table:
        print(f"{index:>5}  {kind:<30} {count:>15,}")
    return 0


def run(args: argparse.Namespace) -> int:
    """``dsnd model list | show NAME``."""
    return run_list() if args.model_command == "list" else run_show(args.name)
