"""What a ``pollbridge`` command costs before it does anything: wall time and CPU of short commands.

    python -m bench.cli_startup [--rounds 12] [--compare DIR] [--json F] [--quick]

Each round runs ``python -m pollbridge`` afresh for ``--version``, ``--help`` and a ``signal`` (for a task
that does not exist, against a scratch SQLite file with pollbridge installed: the command reads its
settings, connects, reflects the task table, looks the task up and exits 2 with one line, so it pays the
whole start-up of a real signal without changing anything). CPU is the child's user + system time
(``getrusage``). ``--compare DIR`` runs the same commands from another checkout (``PYTHONPATH=DIR``, e.g.
a ``git worktree`` of an older commit) in alternating order, round by round, so both meet the same
machine. Issue 20 names the CLI's start-up as CPU taken from the pipeline on two cores: an approval sent
with ``pollbridge signal`` is one such start.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import machine, write_json

COMMANDS: dict[str, list[str]] = {
    "version": ["--version"],
    "help": ["--help"],
    "signal": ["signal", "999999", "--kind", "callback"],
}


def run_once(tree: Path | None, database: str, args: list[str]) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds and exit code of one ``python -m pollbridge`` from ``tree`` (None: this one)."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pollbridge", "--database-url", database, *args], env=env,
                          cwd=tempfile.gettempdir(), capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), done.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--compare", type=Path, default=None, help="another checkout to alternate with")
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--quick", action="store_true", help="2 rounds (CI: the script keeps working)")
    args = parser.parse_args(argv)
    rounds = 2 if args.quick else args.rounds
    trees: dict[str, Path | None] = {"this": None}
    if args.compare is not None:
        if not (args.compare / "bridge" / "cli" / "main.py").is_file():
            parser.error(f"--compare {args.compare}: not a pollbridge checkout")
        trees["compare"] = args.compare
    with tempfile.TemporaryDirectory() as scratch:
        database = f"sqlite:///{Path(scratch) / 'startup.db'}"
        init = subprocess.run([sys.executable, "-m", "pollbridge", "--database-url", database, "init",
                               "--demo-schema"], capture_output=True, text=True)
        if init.returncode != 0:
            print(f"init failed: {init.stderr.strip()}", file=sys.stderr)
            return 1
        samples: dict[str, dict[str, list[tuple[float, float]]]] = {t: {c: [] for c in COMMANDS} for t in trees}
        for n in range(rounds):
            order = list(trees) if n % 2 == 0 else list(trees)[::-1]
            for tree in order:
                for name, command in COMMANDS.items():
                    wall, cpu, code = run_once(trees[tree], database, command)
                    expected = 2 if name == "signal" else 0
                    if code != expected:
                        print(f"{tree}: pollbridge {' '.join(command)} exited {code}, not {expected}", file=sys.stderr)
                        return 1
                    samples[tree][name].append((wall, cpu))
    results: dict[str, Any] = {}
    print(f"{'command':8}  {'tree':8}  {'wall p50 ms':>11}  {'wall min ms':>11}  {'CPU p50 ms':>10}")
    for name in COMMANDS:
        for tree in trees:
            walls = [w * 1000 for w, _ in samples[tree][name]]
            cpus = [c * 1000 for _, c in samples[tree][name]]
            row = {"wall_p50_ms": round(statistics.median(walls), 1), "wall_min_ms": round(min(walls), 1),
                   "cpu_p50_ms": round(statistics.median(cpus), 1), "runs": len(walls)}
            results.setdefault(name, {})[tree] = row
            print(f"{name:8}  {tree:8}  {row['wall_p50_ms']:>11}  {row['wall_min_ms']:>11}  {row['cpu_p50_ms']:>10}")
    write_json(args.json_path, {"command": sys.argv, "machine": machine(), "rounds": rounds,
                                "compare": str(args.compare) if args.compare else None, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
