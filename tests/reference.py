"""A plain-PyTorch training loop: the single-process reference every dsnd layout must match.

It shares only the model, data and loss code with dsnd; optimizer, accumulation, clipping and the
LR schedule are torch's (and DeepSpeed's scheduler class on a torch optimizer), so a wiring
mistake in dsnd's DeepSpeed path cannot hide in both.
"""

from __future__ import annotations

import torch
from deepspeed.runtime import lr_schedules

from dsnd.config.resolve import Resolved
from dsnd.data import SampleSet, batch_for_step, load_corpus
from dsnd.model import build_model, lm_loss, param_groups


def reference_rows(res: Resolved) -> list[dict]:
    run, ds = res.run, res.ds
    torch.manual_seed(run.train.seed)
    corpus = load_corpus(run.data.path, run.data.format, run.data.text_field, run.data.max_bytes)
    samples = SampleSet(corpus.tokens, run.model.seq_len)
    model = build_model(res.model, run.train.seed)
    params = dict(ds["optimizer"]["params"])
    params.pop("torch_adam", None)
    params["betas"] = tuple(params["betas"])
    opt = torch.optim.AdamW(param_groups(model), **params)
    sched = getattr(lr_schedules, ds["scheduler"]["type"])(opt, **ds["scheduler"]["params"])
    clip = ds.get("gradient_clipping", 0.0)
    rows = []
    for step in range(run.train.steps):
        lr = opt.param_groups[0]["lr"]
        micro = batch_for_step(
            samples, run.train.seed, step, res.batch.train, 0, 1, res.batch.micro
        )
        total = 0.0
        for x, y in micro:
            loss = lm_loss(model(x), y)
            (loss / len(micro)).backward()
            total += loss.item()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        sched.step()
        rows.append({"step": step + 1, "loss": total / len(micro), "lr": lr, "grad_norm": norm})
    return rows
