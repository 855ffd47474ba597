"""Start-up with a token file does not grow with the file: the pre-start check, loading, the
train/held-out split and the first batches, through the functions training uses, on sparse
token files of 1 GiB and 4 GiB (holes read as zeros and cost no disk), measured one after the
other in one process after a warm-up on a 1 MiB file: wall time and peak resident memory (the
high-water mark VmHWM, restarted before each; `ru_maxrss` is printed too, though a child's
starts at its parent's size, which the fork it was exec'd from held)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np

from tests.procs import ROOT, rank_env

SEQ = 255  # 2^21 and 2^23 samples: both past dsnd.data.shuffle.TABLE_SAMPLES
DOC_TOKENS = 1000  # a document every 1000 tokens: .docs holds 4 MB and 16 MB of starts

MEASURE = textwrap.dedent(f"""
    import gc, json, resource, sys, time
    from dsnd.config.schema import DataConfig, ModelConfig, RunConfig
    from dsnd.data import batch_for_step
    from dsnd.data.check import check_data
    from dsnd.data.held_out import split_samples
    from dsnd.data.batch_extras import batch_extras
    from dsnd.data.sources import load_data

    def status(key):  # bytes
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    def start_up(path):
        with open("/proc/self/clear_refs", "w") as f:  # the high-water mark restarts here
            f.write("5")
        before, t0 = status("VmRSS:"), time.perf_counter()
        run = RunConfig()
        run.data = DataConfig(path=path, packing="documents")
        run.model = ModelConfig(seq_len={SEQ})
        check_data(run.data, 256, run.model)
        corpus = load_data(run.data, run.model)
        train = split_samples(run, corpus).train
        mapped = status("VmHWM:")
        for step in range(3):
            where = (run.train.seed, step, 64, 1, 2, 8)
            batch_for_step(train, *where), batch_extras(train, *where)
        return {{"seconds": time.perf_counter() - t0, "before": before, "mapped": mapped,
                 "peak": status("VmHWM:"), "samples": len(train)}}

    start_up(sys.argv[1])  # first calls page in code (torch's too): not the corpus's cost
    out = []
    for path in sys.argv[2:]:
        gc.collect()  # the previous corpus unmapped
        out.append(start_up(path))
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps([dict(m, maxrss=maxrss) for m in out]))
""")


def _sparse_token_file(path: str, size: int) -> None:
    """`size` bytes of uint16 tokens (all 0, a hole), their document starts and a loss mask
    (a hole too), and a sidecar that describes them."""
    tokens = size // 2
    with open(path, "wb"):
        pass
    os.truncate(path, size)
    with open(path + ".mask", "wb"):
        pass
    os.truncate(path + ".mask", tokens)
    np.arange(0, tokens, DOC_TOKENS, dtype="<i8").tofile(path + ".docs")
    _evict(path + ".docs")  # as a file prepared earlier: read from disk, not from the cache
    meta = {
        "dtype": "uint16",
        "vocab_size": 256,
        "tokens": tokens,
        "tokenizer": "byte",
        "source": "sparse",
        "sha256": hashlib.sha256(path.encode()).hexdigest(),
        "eot": None,
        "documents": -(-tokens // DOC_TOKENS),
        "targets": True,
    }
    with open(path + ".json", "w") as f:
        json.dump(meta, f)


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _measure(*paths: str) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, *paths],
        cwd=ROOT,
        env=rank_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_start_up_time_and_memory_do_not_grow_with_the_token_file(tmp_path):
    warm, small, large = (str(tmp_path / f"{n}.bin") for n in ("warm", "1g", "4g"))
    _sparse_token_file(warm, 1 << 20)
    _sparse_token_file(small, 1 << 30)
    _sparse_token_file(large, 4 << 30)
    one, four = _measure(warm, small, large)
    mib = 1 << 20
    for name, m in (("1 GiB", one), ("4 GiB", four)):
        print(
            f"{name}: {m['samples']:,} samples; start-up {m['seconds']:.3f} s; resident "
            f"{m['before'] / mib:.1f} MiB before, peak {m['peak'] / mib:.1f} MiB "
            f"({(m['mapped'] - m['before']) / mib:+.1f} MiB to map and split, "
            f"{(m['peak'] - m['mapped']) / mib:+.1f} MiB for 3 batches); ru_maxrss "
            f"{m['maxrss'] / mib:.1f} MiB"
        )
    assert four["samples"] > 3.9 * one["samples"]
    # mapping and splitting read nothing; a batch reads its windows and, for document ids, one
    # binary search of the starts per window: at most a page per level, and the 3 batches' 192
    # windows touch most pages of the 4 MB of starts of 1 GiB, fewer of the 16 MB of 4 GiB
    assert four["mapped"] - four["before"] < one["mapped"] - one["before"] + 1 * mib
    assert four["peak"] - four["before"] < one["peak"] - one["before"] + 8 * mib
    assert four["peak"] - four["before"] < 32 * mib and four["peak"] < 512 * mib  # of 4 GiB
    assert four["seconds"] < 2 * one["seconds"] + 0.5
