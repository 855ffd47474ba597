"""A chosen layout as the two files a run reads: a run YAML and its DeepSpeed JSON (dsnd's
packaged ZeRO JSON of the layout's stage, with the layout's batch sizes and precision; for a
GPU its ZeRO buffers sized to the model and DeepSpeed's own Adam,
`dsnd.layout_search.zero_sizes`)."""

from __future__ import annotations

import json
import os
from typing import Any

import yaml

from dsnd.config.packaged import packaged_json
from dsnd.layout_search.search import Layout
from dsnd.layout_search.source import PARTITION
from dsnd.layout_search.zero_sizes import (
    drop_torch_adam_beside_offload,
    gpu_sized,
    one_sub_group_per_stage,
)

RUN_YAML, DS_JSON = "run.yaml", "ds_config.json"


def ds_json(
    lay: Layout, global_batch: int, bf16: bool, hidden: int | None = None
) -> dict[str, Any]:
    """The packaged JSON of the layout's ZeRO stage with its batch and precision; sized for a
    GPU running a model of hidden size `hidden` (`zero_sizes.gpu_sized`), or, None, left at
    the packaged sizes for this CPU's test-sized runs."""
    path = packaged_json(lay.zero_stage)
    with open(path, encoding="utf-8") as f:
        ds = json.load(f)
    ds["train_batch_size"] = global_batch
    ds["train_micro_batch_size_per_gpu"] = lay.micro_batch
    ds["gradient_accumulation_steps"] = lay.micro_batches
    if bf16:
        ds["bf16"] = {"enabled": True}
    if hidden is not None:
        gpu_sized(ds, hidden)
    drop_torch_adam_beside_offload(ds)
    one_sub_group_per_stage(ds, lay.pp, lay.params_count)
    return ds


def run_yaml(lay: Layout, model: str, preset: bool, seq: int) -> dict[str, Any]:
    return {
        "deepspeed": DS_JSON,
        "model": {"preset" if preset else "config": model, "seq_len": seq},
        "parallel": {
            "pp": lay.pp,
            "tp": lay.tp,
            "cp": lay.cp,
            "ep": lay.ep,
            "partition": PARTITION,
            "schedule": lay.schedule,
            "virtual_stages": lay.virtual_stages,
            "activation_checkpoint_interval": 1 if lay.activation_checkpointing else 0,
            "sequence_parallel": lay.tp > 1,
        },
    }


def comment(lay: Layout) -> str:
    """The plan's prediction for the layout, as the run YAML's leading comment lines."""
    from dsnd.layout_search.render import memory_words

    spread = (
        ""
        if lay.mfu_range is None
        else (" (published runs: {:.1%}-{:.1%})".format(*lay.mfu_range).replace("%-", "-"))
    )
    return (
        f"# dsnd plan: {lay.key()}\n"
        f"# predicted: {lay.step_time_s:.3g} s/step, MFU {lay.mfu:.1%}{spread}\n"
        f"# memory per device (GiB): {memory_words(lay)}\n"
    )


def write(
    out: str,
    lay: Layout,
    model: str,
    preset: bool,
    seq: int,
    global_batch: int,
    bf16: bool,
    hidden: int | None = None,
) -> list[str]:
    """Write both files into `out` (created); their paths. `hidden`: as `ds_json`'s."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, RUN_YAML), os.path.join(out, DS_JSON)]
    with open(paths[0], "w", encoding="utf-8") as f:
        f.write(comment(lay))
        yaml.safe_dump(run_yaml(lay, model, preset, seq), f, sort_keys=False)
    with open(paths[1], "w", encoding="utf-8") as f:
        json.dump(ds_json(lay, global_batch, bf16, hidden), f, indent=2)
        f.write("\n")
    return paths
