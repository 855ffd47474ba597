"""Rank program: train with DeepSpeed's own engines, as a DeepSpeed user would, save midway.

Usage (every rank): python tests/distributed/ds_native_worker.py OUT.json CASES.json
CASES.json: [{"name", "engine": "pipe" | "plain", "json": DeepSpeed JSON, "sets": [dsnd --set
items naming the model, data and seed], "steps": N, "save_at": S, "save_dir": DIR}]

- pipe: DeepSpeed's `PipelineModule` over dsnd's layer specs (`layer_specs`) at
  pp=2 x dp=world/2, in DeepSpeed's `PipelineEngine` (`train_batch`).
- plain: dsnd's whole model (`build_model`) in a plain `DeepSpeedEngine` at dp=world
  (forward, `backward`, `step` per micro-batch).

Both start from dsnd's initial weights (a function of seed, global layer index and name), use
dsnd's parameter groups and the JSON as given, and see at step s exactly the samples dsnd sees
(`batch_for_step`: each data-parallel rank its slice of the global batch). After `save_at`
steps DeepSpeed's `save_checkpoint` writes DIR (tag `global_step<S>`); training goes on to
`steps` uninterrupted. Rank 0 writes {name: [{"step", "loss", "lr", "grad_norm"}, ...]}.
Pipe cases come last: a `PipelineEngine` leaves its grid as DeepSpeed's process-wide model-
parallel unit, which a plain engine built after it would take for its own.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from dsnd.config.load import load  # noqa: E402
from dsnd.config.resolve import resolve  # noqa: E402
from dsnd.data import SampleSet, batch_for_step, load_corpus  # noqa: E402
from dsnd.data.held_out import split_samples  # noqa: E402
from dsnd.engine.deepspeed_api import pipe_topology  # noqa: E402
from dsnd.model import build_model, init_layer, layer_specs, lm_loss, param_groups  # noqa: E402
from dsnd.model.stack import TIED_EMBED_KEY  # noqa: E402
from tests.distributed.worker import this_rank, world, write_json  # noqa: E402


def _samples(res) -> SampleSet:
    data = res.run.data
    corpus = load_corpus(data.path, data.format, data.text_field, data.max_bytes)
    return split_samples(res.run, corpus).train  # what dsnd trains on: held-out excepted


def _pipeline_engine(res, ds: dict):
    import deepspeed
    from deepspeed.pipe import PipelineModule

    from dsnd.engine.pipe import deepspeed_specs

    specs = layer_specs(res.model)
    module = PipelineModule(
        layers=deepspeed_specs(specs),
        num_stages=res.topology.pp,
        topology=pipe_topology(res.topology.pp, res.topology.tp, res.topology.dp),
        loss_fn=lm_loss,
        partition_method=res.run.parallel.partition,
    )
    seed = res.run.train.seed
    with torch.no_grad():  # dsnd's (seed, global index, name) weights, the tied module at 0
        for name, layer in module.named_children():
            if name.isdigit():
                init_layer(layer, seed, int(name), layer.init_std)
        for key, layer in module.tied_modules.items():
            assert key == TIED_EMBED_KEY
            init_layer(layer, seed, 0, layer.init_std)
    engine, _, _, _ = deepspeed.initialize(
        model=module, model_parameters=param_groups(module), config=ds, dist_init_required=False
    )
    return engine


def _plain_engine(res, ds: dict):
    import deepspeed

    model = build_model(res.model, res.run.train.seed)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=param_groups(model), config=ds, dist_init_required=False
    )
    return engine


def _step(engine, pipe: bool, micro: list) -> float:
    """One optimizer step over this rank's micro-batches; the global batch's mean loss."""
    if pipe:
        return float(engine.train_batch(iter(micro)))
    total = 0.0
    for x, y in micro:
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        total += loss.item()
    mean = torch.tensor([total / len(micro)], dtype=torch.float64)
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def resolve_case(case: dict, world: int):
    """dsnd's view of the case (model, data, seed, topology); before the world starts, as
    `dsnd train` resolves."""
    pipe = case["engine"] == "pipe"
    sets = [*case["sets"], f"deepspeed={case['json']}", *(["parallel.pp=2"] if pipe else [])]
    return resolve(load(None, sets), world)


def run_case(case: dict, res) -> list[dict]:
    pipe = case["engine"] == "pipe"
    ds = copy.deepcopy(res.ds)  # the JSON as dsnd resolves it ("auto" filled), run natively
    torch.manual_seed(res.run.train.seed)
    engine = (_pipeline_engine if pipe else _plain_engine)(res, ds)
    samples = _samples(res)
    if pipe:
        dp_rank, dp = (
            engine.grid.get_data_parallel_rank(),
            engine.grid.get_data_parallel_world_size(),
        )
    else:
        dp_rank, dp = dist.get_rank(), dist.get_world_size()
    rows = []
    try:
        for step in range(case["steps"]):
            lr = engine.optimizer.param_groups[0]["lr"]  # the rate this step uses
            batch, micro_size = engine.train_batch_size(), engine.train_micro_batch_size_per_gpu()
            micro = batch_for_step(
                samples, res.run.train.seed, step, batch, dp_rank, dp, micro_size
            )
            loss = _step(engine, pipe, micro)
            norm = engine.get_global_grad_norm()
            rows.append(
                {
                    "step": step + 1,
                    "loss": loss,
                    "lr": lr,
                    "grad_norm": None if norm is None else float(norm),
                }
            )
            if step + 1 == case["save_at"]:
                engine.save_checkpoint(case["save_dir"])
    finally:
        engine.destroy()
    return rows


def main(out_path: str, cases_path: str) -> None:
    info = this_rank()
    with open(cases_path, encoding="utf-8") as f:
        cases = json.load(f)
    kinds = [c["engine"] for c in cases]
    assert kinds == sorted(kinds, key=lambda k: k == "pipe"), "pipe cases must come last"
    resolved = [resolve_case(c, info.world_size) for c in cases]
    with world(info, timeout_s=120):
        results = {c["name"]: run_case(c, res) for c, res in zip(cases, resolved, strict=True)}
    write_json(out_path, results, info.rank)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
