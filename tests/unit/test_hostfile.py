"""Hostfile parsing, --include/--exclude selection and .deepspeed_env reading."""

from __future__ import annotations

import collections
import importlib
import os

import pytest

from dsnd.errors import UserError, shown
from dsnd.launcher.hostfile import (
    Host,
    allocation_hosts,
    deepspeed_env_paths,
    parse_hostfile,
    parse_hostfile_text,
    read_deepspeed_env,
    select_slots,
)

HOSTS = [Host("h1", 2), Host("h2", 4)]


# ---- hostfile --------------------------------------------------------------------------------


def test_parse_hostfile_reads_hosts_in_order(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text(
        "# cluster\n\nworker-1 slots=4\n  worker-0   slots=8  # inline comment\n127.0.0.2 slots=1\n"
    )
    assert parse_hostfile(str(path)) == [
        Host("worker-1", 4),
        Host("worker-0", 8),
        Host("127.0.0.2", 1),
    ]


def test_parse_hostfile_missing_file(tmp_path):
    path = str(tmp_path / "nope")
    with pytest.raises(UserError) as e:
        parse_hostfile(path)
    assert str(e.value) == f"{path}: hostfile not found"


@pytest.mark.parametrize(
    "line, message",
    [
        ("h slots=0", "slots must be a positive integer, got '0'"),
        ("h slots=4x", "slots must be a positive integer, got '4x'"),
        ("h slots=", "slots must be a positive integer, got ''"),
        ("h slots=-1", "slots must be a positive integer, got '-1'"),
        ("h slots=+2", "slots must be a positive integer, got '+2'"),
        ("h", "expected 'slots=N' after host 'h'"),
        ("h 4", "expected 'slots=N' after host 'h', got '4'"),
        ("h slots = 4", "expected 'slots=N' after host 'h', got 'slots'"),
        ("h slots=4 max_slots=8", "unexpected 'max_slots=8' after 'slots=4'"),
        ("slots=4", "missing host name before 'slots=4'"),
    ],
)
def test_parse_hostfile_bad_line_names_file_line_and_value(tmp_path, line, message):
    path = tmp_path / "hf"
    path.write_text(f"# header\ngood slots=1\n{line}\n")
    with pytest.raises(UserError) as e:
        parse_hostfile(str(path))
    assert str(e.value) == f"{path}:3: {message}"


def test_parse_hostfile_duplicate_host_names_first_line():
    text = "# x\nh slots=2\nother slots=1\n\nh slots=2\n"
    with pytest.raises(UserError) as e:
        parse_hostfile_text(text, "hf")
    assert str(e.value) == "hf:5: duplicate host 'h' (first on line 2)"


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n   \n"])
def test_parse_hostfile_no_hosts(text):
    with pytest.raises(UserError) as e:
        parse_hostfile_text(text, "hf")
    assert str(e.value) == "hf: no hosts"


NOT_A_HOST = "is not a host name or IP address"


@pytest.mark.parametrize(
    "name, why",
    [
        ("h;touch${IFS}x", "it has ';', '$', '{', '}'"),
        ("a${IFS}b", "it has '$', '{', '}'"),
        ("-oProxyCommand=x", "it starts with '-' (ssh, pdsh and mpirun would read an option)"),
        ("--help", "it starts with '-' (ssh, pdsh and mpirun would read an option)"),
        ("nöde1", "it has 'ö'"),
        ("node\u200b1", "it has '\\u200b'"),
        ("user@h", "it has '@'"),
        ("h_1", "it has '_'"),
        ("a..b", "it has an empty label"),
        ("h.", "it has an empty label"),
        ("h-.x", "label 'h-' starts or ends with '-'"),
        ("a.-b", "label '-b' starts or ends with '-'"),
        ("a." + "x" * 64, "label 'xxxxxxxxxx...' is 64 characters (at most 63)"),
        (".".join(["a" * 60] * 5), "it is 304 characters (at most 253)"),
        ("10.0.0.256", "it looks like an IPv4 address but is not one"),
        ("fe80::1%eth0;x", "its IPv6 zone 'eth0;x' is not an interface name"),
    ],
)
def test_parse_hostfile_refuses_what_no_host_can_be_naming_the_line(tmp_path, name, why):
    path = tmp_path / "hf"
    path.write_text(f"good slots=1\n{name} slots=2\n", encoding="utf-8")
    with pytest.raises(UserError) as e:
        parse_hostfile(str(path))
    # a name too long to echo whole is shortened, as every value in a one-line error
    assert str(e.value) == f"{path}:2: {shown(name)} {NOT_A_HOST}: {why}"


@pytest.mark.parametrize(
    "name",
    [
        "localhost",
        "node-01",
        "gpu07",
        "a.b-c.example.org",
        "10.0.0.1",
        "127.0.0.2",
        "::1",
        "fe80::1%eth0",
        "2001:db8::7",
        "x" * 63,
        "1node",
        "NODE",
    ],
)
def test_parse_hostfile_keeps_host_names_and_addresses(name):
    assert parse_hostfile_text(f"{name} slots=2\n", "hf") == [Host(name, 2)]


def test_slurm_node_names_are_checked_like_hostfile_names():
    env = {"SLURM_JOB_NODELIST": "gpu07,gpu;x", "SLURM_TASKS_PER_NODE": "2(x2)"}
    with pytest.raises(UserError) as e:
        allocation_hosts(env)
    assert str(e.value) == f"SLURM_JOB_NODELIST=gpu07,gpu;x: 'gpu;x' {NOT_A_HOST}: it has ';'"
    env["SLURM_JOB_NODELIST"] = "gpu[07-08]"
    assert allocation_hosts(env) == [Host("gpu07", 2), Host("gpu08", 2)]


# ---- --include / --exclude -------------------------------------------------------------------


@pytest.mark.parametrize(
    "include, exclude, expected",
    [
        (None, None, {"h1": [0, 1], "h2": [0, 1, 2, 3]}),
        ("", "", {"h1": [0, 1], "h2": [0, 1, 2, 3]}),
        ("h2", None, {"h2": [0, 1, 2, 3]}),
        ("h2@h1", None, {"h1": [0, 1], "h2": [0, 1, 2, 3]}),  # hostfile order, not filter order
        ("h2:3,1,1", None, {"h2": [1, 3]}),  # sorted, deduplicated
        ("h1:1@h2:0,2", None, {"h1": [1], "h2": [0, 2]}),
        ("h1@h1:0", None, {"h1": [0]}),  # DeepSpeed merges: the slot list wins over bare name
        ("h1: 1", None, {"h1": [1]}),
        (None, "h1", {"h2": [0, 1, 2, 3]}),
        (None, "h2:0,2", {"h1": [0, 1], "h2": [1, 3]}),
        (None, "h2:0,1,2,3", {"h1": [0, 1]}),  # a host with no slots left disappears
        (None, "h1@h1:0", {"h1": [1], "h2": [0, 1, 2, 3]}),  # again only slot 0 goes
    ],
)
def test_select_slots(include, exclude, expected):
    got = select_slots(HOSTS, include, exclude)
    assert got == expected
    assert list(got) == list(expected)  # insertion order is rank order


def test_select_slots_include_and_exclude_are_exclusive():
    with pytest.raises(UserError, match="^--include and --exclude are mutually exclusive$"):
        select_slots(HOSTS, "h1", "h2")


@pytest.mark.parametrize(
    "include, exclude, message",
    [
        ("h3", None, "--include: unknown host 'h3'; hostfile has h1, h2"),
        (None, "h1@h9:0", "--exclude: unknown host 'h9'; hostfile has h1, h2"),
        ("h1@", None, "--include: unknown host ''; hostfile has h1, h2"),
        ("h1:2", None, "--include: host 'h1' has no slot 2; its slots are 0..1"),
        (None, "h2:7", "--exclude: host 'h2' has no slot 7; its slots are 0..3"),
        ("h1:", None, "--include 'h1:': bad slot '' for host 'h1'"),
        ("h1:0:1", None, "--include 'h1:0:1': bad slot '0:1' for host 'h1'"),
        ("h1:-1", None, "--include 'h1:-1': bad slot '-1' for host 'h1'"),
        ("h1:a", None, "--include 'h1:a': bad slot 'a' for host 'h1'"),
        (None, "h1@h2", "--exclude 'h1@h2' leaves no slots to run on"),
        (None, "h1:0,1@h2", "--exclude 'h1:0,1@h2' leaves no slots to run on"),
    ],
)
def test_select_slots_errors(include, exclude, message):
    with pytest.raises(UserError) as e:
        select_slots(HOSTS, include, exclude)
    assert str(e.value) == message


SAME_AS_DEEPSPEED = [
    ("", ""),
    ("h2", ""),
    ("h2@h1", ""),
    ("h2:3,1,1", ""),
    ("h1:1@h2:0,2", ""),
    ("h1@h1:0", ""),
    ("h1: 1", ""),
    ("", "h1"),
    ("", "h2:0,2"),
    ("", "h2:0,1,2,3"),
    ("", "h1@h1:0"),
    ("h2:1@h2:3", ""),
    ("", "h2:1@h2:3@h1:0"),
]
DEEPSPEED_REJECTS = [
    ("h1", "h2"),
    ("h3", ""),
    ("h1:2", ""),
    ("", "h1:5"),
    ("h1:", ""),
    ("h1:0:1", ""),
    ("h1@", ""),
    ("h1:-1", ""),
]


def test_select_slots_matches_deepspeed_runner():
    runner = importlib.import_module("deepspeed.launcher.runner")
    pool = collections.OrderedDict((h.name, h.slots) for h in HOSTS)
    for include, exclude in SAME_AS_DEEPSPEED:
        theirs = runner.parse_inclusion_exclusion(pool, include, exclude)
        ours = select_slots(HOSTS, include, exclude)
        assert list(ours.items()) == list(theirs.items()), (include, exclude)
    for include, exclude in DEEPSPEED_REJECTS:
        with pytest.raises(ValueError):
            runner.parse_inclusion_exclusion(pool, include, exclude)
        with pytest.raises(UserError):
            select_slots(HOSTS, include, exclude)


# ---- .deepspeed_env --------------------------------------------------------------------------


def test_read_deepspeed_env_later_overrides_earlier_and_missing_ignored(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("NCCL_DEBUG=INFO\nA=home\n")
    (cwd / ".deepspeed_env").write_text("\nA=cwd\nOPTS=--x=1 --y=2\n  SPACED =  v w  \nEMPTY=\n")
    paths = [str(tmp_path / "missing"), *deepspeed_env_paths(str(home), str(cwd))]
    assert read_deepspeed_env(paths) == {
        "NCCL_DEBUG": "INFO",
        "A": "cwd",
        "OPTS": "--x=1 --y=2",
        "SPACED": "v w",
        "EMPTY": "",
    }


def test_deepspeed_env_paths_order_home_then_cwd():
    assert deepspeed_env_paths("/h", "/c") == ["/h/.deepspeed_env", "/c/.deepspeed_env"]
    assert deepspeed_env_paths("/h", "/c", "my_env") == [
        os.path.join("/h", "my_env"),
        os.path.join("/c", "my_env"),
    ]


@pytest.mark.parametrize(
    "line, message",
    [
        ("NO_EQUALS", "expected KEY=VALUE, got 'NO_EQUALS'"),
        ("=value", "invalid variable name ''"),
        ("#A=1", "invalid variable name '#A'"),
        ("export A=1", "invalid variable name 'export A'"),
        ("1A=1", "invalid variable name '1A'"),
    ],
)
def test_read_deepspeed_env_malformed_line(tmp_path, line, message):
    path = tmp_path / ".deepspeed_env"
    path.write_text(f"OK=1\n\n{line}\n")
    with pytest.raises(UserError) as e:
        read_deepspeed_env([str(path)])
    assert str(e.value) == f"{path}:3: {message}"
