#!/usr/bin/env python
"""Measure what the installed DeepSpeed does with every JSON config in this directory.

For each ``*.json`` next to this file:

1. fill the Hugging Face ``"auto"`` values the way transformers' ``HfTrainerDeepSpeedConfig``
   (``trainer_config_process`` + ``trainer_config_finalize``) fills them for a 1-rank run with
   per_device_train_batch_size=2, gradient_accumulation_steps=1, learning_rate=1e-4,
   betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, max_grad_norm=1.0, warmup_steps=0,
   10 training steps, fp16/bf16 off, and a model of hidden size 64.  Only the keys transformers
   fills are filled; any other ``"auto"`` is passed to DeepSpeed unchanged;
2. add ``{"type": "AdamW", "params": {"lr": 1e-4}}`` when the config has no ``optimizer``;
3. ``deepspeed.initialize`` a tiny MLP (64 -> 64 -> 64) with it, in one process holding a
   1-rank gloo world on 127.0.0.1, and train until two optimizer steps were taken
   (``2 * gradient_accumulation_steps`` micro steps of forward, ``engine.backward``,
   ``engine.step``).

Prints a Markdown table: trains, or fails with the exception's first line.  Also recorded:

* when a config fails only because of this CPU machine (fp16 unsupported, wandb/comet not
  installed), a second run with just that turned off;
* the top-level keys DeepSpeed never looked up (the config dict is wrapped in a dict that
  records lookups), i.e. keys it accepts and silently ignores;
* process-wide state DeepSpeed leaves changed after the engine is destroyed (ZeRO-3 patches
  ``torch.nn.functional.linear``, the comms logger stays on); it is put back before the next
  config, so one process gives the same results as ``--isolate``.

    python tests/deepspeed_configs/measure_deepspeed.py            # all configs, one process
    python tests/deepspeed_configs/measure_deepspeed.py --isolate  # one subprocess per config
    python tests/deepspeed_configs/measure_deepspeed.py --only hf-zero2-auto.json --json out.json

DeepSpeed JIT-builds its CPU ops (cpu_adam, ...) with ninja into TORCH_EXTENSIONS_DIR, which this
script points at a directory of its own under the system temp dir (``--ext-dir`` to change it);
the first builds of cpu_adam and fused_adam take a few minutes each, later runs take ~40 s.
Everything (rendezvous, gloo) stays on loopback.
DeepSpeed's own console output goes to a log file (``--log``), not to the terminal; monitors
write into a temporary work dir, removed at the end unless ``--keep``.

This file is not a pytest test (its name does not start with ``test_``).
"""

from __future__ import annotations

import argparse
import collections.abc
import contextlib
import copy
import gc
import glob
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))

# What the HF Trainer would be run with.
HIDDEN = 64
MICRO_BATCH = 2
GRAD_ACC = 1
WORLD_SIZE = 1
LR = 1e-4
BETAS = [0.9, 0.999]
EPS = 1e-8
WEIGHT_DECAY = 0.0
MAX_GRAD_NORM = 1.0  # TrainingArguments default, used for "gradient_clipping": "auto"
WARMUP_STEPS = 0
TOTAL_STEPS = 10
DEFAULT_OPTIMIZER = {"type": "AdamW", "params": {"lr": LR}}

OPTIMIZER_STEPS = 2
EXTRA_OPTIMIZER_STEPS = 3
MAX_MICRO_STEPS = 4096
PER_CONFIG_TIMEOUT_S = 900


# --------------------------------------------------------------------------------------------
# HF "auto" filling (mirrors transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig)
# --------------------------------------------------------------------------------------------
def _node(config, dotted):
    *parents, leaf = dotted.split(".")
    for p in parents:
        config = config.get(p)
        if not isinstance(config, dict):
            return None, leaf
    return config, leaf


def _fill(config, dotted, value):
    node, leaf = _node(config, dotted)
    if node is not None and node.get(leaf) == "auto":
        node[leaf] = value
        return True
    return False


def hf_fill(config):
    """Fill "auto" like transformers does; return the list of keys it filled."""
    filled = []

    def fill(key, value):
        if _fill(config, key, value):
            filled.append(key)

    fill("train_micro_batch_size_per_gpu", MICRO_BATCH)
    fill("gradient_accumulation_steps", GRAD_ACC)
    fill("train_batch_size", WORLD_SIZE * MICRO_BATCH * GRAD_ACC)
    fill("gradient_clipping", MAX_GRAD_NORM)
    fill("optimizer.params.lr", LR)
    fill("optimizer.params.betas", list(BETAS))
    fill("optimizer.params.eps", EPS)
    fill("optimizer.params.weight_decay", WEIGHT_DECAY)
    fill("scheduler.params.warmup_min_lr", 0)
    fill("scheduler.params.warmup_max_lr", LR)
    fill("fp16.enabled", False)
    fill("bf16.enabled", False)
    # trainer_config_finalize: bucket sizes from the model's hidden size
    fill("zero_optimization.reduce_bucket_size", HIDDEN * HIDDEN)
    zero = config.get("zero_optimization")
    if isinstance(zero, dict) and zero.get("stage") == 3:
        fill("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * HIDDEN * HIDDEN))
        fill("zero_optimization.stage3_param_persistence_threshold", 10 * HIDDEN)
    fill("scheduler.params.total_num_steps", TOTAL_STEPS)
    # transformers >= 5 fills max(1, warmup_steps): DeepSpeed >= 0.19.6 rejects 0.
    fill("scheduler.params.warmup_num_steps", max(1, WARMUP_STEPS))
    return filled


def leftover_autos(obj, path=""):
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += leftover_autos(v, f"{path}.{k}" if path else k)
    elif obj == "auto":
        out.append(path)
    return out


def prepare(raw):
    cfg = copy.deepcopy(raw)
    filled = hf_fill(cfg)
    added_optimizer = "optimizer" not in cfg
    if added_optimizer:
        cfg["optimizer"] = copy.deepcopy(DEFAULT_OPTIMIZER)
    return cfg, filled, added_optimizer


# --------------------------------------------------------------------------------------------
# Which top-level keys does DeepSpeed read?
# --------------------------------------------------------------------------------------------
_READ_KEYS: set = set()


class _TrackingDict(dict):
    """A dict that records which of its keys were looked up (get / [] / in / pop / keys)."""

    def __getitem__(self, key):
        _READ_KEYS.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        _READ_KEYS.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        _READ_KEYS.add(key)
        return super().__contains__(key)

    def pop(self, key, *default):
        _READ_KEYS.add(key)
        return super().pop(key, *default)

    def setdefault(self, key, default=None):
        _READ_KEYS.add(key)
        return super().setdefault(key, default)

    def keys(self):  # `"x" in d.keys()` reads only "x"; iterating over the view reads nothing
        return collections.abc.KeysView(self)


# --------------------------------------------------------------------------------------------
# Distributed world and the training run
# --------------------------------------------------------------------------------------------
def _free_loopback_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_env(ext_dir):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_loopback_port())
    os.environ["RANK"] = "0"
    os.environ["WORLD_SIZE"] = "1"
    os.environ["LOCAL_RANK"] = "0"
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["TORCH_EXTENSIONS_DIR"] = ext_dir
    # monitors: never reach the network
    os.environ["WANDB_MODE"] = "disabled"
    os.environ["COMET_OFFLINE_DIRECTORY"] = os.path.join(ext_dir, "comet-offline")
    os.makedirs(ext_dir, exist_ok=True)


def init_world():
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.messages = []

    def emit(self, record):
        try:
            msg = record.getMessage().strip().splitlines()[0]
        except Exception:  # pragma: no cover
            return
        if msg and msg not in self.messages:
            self.messages.append(msg)


# Process-wide things DeepSpeed is known to monkey-patch (ZeRO-3 / zero.Init).
_GLOBALS = (
    ("torch.nn.functional", "linear"),
    ("torch.nn.Module", "__init__"),
    ("torch.nn.Module", "apply"),
    ("torch.nn.Module", "register_parameter"),
    ("torch", "empty"),
    ("torch", "zeros"),
    ("torch", "ones"),
    ("torch", "full"),
    ("torch", "tensor"),
    ("deepspeed.comm.comm:comms_logger", "enabled"),  # comms_logger section
)


def _globals_snapshot():
    import importlib

    import torch

    snap = {}
    for owner_name, attr in _GLOBALS:
        if owner_name == "torch.nn.Module":
            owner = torch.nn.Module
        elif ":" in owner_name:
            mod_name, obj = owner_name.split(":")
            owner = getattr(importlib.import_module(mod_name), obj)
        else:
            owner = importlib.import_module(owner_name)
        snap[f"{owner_name.replace(':', '.')}.{attr}"] = (owner, attr, getattr(owner, attr))
    return snap


def _restore_leaks(snap):
    """Put back whatever DeepSpeed left patched; return the names of what was."""
    leaked = []
    for name, (owner, attr, value) in snap.items():
        if getattr(owner, attr) is not value:
            leaked.append(name)
            setattr(owner, attr, value)
    return leaked


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout(f"no result within {PER_CONFIG_TIMEOUT_S}s")


def _first_line(exc):
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    out = f"{type(exc).__name__}: {line}" if line else type(exc).__name__
    errors = getattr(exc, "errors", None)
    if callable(errors):  # pydantic ValidationError: name the offending fields
        with contextlib.suppress(Exception):
            fields = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors())
            out += f" [{fields}]"
    return out


def cpu_adaptation(cfg, error):
    """If `error` is only about this CPU machine (fp16 unsupported, a monitor's package missing),
    return (adapted config, what was turned off); else None."""
    cfg = copy.deepcopy(cfg)
    if "fp16 is not supported" in error and isinstance(cfg.get("fp16"), dict):
        cfg["fp16"]["enabled"] = False
        return cfg, "fp16.enabled=false"
    for section, module in (("wandb", "wandb"), ("comet", "comet_ml")):
        if f"No module named '{module}'" in error and isinstance(cfg.get(section), dict):
            off = [section]
            cfg[section]["enabled"] = False
            for other, mod in (("wandb", "wandb"), ("comet", "comet_ml")):  # both missing here
                other_cfg = cfg.get(other)
                if other != section and isinstance(other_cfg, dict) and other_cfg.get("enabled"):
                    try:
                        __import__(mod)
                    except ImportError:
                        cfg[other]["enabled"] = False
                        off.append(other)
            return cfg, ", ".join(f"{o}.enabled=false" for o in off)
    return None


def _snapshot(engine):
    import deepspeed
    import torch

    params = list(engine.module.parameters())
    ctx = (
        deepspeed.zero.GatheredParameters(params)
        if any(hasattr(p, "ds_id") for p in params)
        else contextlib.nullcontext()
    )
    with ctx:
        out = [p.detach().float().clone().cpu() for p in params if p.numel() > 0]
    return out or [torch.zeros(1)]


def run_one(path, workdir, raw_mode=False):
    """Initialize and train with one config (and, if it failed only because of this CPU
    machine, once more with that feature off); return a result dict."""
    name = os.path.basename(path)
    with open(path) as f:
        raw = json.load(f)
    if raw_mode:  # no HF filling, only the optimizer
        cfg, filled = copy.deepcopy(raw), []
        added_optimizer = "optimizer" not in cfg
        if added_optimizer:
            cfg["optimizer"] = copy.deepcopy(DEFAULT_OPTIMIZER)
    else:
        cfg, filled, added_optimizer = prepare(raw)
    snap = _globals_snapshot()
    result = _attempt(name, raw, cfg, workdir)
    result["left_patched"] = _restore_leaks(snap)
    result.update({"filled": filled, "added_optimizer": added_optimizer})
    if result["status"] == "fails":
        adapted = cpu_adaptation(cfg, result["error"])
        if adapted is not None:
            cpu_result = _attempt(name, raw, adapted[0], workdir + "-cpu")
            cpu_result["left_patched"] = _restore_leaks(snap)
            cpu_result["turned_off"] = adapted[1]
            result["cpu_rerun"] = cpu_result
    return result


def _attempt(name, raw, cfg, workdir):
    import deepspeed
    import torch

    result = {
        "file": name,
        "leftover_auto": leftover_autos(cfg),
        "status": "fails",
        "phase": "initialize",
        "error": None,
        "warnings": [],
        "unread_top_level_keys": [],
    }

    capture = _Capture()
    ds_logger = logging.getLogger("DeepSpeed")
    ds_logger.addHandler(capture)
    _READ_KEYS.clear()
    tracked = _TrackingDict(cfg)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN)
    )
    engine = None
    old_cwd = os.getcwd()
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)  # monitors write relative output paths
    old_handler = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(PER_CONFIG_TIMEOUT_S)
    t0 = time.time()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                engine, optimizer, _, scheduler = deepspeed.initialize(
                    model=model, model_parameters=model.parameters(), config=tracked
                )
                result["unread_top_level_keys"] = [k for k in raw if k not in _READ_KEYS]
                dtype = (
                    torch.bfloat16
                    if engine.bfloat16_enabled()
                    else torch.float16
                    if engine.fp16_enabled()
                    else torch.float32
                )
                result.update(
                    {
                        "zero_stage": engine.zero_optimization_stage(),
                        "dtype": str(dtype).replace("torch.", ""),
                        "micro_batch": engine.train_micro_batch_size_per_gpu(),
                        "grad_acc": engine.gradient_accumulation_steps(),
                        "optimizer": type(engine.optimizer).__name__,
                        "basic_optimizer": type(getattr(engine, "basic_optimizer", None)).__name__,
                        "scheduler": type(scheduler).__name__ if scheduler is not None else None,
                    }
                )
                before = _snapshot(engine)
                micro_steps = 0
                losses = []
                changed_at = None
                # The two steps asked for; if the weights have not moved by then (e.g. WarmupLR
                # starts at warmup_min_lr=0), up to EXTRA_OPTIMIZER_STEPS more to see if they do.
                last_step = OPTIMIZER_STEPS + EXTRA_OPTIMIZER_STEPS
                while micro_steps < MAX_MICRO_STEPS and (
                    engine.global_steps < OPTIMIZER_STEPS
                    or (changed_at is None and engine.global_steps < last_step)
                ):
                    x = torch.randn(engine.train_micro_batch_size_per_gpu(), HIDDEN)
                    y = torch.randn_like(x)
                    x, y = x.to(engine.device, dtype), y.to(engine.device)
                    result["phase"] = "forward"
                    out = engine(x)
                    loss = torch.nn.functional.mse_loss(out.float(), y)
                    result["phase"] = "backward"
                    engine.backward(loss)
                    result["phase"] = "step"
                    engine.step()
                    micro_steps += 1
                    losses.append(float(loss.detach()))
                    boundary = micro_steps % engine.gradient_accumulation_steps() == 0
                    if changed_at is None and boundary:
                        after = _snapshot(engine)
                        if any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)):
                            changed_at = engine.global_steps
                result["phase"] = "done"
                if changed_at is None:
                    status = "runs, weights unchanged"
                elif changed_at <= OPTIMIZER_STEPS:
                    status = "trains"
                else:
                    status = f"trains, weights unchanged until optimizer step {changed_at}"
                result.update(
                    {
                        "micro_steps": micro_steps,
                        "optimizer_steps": engine.global_steps,
                        "skipped_steps": getattr(engine, "skipped_steps", None),
                        "weights_first_changed_at_step": changed_at,
                        "loss_finite": all(v == v and abs(v) != float("inf") for v in losses),
                        "status": status,
                    }
                )
            except BaseException as exc:  # noqa: B036 - record everything, incl. SystemExit
                if isinstance(exc, KeyboardInterrupt):
                    raise
                if not result["unread_top_level_keys"] and _READ_KEYS:
                    result["unread_top_level_keys"] = [k for k in raw if k not in _READ_KEYS]
                result["error"] = _first_line(exc)
                result["traceback_tail"] = traceback.format_exc().strip().splitlines()[-6:]
            for w in caught:
                text = str(w.message).strip()
                msg = f"{w.category.__name__}: {text.splitlines()[0]}" if text else ""
                if msg and msg not in result["warnings"]:
                    result["warnings"].append(msg)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old_handler)
        os.chdir(old_cwd)
        ds_logger.removeHandler(capture)
        result["seconds"] = round(time.time() - t0, 1)
        result["warnings"] = capture.messages + result["warnings"]
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.destroy()
        del engine, model
        gc.collect()
    return result


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------
def _cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def describe(r):
    leaked = ""
    if r.get("left_patched"):
        names = ", ".join(f"`{x}`" for x in r["left_patched"])
        leaked = f"; leaves process-wide state changed: {names}"
    if r["status"] == "fails":
        return f"fails at {r['phase']}: `{_cell(r['error'])}`{leaked}"
    bits = [r["status"], f"ZeRO-{r['zero_stage']}", r["dtype"], r["basic_optimizer"]]
    if r["optimizer"] != r["basic_optimizer"]:
        bits.append(f"wrapped by {r['optimizer']}")
    if r.get("scheduler"):
        bits.append(r["scheduler"])
    bits.append(f"gas={r['grad_acc']}")
    if r.get("skipped_steps"):
        bits.append(f"skipped={r['skipped_steps']}")
    return ", ".join(str(b) for b in bits) + leaked


def table(results):
    lines = [
        "| config | DeepSpeed result | re-run with the CPU-only failure turned off "
        '| top-level keys DeepSpeed never read | "auto" left after filling |',
        "| --- | --- | --- | --- | --- |",
    ]
    for r in results:
        final = r.get("cpu_rerun", r)
        if final["status"] == "fails" and final.get("phase") in ("initialize", "process"):
            unread = "n/a (initialize failed)"
        else:
            unread = ", ".join(f"`{k}`" for k in final.get("unread_top_level_keys", [])) or "-"
        autos = ", ".join(f"`{k}`" for k in r.get("leftover_auto", [])) or "-"
        rerun = "-"
        if "cpu_rerun" in r:
            rerun = f"{r['cpu_rerun']['turned_off']}: {describe(r['cpu_rerun'])}"
        lines.append(f"| {r['file']} | {describe(r)} | {rerun} | {unread} | {autos} |")
    return "\n".join(lines)


@contextlib.contextmanager
def _fd_redirect(log_path):
    """Send fd 1 and 2 (DeepSpeed logs, ninja builds) to log_path; yield the real stdout."""
    sys.stdout.flush()
    sys.stderr.flush()
    real_out = os.dup(1)
    real_err = os.dup(2)
    with open(log_path, "a") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield os.fdopen(os.dup(real_out), "w")
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(real_out, 1)
            os.dup2(real_err, 2)
            os.close(real_out)
            os.close(real_err)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="config file names to run (default: all)")
    ap.add_argument("--json", help="also write the full results as JSON to this path")
    ap.add_argument(
        "--isolate",
        action="store_true",
        help="run every config in its own subprocess instead of one process",
    )
    ap.add_argument(
        "--ext-dir",
        default=os.path.join(tempfile.gettempdir(), f"dsnd-measure-torch-extensions-{os.getuid()}"),
        help="TORCH_EXTENSIONS_DIR for DeepSpeed's JIT-built ops",
    )
    ap.add_argument("--log", default=None, help="where DeepSpeed's console output goes")
    ap.add_argument(
        "--keep",
        action="store_true",
        help="keep the temporary work dir (monitor outputs, default log) at the end",
    )
    ap.add_argument(
        "--raw",
        action="store_true",
        help='do not fill the HF "auto" values (only add the missing optimizer)',
    )
    args = ap.parse_args(argv)

    files = sorted(glob.glob(os.path.join(HERE, "*.json")))
    if args.only:
        wanted = {os.path.basename(x) for x in args.only}
        files = [f for f in files if os.path.basename(f) in wanted]
    work_root = tempfile.mkdtemp(prefix="dsnd-measure-")
    log_path = args.log or os.path.join(work_root, "deepspeed.log")

    results = []
    if args.isolate:
        for f in files:
            out = os.path.join(work_root, os.path.basename(f) + ".result.json")
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--only",
                os.path.basename(f),
                "--json",
                out,
                "--ext-dir",
                args.ext_dir,
                "--log",
                log_path,
            ]
            if args.raw:
                cmd.append("--raw")
            proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if os.path.exists(out):
                with open(out) as fh:
                    results += json.load(fh)
            else:
                results.append(
                    {
                        "file": os.path.basename(f),
                        "status": "fails",
                        "phase": "process",
                        "error": f"subprocess exited {proc.returncode}",
                        "warnings": [],
                        "unread_top_level_keys": [],
                        "leftover_auto": [],
                    }
                )
        real = sys.stdout
    else:
        setup_env(args.ext_dir)
        with _fd_redirect(log_path) as real:
            import deepspeed  # noqa: F401  (imported here so its banner goes to the log)

            init_world()
            for f in files:
                results.append(
                    run_one(f, os.path.join(work_root, os.path.basename(f)[:-5]), raw_mode=args.raw)
                )
                print(f"{os.path.basename(f)}: {describe(results[-1])}", file=real, flush=True)
            real.flush()

    import deepspeed as _ds
    import torch as _torch

    header = (
        f"DeepSpeed {_ds.__version__}, torch {_torch.__version__}, "
        f"{'one subprocess per config' if args.isolate else 'one process'}, "
        f"{'auto NOT filled' if args.raw else 'HF auto filled'}, "
        f"1-rank gloo on 127.0.0.1"
    )
    if args.keep or args.log:
        header += f"; log: {log_path}"
    print(header, file=real)
    print(table(results), file=real, flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    if not args.keep:
        import shutil

        shutil.rmtree(work_root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
