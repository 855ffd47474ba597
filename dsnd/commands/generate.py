"""``dsnd generate CKPT --prompt TEXT``: sample text from a checkpoint of any layout.

One process, no process group: the checkpoint's full tensors (they are stored whole, by name)
load into the single-process model, which then continues the prompt token by token (the
tokenizer of the run's model directory when it has one, else byte-level tokens; temperature 0 =
greedy). Checksums are verified first, as for every load.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from dsnd.checkpoint.files import resolve_step_dir
from dsnd.checkpoint.load import read_full_model
from dsnd.checkpoint.verify import check_intact, read_manifest
from dsnd.data.tokenizer import ByteTokenizer, has_tokenizer, load_tokenizer
from dsnd.errors import UserError
from dsnd.model import build_model
from dsnd.model.source import ModelSpec, from_manifest


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    ids: torch.Tensor,
    new_tokens: int,
    max_seq_len: int,
    temperature: float,
    generator: torch.Generator,
) -> torch.Tensor:
    """`ids` (1, n) continued by `new_tokens` tokens (no KV cache: the tiny models need none)."""
    for _ in range(new_tokens):
        logits = model(ids[:, -max_seq_len:])[0, -1].float()
        if temperature <= 0:
            nxt = logits.argmax().view(1)
        else:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids


def load_checkpoint_model(path: str) -> tuple[torch.nn.Module, ModelSpec]:
    """The single-process model holding checkpoint `path`'s weights (checksums verified)."""
    step_dir = resolve_step_dir(path)
    check_intact(step_dir)
    manifest = read_manifest(step_dir)
    spec = from_manifest(manifest["model"])
    model = build_model(spec, seed=0).eval()
    missing, unexpected = model.load_state_dict(read_full_model(step_dir, manifest), strict=False)
    if missing or unexpected:
        raise UserError(
            f"{step_dir}: does not fit {spec.family.name} (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]})"
        )
    return model, spec


def tokenizer_of(spec: ModelSpec) -> Any:
    """The tokenizer of the run's model directory when it has one (what `dsnd data prepare
    --tokenizer DIR` encoded the corpus with), else dsnd's byte tokenizer."""
    if has_tokenizer(spec.directory):
        return load_tokenizer(spec.directory)
    return ByteTokenizer()


def run_generate(path: str, prompt: str, tokens: int, temperature: float, seed: int) -> int:
    model, spec = load_checkpoint_model(path)
    tok = tokenizer_of(spec)
    ids = torch.as_tensor(list(tok.encode(prompt)), dtype=torch.long).view(1, -1)
    if ids.numel() == 0:
        raise UserError("--prompt must not be empty")
    out = generate(
        model, ids, tokens, spec.max_seq_len, temperature, torch.Generator().manual_seed(seed)
    )
    print(tok.decode(out[0].tolist()))
    return 0


def run(args: argparse.Namespace) -> int:
    """``dsnd generate CKPT --prompt TEXT``."""
    return run_generate(args.checkpoint, args.prompt, args.tokens, args.temperature, args.seed)
