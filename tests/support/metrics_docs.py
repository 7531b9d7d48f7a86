"""docs/metrics.md's table of metrics, parsed (the metrics, alert and dashboard tests)."""
from __future__ import annotations

import re


def parse_metric_table(text: str) -> dict[str, dict]:
    """Rows of the '## Table' section: {name: {type, labels, service, meaning}}."""
    section = text.split("## Table", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, dict] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[0].startswith("`rlstream_"):
            continue
        name = cells[0].strip("`")
        assert name not in rows, f"{name} documented twice"
        # labels cell: "`label` = `v1`, `v2`" or "`label` (note)"; several labels separated by ";"
        labels = sorted(re.match(r"`(\w+)`", part.strip()).group(1) for part in cells[2].split(";"))\
            if cells[2] else []
        rows[name] = {"type": cells[1], "labels": labels, "service": cells[3], "meaning": cells[4]}
    return rows
