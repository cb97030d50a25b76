"""`paratrain plan` for a preset interconnect from a profile measured on another machine (a GPU lent
for minutes): the cache's key names the machine it was measured on, so the plan would measure again
here. This reads PROFILE instead and plans from it; nothing is measured or validated. With
--drop KEY the profile's KEY is left out first (to show what a term of the model changes).

  PARATRAIN_DATA=../shared/data python benchmarks/replan_profile.py PROFILE [--drop KEY] -- CONFIG \\
      --interconnect nvlink --nproc 1,2,4,8 --out DIR [--set ...]
"""
from __future__ import annotations

import argparse
import json
import sys
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
    prof = json.loads(own.profile.read_text())
    for key in own.drop:
        prof.pop(key, None)
    from paratrain import cli
    from paratrain.bench import plan_profile

    from paratrain.bench.profile import PROFILE_VERSION

    if prof.get("version") != PROFILE_VERSION:
        print(f"[replan] {own.profile} is profile version {prof.get('version')}, this paratrain's is "
              f"{PROFILE_VERSION}: the terms added since are missing from it", file=sys.stderr)
    plan_profile.load_profile = lambda args, cfg, task, out: (prof, True)
    rest = argv[split + 1:]
    if not any(a == "--interconnect" or a.startswith("--interconnect=") for a in rest) or "--validate" in rest:
        sys.exit("give a preset --interconnect (the profile's own links are another machine's), and no --validate")
    return cli.main(["plan", *rest])


if __name__ == "__main__":
    sys.exit(main())
