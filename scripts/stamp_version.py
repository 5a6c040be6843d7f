"""Stamps the commit of this checkout, and whether its tree is dirty, into moetier/_build_info.json,
for a copy of the tree that will not be its own git checkout (an archive shipped to another machine,
unpacked inside another repository): bench records read the stamp there (bench/common.provenance)
instead of a foreign repository's HEAD. Run it from the checkout just before archiving the tree:

    python scripts/stamp_version.py

The stamp itself is ignored by git, so writing it leaves the dirty flag as it was.
"""

from __future__ import annotations

import json
import sys
import time

from moetier.bench.common import BUILD_INFO, git_state, project_root


def main() -> int:
    root = project_root()
    if root is None:
        print("error: this moetier is not its own git checkout; stamp it from the checkout it came from",
              file=sys.stderr)
        return 2
    state = git_state(root)
    BUILD_INFO.write_text(json.dumps({**state, "stamped": time.strftime("%Y-%m-%d %H:%M:%S %Z")}, indent=1) + "\n")
    print(f"{BUILD_INFO}: commit {state['commit']}" + (" (dirty tree)" if state["dirty"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
