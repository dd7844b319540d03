"""Write tests/file_costs.json from the log of a full test run with every duration listed:

    python -m pytest -q --durations=0 > /tmp/durations.log; python tests/_file_costs.py /tmp/durations.log

The seconds each test file took (setup, call and teardown summed over its tests). tests/conftest.py hands the files
to pytest-xdist's workers longest first, so that no long file starts last while the other workers idle. The table
only orders the files: a stale or missing entry costs wall time, never a result.
"""
import collections
import json
import re
import sys
from pathlib import Path

LINE = re.compile(r"\s*([\d.]+)s (?:call|setup|teardown)\s+(tests/[^:]+)::")


def main(log: str) -> None:
    costs: collections.Counter = collections.Counter()
    for line in Path(log).read_text().splitlines():
        m = LINE.match(line)
        if m:
            costs[m.group(2)] += float(m.group(1))
    out = Path(__file__).with_name("file_costs.json")
    out.write_text(json.dumps({k: round(v, 1) for k, v in costs.most_common()}, indent=0) + "\n")
    print(f"{out}: {len(costs)} files, {sum(costs.values()):.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
