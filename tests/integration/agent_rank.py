"""A stand-in rank for agent tests.

    python agent_rank.py OUT_DIR [RANK=ACTION ...]

Every rank writes OUT_DIR/rank_N.json (its pid and the variables named in DUMP_ENV, comma
separated) and then, by its action: `sleep` (default: until SIGTERM, which writes
OUT_DIR/rank_N.term and exits 0), `exit5` (exit code 5 after 1 s), `abort` (os.abort() after
1 s, as the NCCL watchdog ends a rank: SIGABRT past every Python handler), `child` (start a
grandchild `sleep 600`, record its pid, then sleep), `stubborn` (SIGTERM only writes rank_N.term).
"""

import json
import os
import signal
import subprocess
import sys
import time

out, rank = sys.argv[1], int(os.environ["RANK"])
actions = dict(item.split("=") for item in sys.argv[2:])
action = actions.get(str(rank), "sleep")
names = [n for n in os.environ.get("DUMP_ENV", "").split(",") if n]
record = {"pid": os.getpid(), "env": {n: os.environ.get(n) for n in names}}


def on_term(*_):
    open(os.path.join(out, f"rank_{rank}.term"), "w").close()
    if action != "stubborn":
        sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
if action == "child":
    record["child"] = subprocess.Popen(["sleep", "600"]).pid
with open(os.path.join(out, f"rank_{rank}.json"), "w") as f:
    json.dump(record, f)
if action == "exit5":
    time.sleep(1)
    sys.exit(5)
if action == "abort":
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
    time.sleep(1)
    os.abort()
time.sleep(600)
