"""A plain-PyTorch training loop: the single-process reference every dsnd layout must match.

It shares only the model, data and loss code with dsnd; optimizer, accumulation, clipping and the
LR schedule are torch's (and DeepSpeed's scheduler class on a torch optimizer), so a wiring
mistake in dsnd's DeepSpeed path cannot hide in both. The optimizer is the torch class for the
JSON's `optimizer.type` (AdamW for DeepSpeed's Adam names; Adagrad for DeepSpeed's Adagrad,
offloaded or not); Lion, which torch lacks, is the short `Lion` below.
"""

from __future__ import annotations

from typing import Any

import torch
from deepspeed.runtime import lr_schedules
from torch.nn import functional as F

from dsnd.config.resolve import Resolved
from dsnd.data import batch_for_step
from dsnd.data.batch_extras import batch_extras
from dsnd.data.held_out import split_samples
from dsnd.data.sampler import IGNORE_INDEX
from dsnd.data.sources import load_data
from dsnd.model import build_model, param_groups
from dsnd.model.documents import Documents
from dsnd.moe.capacity import Capacity
from dsnd.moe.router_aux import RouterAux, wants_router_aux


def reference_rows(res: Resolved, change: tuple[int, dict] | None = None) -> list[dict]:
    """Metric rows of `train.steps` steps on one process. The loss of a step is what every layout
    must give: the summed token losses of the global batch over its number of counted labels
    (not -100), computed here as that sum, not as dsnd's weighted micro-batch means (plus, for
    a mixture of experts with `output_router_logits`, the mean of its micro-batches'
    load-balancing losses). `change` (step, hyper-parameters): from that 0-based step on, the
    optimizer takes them, as a run resumed there with them in its JSON."""
    run, ds = res.run, res.ds
    torch.manual_seed(run.train.seed)
    corpus = load_data(run.data, run.model)
    samples = split_samples(run, corpus).train  # held-out samples excepted, as in dsnd
    documents = Documents() if run.data.packing == "documents" else None
    model = build_model(res.model, run.train.seed, documents)
    # a mixture of experts' routers' load-balancing loss (output_router_logits), as transformers
    # adds it: per forward of one micro-batch, averaged over the global batch's micro-batches
    aux = RouterAux(model, res.model.config) if wants_router_aux(res.model.config) else None
    factor = run.model.moe_capacity_factor  # each micro-batch's forward capped, as on a rank
    capacity = None if factor is None else Capacity(model, factor, res.model.num_layers)
    opt = reference_optimizer(param_groups(model), ds["optimizer"])
    sched = reference_scheduler(opt, ds)
    clip = ds.get("gradient_clipping", 0.0)
    rows = []
    for step in range(run.train.steps):
        for group in opt.param_groups if change is not None and step == change[0] else ():
            group.update(change[1])
        lr = opt.param_groups[0]["lr"]
        where = (run.train.seed, step, res.batch.train, 0, 1, res.batch.micro)
        micro = batch_for_step(samples, *where)
        layout = batch_extras(samples, *where)
        counted = sum(int((y != IGNORE_INDEX).sum()) for _, y in micro)
        total = aux_total = 0.0
        for k, (x, y) in enumerate(micro):
            if documents is not None:
                documents.use(layout.documents[k])
            logits = model(x).float()
            summed = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                y.reshape(-1),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
            loss = summed / counted
            if aux is not None:
                extra = aux.loss(aux.partial(logits.device)) / len(micro)
                loss = loss + extra
                total += extra.item() * counted
                aux_total += extra.item()
            loss.backward()
            total += summed.item()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        sched.step()
        rows.append({"step": step + 1, "loss": total / counted, "lr": lr, "grad_norm": norm})
        if aux is not None:
            rows[-1]["moe_aux_loss"] = aux_total
        if capacity is not None:
            dropped = capacity.take()
            rows[-1]["moe_dropped_tokens"] = {
                str(b): int(n) for b, n in enumerate(dropped) if n > 0
            }
    return rows


def reference_scheduler(opt: torch.optim.Optimizer, ds: dict) -> Any:
    """DeepSpeed's scheduler class the JSON names, on `opt`; none: the optimizer's lr, constant,
    as DeepSpeed runs an optimizer without a scheduler."""
    section = ds.get("scheduler")
    if section:
        return getattr(lr_schedules, section["type"])(opt, **section["params"])
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)


def reference_optimizer(groups: list[dict], section: dict) -> torch.optim.Optimizer:
    """The torch optimizer DeepSpeed's optimizer for `section` ({"type", "params"}) computes."""
    kind, params = section["type"], dict(section.get("params") or {})
    for key in ("torch_adam", "adam_w_mode", "fp32_optimizer_states"):  # DeepSpeed's own keys
        params.pop(key, None)
    params = {k: tuple(v) if isinstance(v, list) else v for k, v in params.items()}
    if kind.lower() in ("adam", "adamw"):
        return torch.optim.AdamW(groups, **params)
    if kind.lower() == "adagrad":
        return torch.optim.Adagrad(groups, **params)
    if kind.lower() == "lion":
        return Lion(groups, **params)
    return getattr(torch.optim, kind)(groups, **params)


class Lion(torch.optim.Optimizer):
    """Lion as DeepSpeed's CPU Lion computes it, written out because torch has no Lion: the step
    is -lr times the sign of beta1·m + (1 - beta1)·g, taken with copysign as DeepSpeed's kernel
    does (a zero counts as positive: an unused embedding row still moves by -lr), after
    decoupled weight decay p·(1 - lr·wd); then m = beta2·m + (1 - beta2)·g."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                update = torch.copysign(torch.full_like(p, lr), m * beta1 + p.grad * (1 - beta1))
                p.mul_(1 - lr * wd).sub_(update)
                m.mul_(beta2).add_(p.grad * (1 - beta2))
