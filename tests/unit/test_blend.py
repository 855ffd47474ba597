"""Blended corpora (`data.blend`): shares that follow the weights at every prefix, the same global
batch on every layout and after any resume, refusals by name, and a blend a checkpoint records."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from dsnd.checkpoint.files import CheckpointError
from dsnd.checkpoint.resume import compare_with_checkpoint
from dsnd.commands.launch import absolute_path_sets
from dsnd.config.load import load
from dsnd.config.schema import DataConfig, ModelConfig, RunConfig
from dsnd.data import SampleSet, batch_for_step
from dsnd.data.batch_extras import batch_extras, sample_sets
from dsnd.data.blend import PERIOD, BlendedSamples, schedule
from dsnd.data.check import check_data
from dsnd.data.sources import load_data
from dsnd.errors import UserError
from tests.models import spec_of
from tests.unit.test_token_corpus_load import write_tokens

MANY = tuple(np.random.default_rng(0).random(16) ** 3 + 1e-3)  # 16 files, shares 1e-3 to 0.3


@pytest.mark.parametrize(
    "weights", [(0.3, 0.7), (0.9, 0.1), (1, 1, 2), (0.5, 0.25, 0.125, 0.125), MANY[:6], MANY]
)
def test_every_prefix_keeps_each_share_near_its_weight(weights):
    sched = schedule(weights)
    share = np.asarray(weights) / sum(weights)
    assert np.abs(sched.quotas / PERIOD - share).max() <= 1 / PERIOD
    positions = np.arange(2 * PERIOD + 777)
    which, draw = sched.draws(positions)
    seen = np.zeros((len(positions) + 1, len(weights)))
    seen[1:] = np.cumsum(np.eye(len(weights))[which], axis=0)
    ideal = np.arange(len(positions) + 1)[:, None] * sched.quotas / PERIOD
    bound = 1 if len(weights) <= 2 else 2.5  # Sainte-Lague order: every prefix, every file
    assert np.abs(seen - ideal).max() <= bound
    for d in range(len(weights)):  # each file's draws are 0, 1, 2, ... in stream order
        assert draw[which == d].tolist() == list(range(int((which == d).sum())))


def _parts():
    rng = np.random.default_rng(1)
    return [SampleSet(rng.integers(0, 256, n * 9), 8, f"part{d}") for d, n in enumerate((37, 101))]


def test_the_global_batch_is_one_on_every_layout_and_after_any_resume():
    blend = BlendedSamples(_parts(), (0.25, 0.75), "blend")
    for step in (0, 1, 9):  # step 9 first as a resumed run would ask it: no state
        batches = {}
        for dp, micro in ((1, 16), (4, 2), (2, 1)):
            micro_batches = [
                m for r in range(dp) for m in batch_for_step(blend, 3, step, 16, r, dp, micro)
            ]
            batches[dp, micro] = tuple(torch.cat(t) for t in zip(*micro_batches, strict=True))
        one = batches[1, 16]
        assert all(torch.equal(a, b) for v in batches.values() for a, b in zip(one, v, strict=True))
    assert np.array_equal(blend.step_indices(16, 3, 9), blend.step_indices(16, 3, 9))


def test_samples_follow_the_weights_and_each_files_epochs():
    parts = _parts()
    blend = BlendedSamples(parts, (0.25, 0.75), "blend")
    ids = np.concatenate([blend.step_indices(16, 3, s) for s in range(40)])  # 640 samples
    first = ids < len(parts[0])
    assert first.sum() == 160  # exactly a quarter: 0.25 is whole slots
    for mine in (ids[first][:37], ids[~first][:101] - 37):  # each file: one epoch, then the next
        assert sorted(mine.tolist()) == list(range(len(mine)))
    x, _ = blend.batch(ids[:5])
    for row, i in zip(x, ids[:5], strict=True):
        part, local = (parts[0], i) if i < 37 else (parts[1], i - 37)
        assert torch.equal(row, part.sample(int(local))[0])


def _blend_files(tmp_path, **second):
    a = write_tokens(tmp_path / "a.bin", np.arange(900) % 256, starts=[0, 300])
    b = write_tokens(tmp_path / "b.bin", np.arange(500) % 200, starts=[0, 17], **second)
    return a, b


def test_a_blend_of_token_files_trains_and_is_recorded(tmp_path):
    a, b = _blend_files(tmp_path)
    data = DataConfig(
        blend=[{"path": a, "weight": 3}, {"path": b, "weight": 1}], packing="documents"
    )
    check_data(data, 256, ModelConfig(seq_len=8))
    corpus = load_data(data, ModelConfig())
    assert corpus.weights == (0.75, 0.25)
    train, held = sample_sets(corpus, 8, "documents", 0.1)
    layout = batch_extras(train, 0, 0, 8, 0, 2, 2)
    assert len(layout.weights) == 2 and layout.documents[0].shape == (2, 8)
    assert len(held) == 10 + 5 and isinstance(held, BlendedSamples)
    files = corpus.manifest()["blend"]
    assert [(f["path"], f["weight"], f["tokens"]) for f in files] == [
        (a, 0.75, 900),
        (b, 0.25, 500),
    ]
    other = load_data(
        DataConfig(blend=[{"path": a, "weight": 1}, {"path": b, "weight": 1}]), ModelConfig()
    )
    assert other.fingerprint != corpus.fingerprint  # another blend, another corpus


def test_a_resume_with_another_blend_is_refused_unless_named():
    then = RunConfig()
    then.data.blend = [{"path": "/d/a.bin", "weight": 0.3}, {"path": "/d/b.bin", "weight": 0.7}]
    model = spec_of("llama-tiny")
    manifest = {"model": model.manifest(), "config": {"run": dataclasses.asdict(then)}}
    now = RunConfig()
    now.data.blend = [{"path": "/d/a.bin", "weight": 0.5}, {"path": "/d/b.bin", "weight": 0.5}]
    with pytest.raises(CheckpointError, match=r"other settings \(data.blend "):
        compare_with_checkpoint(now, {}, model, manifest, "S", explicit=False)
    warned = compare_with_checkpoint(now, {}, model, manifest, "S", explicit=True)
    assert warned and warned[0].startswith("data.blend [{'path': '/d/a.bin', 'weight': 0.3}")


BLEND_ERRORS = [
    (
        {"path": "x.txt"},
        [{"path": "{a}", "weight": 1}],
        "data.blend and data.path=x.txt are exclusive: a blend names each of its files; set one of "
        "them",
    ),
    ({}, [], "data.blend must be a non-empty list of {{path, weight}}, got []"),
    ({}, ["{a}"], "data.blend[0] must be a mapping {{path, weight}}, got str '{a}'"),
    (
        {},
        [{"path": "{a}", "weigth": 1}],
        "data.blend[0]: unknown key 'weigth' (did you mean 'weight'?)",
    ),
    (
        {},
        [{"path": "{a}"}],
        "data.blend[0]: missing weight (each file of a blend is {{path, weight}})",
    ),
    (
        {},
        [{"path": "{a}", "weight": 1}, {"path": "{b}", "weight": 0}],
        "data.blend[1].weight must be a number > 0, got 0",
    ),
    ({}, [{"path": "{a}", "weight": True}], "data.blend[0].weight must be a number > 0, got True"),
    (
        {},
        [{"path": "{a}", "weight": 1}, {"path": "{b}", "weight": 1e-6}],
        "data.blend[1].weight=1e-06: 1e-06 of the blend, less than one sample in 65536 (the "
        "schedule's resolution); give it a larger weight or leave it out",
    ),
    (
        {},
        [{"path": "{a}", "weight": 1}, {"path": "{t}", "weight": 1}],
        "data.blend[1].path={t}: not a token file (a .bin written by 'dsnd data prepare', or set "
        "data.format: tokens)",
    ),
    (
        {},
        [{"path": "{a}", "weight": 1}, {"path": "{d}/nope.bin", "weight": 1}],
        "data.blend[1].path: file not found: {d}/nope.bin",
    ),
    (
        {"packing": "documents"},
        [{"path": "{a}", "weight": 1}, {"path": "{n}", "weight": 1}],
        "data.packing=documents: data.blend[1].path={n} records no document boundaries; use JSONL, "
        "a Hugging Face dataset, chat data or a token file prepared with its documents",
    ),
]


@pytest.mark.parametrize("settings, blend, message", BLEND_ERRORS)
def test_blend_errors_are_one_line_naming_the_entry(tmp_path, settings, blend, message):
    a, b = _blend_files(tmp_path)
    names = {
        "a": a,
        "b": b,
        "d": tmp_path,
        "t": tmp_path / "t.txt",
        "n": write_tokens(tmp_path / "n.bin", np.arange(100)),
    }
    (tmp_path / "t.txt").write_text("text")
    blend = json.loads(
        json.dumps(blend)
        .replace("{a}", a)
        .replace("{b}", b)
        .replace("{t}", str(names["t"]))
        .replace("{d}", str(tmp_path))
        .replace("{n}", names["n"])
    )
    with pytest.raises(UserError) as e:
        check_data(DataConfig(blend=blend, **settings), 256, ModelConfig(seq_len=8))
    assert str(e.value) == message.format(**names)


def test_blend_files_must_share_a_tokenizer_and_hold_a_sample(tmp_path):
    a, b = _blend_files(tmp_path, vocab=300)
    entries = [{"path": a, "weight": 1}, {"path": b, "weight": 1}]
    with pytest.raises(UserError) as e:
        check_data(DataConfig(blend=entries), 512)
    assert str(e.value) == (
        f"data.blend[1].path={b}: tokenized with byte (vocabulary 300), "
        f"data.blend[0].path={a} with byte (vocabulary 256); the files of a "
        "blend must share one tokenizer"
    )
    a, b = _blend_files(tmp_path)
    with pytest.raises(UserError, match=rf"^{b} has 500 tokens, fewer than the 601 "):
        check_data(DataConfig(blend=entries), 256, ModelConfig(seq_len=600))


def test_a_blend_is_set_in_yaml_or_on_the_command_line_and_launched_with_fixed_paths(tmp_path):
    run = load(
        None,
        ['data.blend=[{"path": "a.bin", "weight": 0.3}, {"path": "/abs/b.bin", "weight": 0.7}]'],
    ).run
    assert run.data.blend[1] == {"path": "/abs/b.bin", "weight": 0.7}
    sets = absolute_path_sets(run, [], "/w")
    assert json.loads(sets[-1].partition("=")[2]) == [
        {"path": "/w/a.bin", "weight": 0.3},
        {"path": "/abs/b.bin", "weight": 0.7},
    ]
