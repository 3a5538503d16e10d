"""Which torch scripts/setup.sh installs, and whether this machine's GPU driver can run it.

    python scripts/torch_check.py plan      # "install torch==X: <why>" or "keep: <why>" (exit 0)
    python scripts/torch_check.py driver    # one line on the GPU, driver and torch; exit 1 if they cannot work

Only the standard library here (it runs before anything else is installed); torch is looked at in a
child process. The rules:
  * no torch yet: ``torch==$FPSCALE_TORCH`` (default 2.13.0). PyPI's Linux wheel of a torch release is a
    CUDA build, so a GPU machine gets CUDA from the package registry alone; a CPU machine of this
    project's build farm finds the CPU wheel of the same release first.
  * ``FPSCALE_TORCH`` set and another release installed (a CPU torch from an earlier set-up, say):
    replace it.
  * a GPU present (``nvidia-smi -L`` lists one) and a CPU build installed: replace it with the CUDA build.
  * otherwise keep what is there (a torch you installed yourself, for your CUDA, is left alone).
``driver`` compares the CUDA version torch was built for with the newest the driver supports (the
``CUDA Version`` that ``nvidia-smi`` prints): an older driver major cannot run it at all; an older minor
of the same major runs it under CUDA's minor-version compatibility (said, not refused).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

DEFAULT_TORCH = "2.13.0"


def gpus() -> list[str]:
    """The GPUs ``nvidia-smi -L`` lists (none without the driver's tool)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line for line in out.stdout.splitlines() if line.startswith("GPU ")] if out.returncode == 0 else []


def driver_cuda() -> str | None:
    """The newest CUDA version the driver supports, from nvidia-smi's header ("CUDA Version: 12.4")."""
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"CUDA Version:\s*([0-9]+\.[0-9]+)", out)
    return m.group(1) if m else None


def installed_torch(python: str) -> dict | None:
    """{"version", "cuda" (None for a CPU build), "available"} of the torch ``python`` imports, or None."""
    code = ("import json, torch; print(json.dumps({'version': torch.__version__, 'cuda': torch.version.cuda, "
            "'available': torch.cuda.is_available(), "
            "'device': torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}))")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def release(version: str) -> str:
    """The release of a torch version without its local label: 2.13.0+cpu -> 2.13.0."""
    return version.split("+", 1)[0]


def plan(installed: dict | None, gpu: bool, wanted: str | None) -> tuple[str | None, str]:
    """(the torch version to install or None to keep, why)."""
    target = wanted or DEFAULT_TORCH
    if installed is None:
        kind = "PyPI's CUDA build, for the GPU here" if gpu else "the CPU build where one is at hand"
        return target, f"no torch installed: torch {target} ({kind})"
    have = installed["version"]
    if wanted and release(have) != release(wanted):
        return wanted, f"FPSCALE_TORCH={wanted} asks for another release than the installed torch {have}"
    if wanted and "+" in wanted and have != wanted:
        return wanted, f"FPSCALE_TORCH={wanted} asks for another build than the installed torch {have}"
    if gpu and not installed["cuda"]:
        return target, (f"a GPU is present but torch {have} is a CPU build: replacing it with torch {target} "
                        "(PyPI's CUDA build)")
    return None, f"torch {have} ({'CUDA ' + installed['cuda'] if installed['cuda'] else 'CPU build'}) is kept"


def version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def driver_verdict(torch_cuda: str | None, driver: str | None, available: bool) -> tuple[bool, str]:
    """(can run, what to say) for torch built for ``torch_cuda`` on a driver supporting ``driver``."""
    if torch_cuda is None:
        return False, "torch is a CPU build: rerun scripts/setup.sh (it installs the CUDA build on a GPU machine)"
    if driver is None:
        return available, "nvidia-smi gives no CUDA version" + ("" if available else ": is the driver loaded?")
    t, d = version_tuple(torch_cuda), version_tuple(driver)
    if d[0] < t[0]:
        return False, (f"the driver supports CUDA up to {driver} but torch is built for CUDA {torch_cuda}: update "
                       f"the driver, or install a torch release built for CUDA {d[0]}.x "
                       f"(FPSCALE_TORCH=<release> bash scripts/setup.sh)")
    if d < t:
        note = (f"the driver supports CUDA {driver}, torch is built for {torch_cuda}: it runs under CUDA's "
                "minor-version compatibility")
        return available, note if available else note + ", yet torch sees no GPU"
    return available, "" if available else f"the driver supports CUDA {driver} but torch sees no GPU"


def main(argv: list[str]) -> int:
    what = argv[1] if len(argv) > 1 else ""
    python = sys.executable
    if what == "plan":
        version, why = plan(installed_torch(python), bool(gpus()), os.environ.get("FPSCALE_TORCH") or None)
        print(f"install torch=={version}: {why}" if version else f"keep: {why}")
        return 0
    if what == "driver":
        listed = gpus()
        torch = installed_torch(python) or {"version": "-", "cuda": None, "available": False, "device": None}
        if not listed:
            print(f"no GPU (nvidia-smi lists none): torch {torch['version']} runs on the CPU")
            return 0
        driver = driver_cuda()
        ok, note = driver_verdict(torch["cuda"], driver, torch["available"])
        print(f"{len(listed)} GPU(s), {torch['device'] or listed[0]}; driver supports CUDA {driver or '?'}; "
              f"torch {torch['version']} built for CUDA {torch['cuda'] or '-'}" + (f": {note}" if note else ""))
        return 0 if ok else 1
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
