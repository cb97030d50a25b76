"""The benchmark scripts' subprocess runner: ``paratrain.bench.runner`` (``paratrain bench`` uses it
too), started in the repository root."""
from pathlib import Path

from paratrain.bench import runner
from paratrain.bench.runner import descendants, kill_tree  # noqa: F401

REPO = Path(__file__).resolve().parent.parent


def run_cmd(cmd: list[str], log: Path, timeout_s: float, env: dict) -> tuple[int, float]:
    """``paratrain.bench.runner.run_cmd`` in the repository root."""
    return runner.run_cmd(cmd, log, timeout_s, env, cwd=REPO)
