"""Model-state bytes per rank for a ZeRO stage, precision and offload: the ZeRO paper's
accounting with what DeepSpeed 0.19.8 keeps (measured by `dsnd bench zero-memory`):

- parameters: 4 bytes each in fp32, 2 in bf16; split over the data-parallel ranks at ZeRO-3;
- gradients: as the parameters; split at ZeRO 2-3;
- fp32 master weights: 4 bytes, split at ZeRO 1-3 — DeepSpeed keeps a separate master even for
  fp32 parameters there; none at ZeRO-0 fp32 (the parameters are the masters);
- optimizer state: `state_bytes` per parameter (Adam's two fp32 moments: 8; SGD with momentum:
  4, without: 0; see `dsnd.engine.optimizers.state_bytes`), split at ZeRO 1-3; the part
  "optimizer", as `dsnd.engine.memory` measures it.

With expert parallelism (`experts` of the `psi` parameters are routed experts, split over `ep`
ranks) a rank holds only its experts, experts / ep parameters, and ZeRO shards them over the
nd / ep ranks holding the same ones (`dsnd.engine.experts`): those parts are counted for
experts / ep parameters over nd / ep ranks, the dense rest over nd. At ZeRO-3 that comes to
the same bytes as without expert parallelism (experts / nd); below it the experts' unsplit
parts shrink ep times.

CPU offload moves the optimizer's part (master weights and optimizer state) to CPU memory, and at
ZeRO-3 parameter offload the parameter partition too. Pure arithmetic; activations and
communication buckets are not model state.
"""

from __future__ import annotations


def model_state_bytes(
    stage: int,
    psi: int,
    nd: int,
    bf16: bool,
    offload_optimizer: bool = False,
    offload_param: bool = False,
    state_bytes: int = 8,
    experts: int = 0,
    ep: int = 1,
) -> dict[str, dict[str, float]]:
    """{"device": {part: bytes}, "cpu": {part: bytes}} for `psi` parameters on one rank of
    `nd` data-parallel ranks, with `state_bytes` of optimizer state per parameter; `experts` of
    them routed experts split over `ep` ranks (see above)."""
    if stage not in (0, 1, 2, 3) or psi < 0 or nd < 1:
        raise ValueError(f"need ZeRO stage 0-3, psi >= 0, nd >= 1; got {stage}, {psi}, {nd}")
    if not 0 <= experts <= psi or ep < 1 or nd % ep:
        raise ValueError(f"need 0 <= experts <= psi and ep dividing nd; got {experts}, {ep}")
    low = 2 if bf16 else 4

    def per_rank(count: float, ranks: int) -> dict[str, float]:
        def split(at_stage: int) -> int:
            return ranks if stage >= at_stage else 1

        return {
            "params": low * count / split(3),
            "grads": low * count / split(2),
            "master": (0 if stage == 0 and not bf16 else 4) * count / split(1),
            "optimizer": state_bytes * count / split(1),
        }

    dense, mine = per_rank(psi - experts, nd), per_rank(experts / ep, nd // ep)
    parts = {k: dense[k] + mine[k] for k in dense}
    on_cpu = set()
    if offload_optimizer and stage > 0:
        on_cpu |= {"master", "optimizer"}
    if offload_param and stage == 3:
        on_cpu.add("params")
    return {
        "device": {k: v for k, v in parts.items() if k not in on_cpu},
        "cpu": {k: v for k, v in parts.items() if k in on_cpu},
    }


def held_gradient_bytes(
    stage: int, psi: int, nd: int, bf16: bool, experts: int = 0, ep: int = 1
) -> float:
    """Gradient bytes a rank holds at the peak of a dsnd step beyond `model_state_bytes`' grads
    (`experts` of the `psi` parameters routed experts split over `ep` ranks, as there).

    dsnd reduces a step's gradients once, at its end (`dsnd.engine.stage_engine` coalesces
    DeepSpeed's reductions), so until then every rank accumulates its stage's whole gradients:
    ZeRO-2 partitions them only at the reduction, and ZeRO-3 keeps its partition buffer besides.
    Measured by ``dsnd bench zero-memory`` (pp=2 x dp=2, fp32 AdamW): ZeRO-2 peaks at 14 Psi
    where the formula has 12 Psi, ZeRO-3 at 14 Psi where it has 10 Psi. ZeRO 0-1 hold whole
    gradients in the formula already."""
    low = 2 if bf16 else 4

    def held(count: float, ranks: int) -> float:
        if stage == 2:
            return low * count * (1 - 1 / ranks)
        if stage == 3:
            return float(low * count)
        return 0.0

    return held(psi - experts, nd) + held(experts / ep, nd // ep)
