"""Time to resume, end to end: from a process start to its first resumed ``step()``, ciuic against
a script that does the same with ``torch.load`` (and with safetensors).

    .venv/bin/python bench/resume.py [--rounds 5] [--dir /tmp/ciuic-resume] [--quick]
                                     [--cold all|data|none] [--systems ciuic,torch.load,...]

The state is issue 33's: ``nn.Sequential`` of 21 ``nn.Linear(2048, 2048)`` with
``torch.optim.Adam`` after one step (1.06 GB of weights and moments), seeded. The setup
(bench/resume_worker.py, in its own process) writes it as a ciuic snapshot into a local store
(a directory: the embedded default store), as a ``torch.save`` file and as a safetensors file,
each fsync'ed. Each measured run is a fresh interpreter, timed from just before its spawn to
the return of its first resumed training step; it reports when each phase ended (see the
worker) and a digest of the restored state, which must equal the setup's. Before every run the
page cache is dropped (``--cold all``: ``sync; echo 3 > /proc/sys/vm/drop_caches``, as root:
the libraries are read from disk too, as on a fresh node), or only the state's files are
evicted (``--cold data``: a restart on the node that wrote them, after the cache lost them),
or nothing (``none``: warm). The systems run interleaved, their order reversed every round;
printed: min / median / max of each phase, the ratio of the medians of the totals, and of what
each adds beyond the read (the total minus the read phase), ciuic against each peer.

``gc``: the time Python's garbage collector ran within the clock (it is not a phase: each
phase holds its share). The runs write and read bytecode as an installed package's modules are
(``--bytecode write``, even where ``PYTHONDONTWRITEBYTECODE`` is set: without it ciuic's 100
modules are compiled from source in every run, 0.1 s more); ``--baseline SRC`` adds a ciuic
imported from another checkout's ``src/``, for a change measured side by side with its parent.
``--quick`` uses 21 ``nn.Linear(256, 256)`` and 1 round (the test suite's smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))  # its modules, however it is loaded

from measure import evict

WORKER = Path(__file__).with_name("resume_worker.py")
SYSTEMS = ("ciuic", "torch.load", "safetensors")
#: (name, the timestamp that ends it, the one that starts it)
PHASES = (("interpreter", "up", "t0"), ("import torch", "torch", "up"),
          ("import lib", "lib", "torch"), ("build", "built", "lib"),
          ("manager", "manager", "built"), ("read", "restored", "manager"),
          ("first step", "step", "restored"))


def drop_caches(folder: Path, how: str) -> None:
    """Empty the page cache (``all``), or evict only the files under ``folder`` (``data``)."""
    os.sync()
    if how == "all":
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return
        except OSError as e:
            raise SystemExit(f"--cold all needs root to write /proc/sys/vm/drop_caches ({e}); "
                             "run as root, or use --cold data") from e
    if how == "data":
        evict(folder)


def spawn(system: str, folder: Path, width: int, bytecode: str,
          src: Path | None = None) -> dict[str, Any]:
    """Run the worker once (ciuic from ``src`` when given); its JSON line, with ``RESUME_T0``
    the time just before the spawn."""
    env = dict(os.environ)
    if bytecode == "write":  # as an installed package: its modules compiled once, not each run
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(src), *filter(None, [env.get("PYTHONPATH")])])
    env["RESUME_T0"] = repr(time.time())
    run = subprocess.run([sys.executable, str(WORKER), system.split("@")[0], str(folder),
                          str(width)], capture_output=True, text=True, env=env, timeout=900)
    lines = [x for x in run.stdout.splitlines() if x.startswith("RESUME-JSON ")]
    if run.returncode != 0 or not lines:
        raise RuntimeError(f"{system} failed (exit {run.returncode}):\n{run.stderr[-4000:]}")
    out: dict[str, Any] = json.loads(lines[-1].removeprefix("RESUME-JSON "))
    return out


def phases(run: dict[str, Any]) -> dict[str, float]:
    """A run's phase durations in seconds (the digest check taken out of the first step) and
    their total."""
    t = dict(run["times"], t0=run["t0"])
    out = {name: t[end] - t[start] for name, end, start in PHASES}
    out["first step"] -= run["check_s"]
    out["total"] = sum(out.values())
    out["beyond read"] = out["total"] - out["read"]
    return out


def summary(xs: list[float]) -> str:
    return f"{min(xs):6.3f} / {statistics.median(xs):6.3f} / {max(xs):6.3f}"


def machine() -> dict[str, object]:
    load = os.getloadavg()
    return {"node": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "load_avg_1_5_15": [round(x, 2) for x in load]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", type=Path, default=None, help="where the state is written (kept)")
    p.add_argument("--quick", action="store_true", help="21 x Linear(256, 256), 1 round")
    p.add_argument("--width", type=int, default=None, help="the layers' width (default 2048)")
    p.add_argument("--cold", choices=("all", "data", "none"), default="all")
    p.add_argument("--bytecode", choices=("write", "env"), default="write",
                   help="write: the runs may write and read bytecode (.pyc), as an installed "
                        "package's modules are compiled once (the default, even where "
                        "PYTHONDONTWRITEBYTECODE is set); env: as the environment says")
    p.add_argument("--baseline", type=Path, default=None, metavar="SRC",
                   help="also run 'ciuic@baseline': ciuic imported from SRC (the src/ folder "
                        "of another checkout, e.g. a worktree of the commit before a change)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated, from {', '.join(SYSTEMS)} (ciuic first: the ratios)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    a = p.parse_args(argv)
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown or not systems:
        p.error(f"--systems: unknown {', '.join(unknown) or '(none given)'}; "
                f"choose from {', '.join(SYSTEMS)}")
    if a.baseline is not None:
        if not (a.baseline / "ciuic" / "__init__.py").is_file():
            p.error(f"--baseline {a.baseline}: no ciuic package there (give a src/ folder)")
        systems.append("ciuic@baseline")
    width = a.width or (256 if a.quick else 2048)
    rounds = 1 if a.quick and a.rounds == 5 else a.rounds
    base = a.dir or Path(tempfile.mkdtemp(prefix="ciuic-resume-"))
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    try:
        setup = spawn("setup", base, width, a.bytecode)
        if a.baseline is not None:  # a run not measured: its bytecode is written
            spawn("ciuic", base, width, a.bytecode, a.baseline)
        print(f"state: 21 x Linear({width}, {width}) + Adam, "
              f"{setup['state_bytes'] / 2**30:.3f} GiB; on disk: ciuic "
              f"{setup['ciuic_bytes'] / 2**30:.3f} GiB, torch.save "
              f"{setup['torch_bytes'] / 2**30:.3f} GiB, safetensors "
              f"{setup['safetensors_bytes'] / 2**30:.3f} GiB; cache: {a.cold}; "
              f"{machine()}", flush=True)
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
        for r in range(rounds):
            for s in systems if r % 2 == 0 else list(reversed(systems)):
                drop_caches(base, a.cold)
                run = spawn(s, base, width, a.bytecode,
                            a.baseline if s == "ciuic@baseline" else None)
                if run["restored_digest"] != setup["digest"]:
                    raise RuntimeError(f"{s}: the restored state differs from the saved one "
                                       f"(digest {run['restored_digest'][:16]}, saved "
                                       f"{setup['digest'][:16]})")
                run["phases"] = phases(run)
                run["round"] = r
                runs[s].append(run)
                print(f"round {r + 1} {s:<14} total {run['phases']['total']:.3f} s, read "
                      f"{run['phases']['read']:.3f} s, gc {run['gc_s']:.3f} s, load "
                      f"{os.getloadavg()[0]:.2f}", flush=True)
    finally:
        if a.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    names = [name for name, _, _ in PHASES] + ["total", "beyond read", "gc"]
    for done in runs.values():
        for one in done:
            one["phases"]["gc"] = one["gc_s"]
    med = {s: {n: statistics.median(r["phases"][n] for r in runs[s]) for n in names}
           for s in systems}
    print(f"\n{'phase (s, min / median / max)':<30}" + "".join(f"{s:>26}" for s in systems))
    for n in names:
        print(f"{n:<30}" + "".join(f"{summary([r['phases'][n] for r in runs[s]]):>26}"
                                   for s in systems))
    ratios: dict[str, dict[str, float]] = {}
    if "ciuic" in systems:
        for peer in systems:
            if peer == "ciuic":
                continue
            ratios[peer] = {"total": med["ciuic"]["total"] / med[peer]["total"],
                            "beyond_read": med["ciuic"]["beyond read"] / med[peer]["beyond read"],
                            "beyond_read_extra_s": (med["ciuic"]["beyond read"]
                                                    - med[peer]["beyond read"])}
            print(f"ciuic / {peer}: total {ratios[peer]['total']:.2f}x, beyond the read "
                  f"{ratios[peer]['beyond_read']:.2f}x "
                  f"({ratios[peer]['beyond_read_extra_s']:+.3f} s)")
    stepped = {r["stepped_digest"] for rs in runs.values() for r in rs}
    out: dict[str, Any] = {"width": width, "cold": a.cold, "bytecode": a.bytecode,
                           "rounds": rounds, "setup": setup,
                           "runs": runs, "medians": med, "ratios": ratios,
                           "same_first_step": len(stepped) == 1, "machine": machine(),
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"first resumed step identical in every run: {out['same_first_step']}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
