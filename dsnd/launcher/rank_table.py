"""The rank table printed before launch: where each rank runs and what it holds.

Joins the pure topology math (rank -> pp, dp, cp, tp; columns in the order the rank formula
nests them, tp varying fastest) with the launch placement (rank -> host,
local_rank), so a user can check before any process starts that tensor-parallel peers share a
host and which stages sit where.
"""

from __future__ import annotations

from dsnd.topology import Topology

COLUMNS = ("rank", "host", "local_rank", "pp", "dp", "cp", "tp")


def rank_rows(topology: Topology, placement: list[tuple[str, int]]) -> list[dict]:
    """One dict per rank with keys `rank, host, local_rank, pp, dp, cp, tp`."""
    if len(placement) != topology.world_size:
        raise ValueError(
            f"placement has {len(placement)} ranks but topology "
            f"pp={topology.pp} dp={topology.dp} cp={topology.cp} tp={topology.tp} has "
            f"{topology.world_size}"
        )
    return [
        dict(zip(COLUMNS, (rank, host, local_rank, c.pp, c.dp, c.cp, c.tp), strict=True))
        for rank, (host, local_rank) in enumerate(placement)
        for c in [topology.coord(rank)]
    ]


def format_rank_table(rows: list[dict]) -> str:
    """A header line and one line per rank; numbers right-aligned, host left-aligned."""
    cells = [list(COLUMNS)] + [[str(row[c]) for c in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    lines = []
    for line in cells:
        parts = [
            text.ljust(w) if col == "host" else text.rjust(w)
            for col, text, w in zip(COLUMNS, line, widths, strict=True)
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)
