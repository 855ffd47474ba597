"""Which samples a run trains on and evaluates on (`dsnd.data.held_out`): a default run holds out
the last eval.fraction of its samples, data.eval_path evaluates on a file of its own, and a
corpus too small to hold out a sample trains on everything with a line saying so."""

from __future__ import annotations

import numpy as np

from dsnd.config.load import load as load_config
from dsnd.data.held_out import load_eval_corpus, split_samples
from dsnd.data.sources import load_data


def load(path, sets):
    return load_config(path, sets).run


def _windows(samples) -> list[bytes]:
    x, y = samples.batch(np.arange(len(samples)))
    return [
        bytes(row) for row in np.concatenate([x.numpy(), y.numpy()[:, -1:]], 1).astype(np.uint8)
    ]


def test_a_default_run_holds_out_the_last_share_it_never_trains_on(tmp_path):
    (tmp_path / "c.txt").write_bytes(bytes(range(256)) * 40)  # 10240 bytes: 157 samples of 64
    run = load(None, [f"data.path={tmp_path / 'c.txt'}"])
    corpus = load_data(run.data, run.model)
    split = split_samples(run, corpus)
    assert (len(split.train), len(split.held_out), split.note) == (154, 3, None)  # 2% of 157
    nothing_held = load(None, [f"data.path={tmp_path / 'c.txt'}", "eval.fraction=0"])
    every = _windows(split_samples(nothing_held, corpus).train)
    assert len(every) == 157 and _windows(split.train) + _windows(split.held_out) == every


def test_eval_fraction_0_trains_on_everything_and_evaluates_nothing(tmp_path):
    (tmp_path / "c.txt").write_bytes(b"x" * 6500)
    run = load(None, [f"data.path={tmp_path / 'c.txt'}", "eval.fraction=0"])
    split = split_samples(run, load_data(run.data, run.model))
    assert (len(split.train), split.held_out, split.note) == (100, None, None)


def test_a_corpus_too_small_to_hold_out_a_sample_trains_on_all_of_it_and_says_so(tmp_path):
    (tmp_path / "small.txt").write_bytes(b"y" * 65 * 49)  # 49 samples: 2% is 0.98 of one
    run = load(None, [f"data.path={tmp_path / 'small.txt'}"])
    split = split_samples(run, load_data(run.data, run.model))
    assert (len(split.train), split.held_out) == (49, None)
    assert split.note == (
        f"not evaluating: {tmp_path / 'small.txt'} has 49 samples of 64 "
        "tokens, too few to hold out eval.fraction 0.02 of them (at least 50 "
        "needed); set data.eval_path, or a larger eval.fraction"
    )


def test_data_eval_path_is_the_held_out_set_and_all_of_data_path_trains(tmp_path):
    (tmp_path / "train.txt").write_bytes(b"t" * 65 * 30)
    (tmp_path / "held.txt").write_bytes(b"h" * 65 * 4 + b"h" * 10)
    run = load(
        None, [f"data.path={tmp_path / 'train.txt'}", f"data.eval_path={tmp_path / 'held.txt'}"]
    )
    assert load_eval_corpus(load(None, [])) is None
    split = split_samples(run, load_data(run.data, run.model), load_eval_corpus(run))
    assert (len(split.train), len(split.held_out), split.note) == (30, 4, None)
    assert set(_windows(split.held_out)) == {b"h" * 65} and split.held_out.name.endswith("held.txt")


def test_a_run_evaluates_at_its_end_with_its_checkpoints_or_every_eval_every_steps():
    from dsnd.trainer import _should_eval

    def evaluated(*sets: str) -> list[int]:
        run = load(None, ["train.steps=10", *sets])
        return [done for done in range(1, 11) if _should_eval(run, done)]

    assert evaluated() == [10]
    assert evaluated("checkpoint.every=4") == [4, 8, 10]
    assert evaluated("checkpoint.every=4", "eval.every=3") == [3, 6, 9, 10]
