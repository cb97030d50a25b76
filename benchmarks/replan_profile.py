"""What one term of the plan's model changes: ``paratrain plan --profile PROFILE`` with the
profile's KEY left out first (e.g. ``--drop loop_one_rank_s``, the one-rank runs). Without
--drop it is ``paratrain plan --profile PROFILE`` itself. (With --drop the plan records a
temporary copy of PROFILE as its profile file.)

  PARATRAIN_DATA=../shared/data python benchmarks/replan_profile.py PROFILE [--drop KEY] -- CONFIG \\
      --interconnect nvlink --nproc 1,2,4,8 --out DIR [--set ...]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path


def main() -> int:
    argv = sys.argv[1:]
    if "--" not in argv:
        sys.exit(__doc__)
    split = argv.index("--")
    p = argparse.ArgumentParser()
    p.add_argument("profile", type=Path)
    p.add_argument("--drop", action="append", default=[])
    own = p.parse_args(argv[:split])
    from paratrain import cli

    if not own.profile.is_file():
        sys.exit(f"{own.profile}: no such profile; give the profile.json of a `paratrain plan --out DIR` run")
    with tempfile.TemporaryDirectory() as tmp:
        path = own.profile
        if own.drop:
            prof = json.loads(own.profile.read_text())
            for key in own.drop:
                prof.pop(key, None)
            path = Path(tmp) / "profile.json"
            path.write_text(json.dumps(prof))
            kept = own.profile.parent / "validation.json"  # the measured errors the plan shows, as without --drop
            if kept.is_file():
                shutil.copy(kept, Path(tmp) / "validation.json")
        return cli.main(["plan", *argv[split + 1:], "--profile", str(path)])


if __name__ == "__main__":
    sys.exit(main())
