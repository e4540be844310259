"""How a host's GPUs are linked, read from `nvidia-smi topo -m`.

Shared by the all-reduce rule (a deploy reads the topology on the host before rendering) and
`vfleet doctor` (which reports it). Pure text parsing: no GPU is needed to test it.
"""

from __future__ import annotations

import re
from typing import Literal

_ANSI = re.compile(r"\x1b\[[0-9;]*m")

Links = Literal["nvlink", "pcie"]


def parse_topology(text: str) -> dict[tuple[int, int], str]:
    """GPU pairs -> link (NV#, PIX, PXB, PHB, NODE, SYS) from `nvidia-smi topo -m`."""
    lines = [_ANSI.sub("", line) for line in text.splitlines()]
    header = next((line.split("\t") for line in lines if "GPU0" in line.split()), [])
    cols = {
        j: int(c.strip()[3:]) for j, c in enumerate(header) if re.fullmatch(r"GPU\d+", c.strip())
    }
    links: dict[tuple[int, int], str] = {}
    for line in lines:
        cells = line.split("\t")
        row = cells[0].strip()
        if not re.fullmatch(r"GPU\d+", row):
            continue
        for j, col in cols.items():
            if j < len(cells) and int(row[3:]) != col:
                links[(int(row[3:]), col)] = cells[j].strip()
    return links


def group_links(text: str, gpus: list[int]) -> Links | None:
    """How the GPUs of one tensor-parallel group reach each other.

    "nvlink": every pair is NVLink-connected (NV#); "pcie": every pair is known and at least
    one is not NVLink; None: the text does not cover every pair (no nvidia-smi, another box).
    """
    links = parse_topology(text)
    pairs = [links.get((i, j)) for n, i in enumerate(gpus) for j in gpus[n + 1 :]]
    if not pairs or any(link is None or link in ("", "X") for link in pairs):
        return None
    return "nvlink" if all(str(link).startswith("NV") for link in pairs) else "pcie"
