"""Elastic layouts: the layout a run takes on whatever world a start is given.

With `elastic.enabled` (`dsnd launch --min-hosts` sets it; under torchrun `--nnodes=MIN:MAX` or a
Slurm job of `--nodes=MIN-MAX` the run config does), every start chooses its layout from its world
by one pure rule, so the launcher and every rank choose alike:

- the global batch is the DeepSpeed JSON's `train_batch_size`, the same on every layout, and so
  are the learning rates and the samples of every step (`dsnd.data.batch_for_step` takes the
  global batch, not the layout); the accumulation steps follow it (the JSON's
  `gradient_accumulation_steps` is derived, not kept). A JSON that does not fix the batch and
  the micro-batch is refused: the batch would follow the world;
- the run's own degrees (`parallel.pp`, `tp`, `cp`, `ep`, `dp_shard`) and micro-batch are kept
  where they still divide the world and the batch; where they do not, every layout that changes
  the fewest of them is resolved, and of those that resolve (every rule of a normal start
  holds), the one needing the fewest model-state bytes per device by the planner's accounting
  (`dsnd.plan.memory`: parameters, gradients, master weights, optimizer state; activations not
  counted) is taken;
- with `elastic.memory_gb`, a layout must need at most that many GiB per device by the same
  accounting; when none of the world's layouts does, the start is refused in one line.

Checkpoints hold whole tensors, so the newest one resumes on the chosen layout, its losses
unchanged (`dsnd.checkpoint.load`).
"""

from __future__ import annotations

import copy
from dataclasses import astuple, dataclass, fields, replace

from dsnd.config.batch import GAS, MICRO, TRAIN
from dsnd.config.load import LoadedConfig
from dsnd.config.resolve import Resolved, resolve, run_model
from dsnd.errors import UserError

GIB = 2**30


@dataclass(frozen=True)
class Degrees:
    """What elasticity may change: the parallel degrees and the micro-batch (0: no dp_shard)."""

    pp: int
    tp: int
    cp: int
    ep: int
    dp_shard: int
    micro: int


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _kept(want: int, n: int) -> int:
    """`want` if it divides `n`, else its largest divisor that does (1 at least)."""
    return max(d for d in _divisors(want) if n % d == 0)


def candidates(want: Degrees, world: int, train: int, layers: int) -> list[Degrees]:
    """Every layout of `world` ranks with global batch `train`: pp, tp and cp dividing the world
    (pp at most the model's `layers`), dp dividing the batch; ep, dp_shard and the micro-batch
    as wanted where they divide dp (and the batch per dp rank), else their largest divisor that
    does. The rules a layout must also obey (heads per tp rank, ...) are `resolve`'s."""
    out = []
    for pp in (p for p in _divisors(world) if p <= layers):
        for tp in _divisors(world // pp):
            for cp in _divisors(world // (pp * tp)):
                dp = world // (pp * tp * cp)
                if train % dp:
                    continue
                micro = max(m for m in _divisors(train // dp) if m <= want.micro)
                shard = _kept(want.dp_shard, dp) if want.dp_shard else 0
                out.append(Degrees(pp, tp, cp, _kept(want.ep, dp), shard, micro))
    return out


def changes(want: Degrees, got: Degrees) -> list[str]:
    """What `got` changes of `want`, as `pp 2->1`."""
    return [
        f"{f.name} {a}->{b}"
        for f, a, b in zip(fields(Degrees), astuple(want), astuple(got), strict=True)
        if a != b
    ]


def _a_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def batch_fixed(ds: dict) -> bool:
    """Whether the DeepSpeed dict fixes the global batch and the micro-batch (numbers, not
    "auto" or absent): what every elastic layout keeps."""
    return _a_count(ds.get(TRAIN)) and _a_count(ds.get(MICRO))


def fixed_batch(loaded: LoadedConfig) -> tuple[int, int]:
    """(global batch, micro-batch) the DeepSpeed JSON fixes; UserError when it fixes neither."""
    ds = loaded.ds
    train, micro = ds.get(TRAIN), ds.get(MICRO)
    for key, value in ((TRAIN, train), (MICRO, micro)):
        if not _a_count(value):
            raise UserError(
                f"{loaded.ds_path}: elastic.enabled needs {key} as a number (got {value!r}): "
                "every layout keeps the global batch and starts from the micro-batch "
                "written there (dsnd launch --min-hosts pins both from the whole hostfile)"
            )
    return train, micro


def with_degrees(loaded: LoadedConfig, d: Degrees, train: int) -> LoadedConfig:
    """`loaded` on the layout `d`: the degrees in `parallel`, the batch keys in the JSON (the
    accumulation steps derived)."""
    par = replace(
        loaded.run.parallel, pp=d.pp, tp=d.tp, cp=d.cp, ep=d.ep, dp_shard=d.dp_shard or None
    )
    ds = copy.deepcopy(loaded.ds)
    ds[TRAIN], ds[MICRO] = train, d.micro
    ds.pop(GAS, None)
    return replace(loaded, run=replace(loaded.run, parallel=par), ds=ds, ds_file=None, ds_sets=[])


def device_state_bytes(res: Resolved) -> float:
    """Model-state bytes on the device of the busiest pipeline stage's ranks (the planner's
    accounting: `dsnd.plan.memory`; the same numbers `dsnd ds-config explain` prints)."""
    from dsnd.config.state_memory import stage_state_bytes  # imports torch's optimizers

    return max(sum(parts["device"].values()) for parts in stage_state_bytes(res))


@dataclass
class Choice:
    res: Resolved
    changed: list[str]  # what the layout changes of the run config's, as `pp 2->1`
    state_bytes: float  # per device, by the planner's accounting


def _tried(
    loaded: LoadedConfig, d: Degrees, world: int, train: int, budget: float | None
) -> Choice | str:
    """The layout `d` resolved, or why it cannot run (a rule, or the memory budget)."""
    try:
        res = resolve(with_degrees(loaded, d, train), world)
    except UserError as e:
        return str(e)
    need = device_state_bytes(res)
    if budget is not None and need > budget:
        return f"needs {need / GIB:.3g} GiB of model state per device (elastic.memory_gb)"
    return Choice(res, [], need)


def label(d: Degrees) -> str:
    """A layout as `pp=2 tp=1 cp=1 ep=1 micro=2` (and dp_shard when set)."""
    shard = f" dp_shard={d.dp_shard}" if d.dp_shard else ""
    return f"pp={d.pp} tp={d.tp} cp={d.cp} ep={d.ep} micro={d.micro}{shard}"


def choose(loaded: LoadedConfig, world: int) -> Choice:
    """The layout of `world` ranks (the rule in the module's docstring), resolved; UserError in
    one line when none can run, naming the nearest one and why."""
    train, micro = fixed_batch(loaded)
    par = loaded.run.parallel
    want = Degrees(par.pp, par.tp, par.cp, par.ep, par.dp_shard or 0, micro)
    gb = loaded.run.elastic.memory_gb
    budget = None if gb is None else gb * GIB
    found = candidates(want, world, train, run_model(loaded.run).num_layers)
    refused: list[tuple[Degrees, str]] = []
    for n in sorted({len(changes(want, d)) for d in found}):
        group = [d for d in found if len(changes(want, d)) == n]
        tried = [(d, _tried(loaded, d, world, train, budget)) for d in group]
        ok = [(d, t) for d, t in tried if isinstance(t, Choice)]
        refused += [(d, t) for d, t in tried if isinstance(t, str)]
        if ok:
            d, best = min(ok, key=lambda x: x[1].state_bytes)
            best.changed = changes(want, d)
            written = loaded.ds.get(GAS)  # the JSON's accumulation steps, derived here: said
            if written is not None and written != best.res.batch.gas:
                best.changed.append(f"{GAS} {written}->{best.res.batch.gas}")
            return best
    nearest = f": nearest {label(refused[0][0])}: {refused[0][1]}" if refused else ""
    raise UserError(
        f"elastic: no layout of {world} ranks runs the global batch of {train} "
        f"({len(found)} tried, from {label(want)}){nearest}"
    )


def resolve_world(loaded: LoadedConfig, world: int) -> tuple[Resolved, str | None]:
    """`resolve` for `world` ranks, or with elastic.enabled the layout `choose` picks, and then
    a line saying which it is and what it changed of the run config's."""
    if not loaded.run.elastic.enabled:
        return resolve(loaded, world), None
    choice = choose(loaded, world)
    t, b = choice.res.topology, choice.res.batch
    said = ", ".join(choice.changed) or "nothing"
    return choice.res, (
        f"elastic: {world} ranks run pp={t.pp} dp={t.dp} tp={t.tp} cp={t.cp} ep={t.ep}, "
        f"micro-batch {b.micro} x {b.gas} accumulation x dp {t.dp} = global batch {b.train} "
        f"({choice.state_bytes / GIB:.3g} GiB of model state per device); changed of the run "
        f"config: {said}"
    )
