"""Measured pipeline partitioning (``parallel.partition: profile``): stages balanced on the time
each layer really takes, under a memory cap.

DeepSpeed's `PipelineModule` raises NotImplementedError for ``partition_method="profile"``, so dsnd
writes it by hand, in small steps:

1. `measure_layers` builds each layer of the model alone on this process and times a forward
   and backward pass of one micro-batch through it (the head together with the loss, which the
   last stage computes), and counts its memory: 16 bytes per trainable parameter (fp32 weight,
   gradient and Adam's two moments) plus the bytes autograd saves for backward.
2. `cached_costs` keeps those numbers in ``<cache_dir>/<profile_key>.json``; the key covers
   everything that changes them (the model's config, sequence length, micro-batch size, dtype,
   device, torch version), so a configuration is measured once per host. Processes asking at
   once take a file lock: one measures, the others read its file.
3. `balance` splits the layers into contiguous non-empty stages with the least possible slowest
   stage, every stage's memory under the cap: exact, by dynamic programming. Among the splits
   as fast as that it takes the most even one (least sum of squared stage times), then the one
   with the earliest boundaries (earlier stages, which hold more micro-batches in flight under
   1F1B, get less).
4. `profile_partition` ties them together.

Timings differ from host to host, and every rank of a run must use the same ``parts``: the
caller measures on one rank and shares the result (or points every host at one cache).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from itertools import pairwise
from typing import Any

import torch
from torch import nn

from dsnd.errors import UserError
from dsnd.model import ModelSpec, layer_specs, lm_loss

log = logging.getLogger(__name__)

CAP_KEY = "parallel.profile_memory_cap_gb"
PP_KEY = "parallel.pp"
FORMAT_VERSION = 2  # of the cache files and the key; bump when what is measured changes
BYTES_PER_PARAM = 16  # fp32 weight, gradient, Adam exp_avg and exp_avg_sq
GIB = 2**30
SEED = 1234


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs its stage, per micro-batch."""

    seconds: float  # forward + backward of one micro-batch
    memory_bytes: int  # parameters with gradients and Adam state, plus saved activations

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, entry: Any) -> LayerCost:
        """The cost `to_json` wrote; ValueError if `entry` is not one."""
        if not isinstance(entry, dict) or set(entry) != {"seconds", "memory_bytes"}:
            raise ValueError(f"not a layer cost: {entry!r}")
        seconds, memory = entry["seconds"], entry["memory_bytes"]
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise ValueError(f"seconds is not a number: {seconds!r}")
        if isinstance(memory, bool) or not isinstance(memory, int):
            raise ValueError(f"memory_bytes is not an integer: {memory!r}")
        if not math.isfinite(seconds) or seconds < 0 or memory < 0:
            raise ValueError(f"negative or infinite cost: {entry!r}")
        return cls(float(seconds), memory)


# ---------------------------------------------------------------------------- measuring


def measure_layers(
    model: ModelSpec,
    seq_len: int,
    micro: int,
    repeats: int = 5,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> list[LayerCost]:
    """One `LayerCost` per layer of `layer_specs(model)`, each layer built and run alone.

    A layer gets random token ids (the first) or a random activation that needs a gradient
    (the others); the last one's logits go through the loss. One pass counts the activation
    memory (and warms up), then the fastest of `repeats` timed passes is the layer's time. A
    tied module is built once; its later positions (the tied head) are timed but own no
    parameters.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    device = torch.device(device)
    specs = layer_specs(model)
    built: dict[str, nn.Module] = {}
    costs = []
    for index, spec in enumerate(specs):
        torch.manual_seed(SEED + index)
        key = getattr(spec, "key", None)  # a TiedLayerSpec's
        owns = key is None or key not in built
        module = _build(spec, device, dtype) if owns else built[key]
        if key is not None:
            built[key] = module
        forward_fn = getattr(spec, "forward_fn", None)
        layer = module if forward_fn is None else partial(forward_fn, module)
        last = index == len(specs) - 1
        step = _step(layer, index, last, model, seq_len, micro, dtype, device)
        params = list(module.parameters())
        activations = _saved_bytes(step, params)
        # the fastest pass: interference (another process, a page fault) only ever adds time
        seconds = min(_timed(step, params, device) for _ in range(repeats))
        weights = BYTES_PER_PARAM * _trainable(module) if owns else 0
        costs.append(LayerCost(seconds, weights + activations))
        del module, layer, step
    return costs


def _build(spec: Any, device: torch.device, dtype: torch.dtype) -> nn.Module:
    with torch.device(device):
        module = spec.build()
    return module.to(device=device, dtype=dtype).train()  # blocks build rotary tables on the CPU


def _step(
    layer: Callable[[torch.Tensor], torch.Tensor],
    index: int,
    last: bool,
    model: ModelSpec,
    seq_len: int,
    micro: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Callable[[], None]:
    """A forward and backward pass of one micro-batch through `layer`, on fixed random inputs."""
    shape = (micro, seq_len)
    if index == 0:
        x = torch.randint(model.vocab_size, shape, device=device)
    else:
        x = torch.randn(*shape, model.hidden_size, device=device, dtype=dtype, requires_grad=True)
    labels = torch.randint(model.vocab_size, shape, device=device)
    grad: list[torch.Tensor] = []  # the output's gradient, made on the first call

    def step() -> None:
        x.grad = None
        out = layer(x)
        if last:
            lm_loss(out, labels).backward()
            return
        if not grad:
            grad.append(torch.randn_like(out))
        out.backward(grad[0])

    return step


def _clear_grads(params: Sequence[torch.Tensor]) -> None:
    for p in params:
        p.grad = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(step: Callable[[], None], params: Sequence[torch.Tensor], device: torch.device) -> float:
    _clear_grads(params)
    _sync(device)
    start = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - start


def _saved_bytes(step: Callable[[], None], params: Sequence[torch.Tensor]) -> int:
    """Bytes of the tensors autograd saves for backward during `step`, each storage once, the
    parameters' own storages left out (they are counted as parameters)."""
    skip = {_storage(p) for p in params}
    sizes: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        where = _storage(t)
        if where is not None and where not in skip:
            sizes[where] = max(sizes.get(where, 0), t.numel() * t.element_size())
        return t

    _clear_grads(params)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(sizes.values())


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage
        return None


def _trainable(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


# ---------------------------------------------------------------------------- balancing


def balance(
    seconds: Sequence[float], memory: Sequence[int], num_stages: int, memory_cap: int | None
) -> list[int]:
    """`parts` (stage s holds layers parts[s] .. parts[s+1]-1, every stage non-empty) with the
    least possible slowest stage, every stage's summed memory <= `memory_cap` bytes (None: no
    cap); ties go to the most even split, then to the earliest boundaries."""
    n = len(seconds)
    _check(seconds, memory, num_stages)
    time_of, memory_of = _segment_sum(seconds), _segment_sum(memory)

    def fits(i: int, j: int) -> bool:
        return memory_cap is None or memory_of(i, j) <= memory_cap

    slowest, _ = _solve(n, num_stages, fits, lambda i, j, rest: max(time_of(i, j), rest))
    if slowest == math.inf:
        least, _ = _solve(
            n, num_stages, lambda i, j: True, lambda i, j, rest: max(memory_of(i, j), rest)
        )
        raise UserError(
            f"{CAP_KEY}={memory_cap / GIB:.3g}: no split of the {n} layers into {num_stages} "
            f"stages keeps every stage under {memory_cap / GIB:.3g} GiB; the best split's "
            f"largest stage needs {least / GIB:.3g} GiB (raise the cap or add stages)"
        )

    def fast_enough(i: int, j: int) -> bool:
        return fits(i, j) and time_of(i, j) <= slowest

    _, parts = _solve(n, num_stages, fast_enough, lambda i, j, rest: time_of(i, j) ** 2 + rest)
    assert parts is not None  # the slowest split itself qualifies
    return parts


def _check(seconds: Sequence[float], memory: Sequence[int], num_stages: int) -> None:
    if len(memory) != len(seconds):
        raise ValueError(f"{len(seconds)} times but {len(memory)} memory sizes")
    if any(not math.isfinite(s) or s < 0 for s in seconds) or any(m < 0 for m in memory):
        raise ValueError("layer costs must be finite and >= 0")
    if num_stages < 1:
        raise UserError(f"{PP_KEY}={num_stages}: needs at least one stage")
    if num_stages > len(seconds):
        raise UserError(
            f"{PP_KEY}={num_stages}: the model has only {len(seconds)} layers, "
            "and every stage needs one"
        )


def _segment_sum(values: Sequence[float]) -> Callable[[int, int], float]:
    """(i, j) -> sum of values[i:j], from prefix sums (the same number for the same (i, j))."""
    prefix = [0]
    for v in values:
        prefix.append(prefix[-1] + v)
    return lambda i, j: prefix[j] - prefix[i]


def _solve(
    n: int,
    k: int,
    allowed: Callable[[int, int], bool],
    combine: Callable[[int, int, float], float],
) -> tuple[float, list[int] | None]:
    """The least cost of splitting layers [0, n) into `k` non-empty contiguous stages, each
    stage [i, j) `allowed`, and the lexicographically smallest `parts` that reach it; (inf,
    None) if no split is allowed.

    A split's cost folds from the last stage back: combine(i, j, cost of the stages after j).
    `allowed(i, j)` must fail for every larger j once it fails (true of sums of costs >= 0).
    """
    best = [[math.inf] * (n + 1) for _ in range(k + 1)]  # best[s][i]: stages s.. from layer i
    choice = [[-1] * (n + 1) for _ in range(k + 1)]
    best[k][n] = 0.0
    for s in range(k - 1, -1, -1):
        for i in range(s, n - (k - s) + 1):  # s layers before it, one per later stage after
            for j in range(i + 1, n - (k - s - 1) + 1):
                if not allowed(i, j):
                    break
                rest = best[s + 1][j]
                if rest == math.inf:
                    continue
                cost = combine(i, j, rest)
                if cost < best[s][i]:  # strict: the earliest j wins a tie
                    best[s][i], choice[s][i] = cost, j
    if best[0][0] == math.inf:
        return math.inf, None
    parts = [0]
    for s in range(k):
        parts.append(choice[s][parts[-1]])
    return best[0][0], parts


# ---------------------------------------------------------------------------- caching


def profile_key(
    model: ModelSpec, seq_len: int, micro: int, dtype_name: str, device_name: str = "cpu"
) -> str:
    """sha256 hex of everything a layer's measured cost depends on. Where the model came from
    (its directory, how logs name it) is left out, so moving a model directory keeps its
    profile."""
    manifest = {k: v for k, v in model.manifest().items() if k not in ("directory", "source")}
    what = {
        "format": FORMAT_VERSION,
        "model": manifest,
        "seq_len": seq_len,
        "micro": micro,
        "dtype": dtype_name,
        "device": device_name,
        "torch": torch.__version__,
    }
    text = json.dumps(what, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def cached_costs(
    cache_dir: str, key: str, measure: Callable[[], list[LayerCost]]
) -> list[LayerCost]:
    """The costs stored under `key` in `cache_dir`, measured (once per host) if missing.

    Without a valid file, this takes an exclusive lock on ``<key>.lock``, looks again (another
    process may have measured meanwhile), measures, and writes ``<key>.json`` atomically, so
    processes asking at once all get the numbers one of them measured. A corrupt file is
    measured again and replaced.
    """
    os.makedirs(cache_dir, exist_ok=True)
    path = os.path.join(cache_dir, f"{key}.json")
    costs = _load(path, key, warn=False)
    if costs is not None:
        return costs
    with open(os.path.join(cache_dir, f"{key}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            costs = _load(path, key, warn=True)
            if costs is None:
                costs = measure()
                _write(path, key, costs)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return costs


def _load(path: str, key: str, warn: bool) -> list[LayerCost] | None:
    """The costs in `path`, or None if there is none or it is corrupt (a warning if `warn`)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
            raise ValueError("not a dsnd layer profile of this version")
        if data.get("key") != key:
            raise ValueError(f"written for key {data.get('key')!r}")
        layers = data.get("layers")
        if not isinstance(layers, list) or not layers:
            raise ValueError("no layers")
        return [LayerCost.from_json(entry) for entry in layers]
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        if warn:
            log.warning("layer profile %s is unreadable (%s); measuring again", path, e)
        return None


def _write(path: str, key: str, costs: Sequence[LayerCost]) -> None:
    data = {"format": FORMAT_VERSION, "key": key, "layers": [c.to_json() for c in costs]}
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{key}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


# ---------------------------------------------------------------------------- together


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def target_device(env: dict[str, str], cuda_available: bool) -> str:
    """Where the run's layers will compute, to measure them there: this rank's GPU
    (``cuda:<LOCAL_RANK % count>``, the device it binds; not GPU 0 for every rank) where CUDA is
    there and DeepSpeed's accelerator is not pinned to another (``DS_ACCELERATOR``), else the
    CPU. The device count is read only when CUDA is there."""
    if not cuda_available or env.get("DS_ACCELERATOR", "cuda") not in ("", "cuda"):
        return "cpu"
    return f"cuda:{int(env.get('LOCAL_RANK', 0)) % torch.cuda.device_count()}"


def profile_partition(
    model: ModelSpec,
    seq_len: int,
    micro: int,
    num_stages: int,
    cache_dir: str,
    memory_cap: int | None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    repeats: int = 5,
) -> tuple[list[int], list[LayerCost]]:
    """`parts` balanced on the measured (or cached) layer costs of `model`, and those costs.
    `memory_cap` is in bytes (None: no cap)."""
    device = torch.device(device)
    dtype_name = str(dtype).removeprefix("torch.")
    key = profile_key(model, seq_len, micro, dtype_name, _device_name(device))

    def measure() -> list[LayerCost]:
        return measure_layers(model, seq_len, micro, repeats, dtype=dtype, device=device)

    costs = cached_costs(cache_dir, key, measure)
    seconds = [c.seconds for c in costs]
    parts = balance(seconds, [c.memory_bytes for c in costs], num_stages, memory_cap)
    stage_seconds = [round(sum(seconds[a:b]), 6) for a, b in pairwise(parts)]
    log.info(
        "profile partition of %s: parts %s, stage seconds %s", model.source, parts, stage_seconds
    )
    return parts, costs


def _device_name(device: torch.device) -> str:
    """The device kind, with the GPU's model name (timings differ between models)."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type
