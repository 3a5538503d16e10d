"""Collect every wheel a target Python environment lacks to run fpscale, for an offline install
(scripts/wheelhouse.sh is the command; docs/gpu.md the recipe).

    python scripts/wheelhouse.py --python 3.12 --platform manylinux_2_28_x86_64 --have node-freeze.txt --out wheels

On this (connected) machine:
  1. fpscale itself as a wheel (``pip wheel --no-deps --no-build-isolation .``);
  2. DeepSpeed as a wheel: PyPI has only its source; ``DS_BUILD_OPS=0`` builds it pure Python (its ops
     JIT-build on first use on the target; fpscale's torch AdamW needs none of them);
  3. the dependency closure of fpscale (+ ``--extras``) for the target: ``pip install --dry-run --report``
     with ``--python-version``/``--platform``, binary wheels only, where every package the target
     holds (``--have``, a ``pip freeze`` there; torch always) is a stub wheel of that version with no
     dependencies: the resolver plans with the target's versions (a conflict with them is an error
     here, not on the node), never downloads them nor walks into them (torch's CUDA libraries);
  4. ``pip download --no-deps`` of every other package of that closure.
Writes DIR/wheelhouse.json (what is there, what was left to the target). Only the standard library.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEEPSPEED = "0.19.8"              # the release fpscale is tested with (scripts/setup.sh installs the same)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_have(path: str | None) -> dict[str, str | None]:
    """{canonical name: version, or None for a bare name} of a ``pip freeze`` (``name==version``
    lines) or a plain list of names (a package known to be there, its version not)."""
    if not path:
        return {}
    have: dict[str, str | None] = {}
    for line in open(path):
        m = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*([^\s;#]+))?\s*(?:#.*)?$", line)
        if m:
            have[canonical(m.group(1))] = m.group(2)
    return have


def platform_tags(platform: str) -> list[str]:
    """pip matches ``--platform`` exactly: manylinux_2_28_x86_64 also takes the older manylinux
    wheels (2_17 .. 2_27 and the legacy aliases) a glibc 2.28 runs."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not m:
        return [platform]
    top, arch = int(m.group(1)), m.group(2)
    tags = [f"manylinux_2_{n}_{arch}" for n in range(top, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    return tags + [f"{alias}_{arch}" for n, alias in legacy.items() if n <= top]


def target_options(python: str, platform: str) -> list[str]:
    nodot = python.replace(".", "")
    opts = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp", "--abi", f"cp{nodot}",
            "--abi", "abi3", "--abi", "none"]
    for tag in platform_tags(platform):
        opts += ["--platform", tag]
    return opts


def run(cmd: list[str], env: dict | None = None) -> None:
    print("[wheelhouse] " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"[wheelhouse] FAILED (exit {proc.returncode}): {' '.join(cmd)}")


STUB = "fpscalestub"        # the local version label of a stub wheel


def stub_wheel(folder: str, name: str, version: str) -> str:
    """A wheel of ``name`` at ``version`` (its local label replaced by STUB) with no code and no
    dependencies: what the target already holds, for the resolver's eyes only."""
    import zipfile
    version = f"{version.split('+', 1)[0]}+{STUB}"
    dist = f"{canonical(name).replace('-', '_')}-{version}"
    path = os.path.join(folder, f"{dist}-py3-none-any.whl")
    files = {f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: fpscale-wheelhouse\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n"}
    files[f"{dist}.dist-info/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{dist}.dist-info/RECORD"])
    with zipfile.ZipFile(path, "w") as zf:
        for f, text in files.items():
            zf.writestr(f, text)
    return version


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=f"{sys.version_info.major}.{sys.version_info.minor}",
                    help="the target's Python (default: this one's)")
    ap.add_argument("--platform", default="manylinux_2_28_x86_64", help="the target's platform tag")
    ap.add_argument("--have", help="pip freeze of the target environment (or a list of names, versions unknown): "
                                   "nothing it lists is collected")
    ap.add_argument("--extras", default="liger",
                    help="fpscale extras to include, comma-separated (default liger: the fused loss head's "
                         "liger-kernel, pure Python; e.g. liger,hf; '' for none)")
    ap.add_argument("--out", required=True, help="the wheelhouse folder (created)")
    args = ap.parse_args(argv)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    have = read_have(args.have)
    if args.have and "torch" not in have:
        raise SystemExit(f"[wheelhouse] {args.have} lists no torch: the offline install goes over the target's "
                         "own torch (this wheelhouse never carries one); install torch there first")
    py = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    for stale in os.listdir(out):
        if stale.startswith("fpscale-") and stale.endswith(".whl"):
            os.remove(os.path.join(out, stale))
    run(py + ["wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, ROOT])
    [fpscale_wheel] = [f for f in os.listdir(out) if f.startswith("fpscale-") and f.endswith(".whl")]
    if "deepspeed" not in have and not any(f.startswith(f"deepspeed-{DEEPSPEED}-") for f in os.listdir(out)):
        run(py + ["wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, f"deepspeed=={DEEPSPEED}"],
            env={**os.environ, "DS_BUILD_OPS": "0"})
    with tempfile.TemporaryDirectory() as tmp:
        stubs = os.path.join(tmp, "stubs")
        os.makedirs(stubs)
        # stubs for what has a version; a bare name is resolved from the index but never collected;
        # torch is always a stub (no --have, or a bare name: the target's torch, of any version)
        targets = {n: v for n, v in have.items() if v and n not in ("fpscale", "pip", "setuptools", "wheel")}
        targets.setdefault("torch", "2.99")
        constraints = os.path.join(tmp, "constraints.txt")
        with open(constraints, "w") as fh:
            for name, version in sorted(targets.items()):
                fh.write(f"{name}=={stub_wheel(stubs, name, version)}\n")
            if "deepspeed" not in have:
                fh.write(f"deepspeed=={DEEPSPEED}\n")
        report_path = os.path.join(tmp, "report.json")
        extras = f"[{args.extras}]" if args.extras else ""
        run(py + ["install", "-q", "--dry-run", "--ignore-installed", "--report", report_path, "--target",
                  os.path.join(tmp, "target"), "--find-links", out, "--find-links", stubs, "-c", constraints,
                  *target_options(args.python, args.platform), os.path.join(out, fpscale_wheel) + extras])
        report = json.load(open(report_path))
    planned = {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
    local = {"fpscale", *(() if "deepspeed" in have else ("deepspeed",))}
    fetch = sorted(n for n, v in planned.items() if not v.endswith("+" + STUB) and n not in local and n not in have)
    if fetch:
        run(py + ["download", "-q", "--no-deps", "-d", out, *target_options(args.python, args.platform),
                  *(f"{n}=={planned[n]}" for n in fetch)])
    left = sorted(n for n, v in planned.items() if v.endswith("+" + STUB) or (n in have and n not in local))
    manifest = {"python": args.python, "platform": args.platform, "have": args.have, "extras": args.extras,
                "fpscale_wheel": fpscale_wheel, "collected": sorted([*fetch, *(n for n in local if n in planned)]),
                "left_to_target": left,
                "wheels": sorted(f for f in os.listdir(out) if f.endswith(".whl"))}
    with open(os.path.join(out, "wheelhouse.json"), "w") as fh:
        json.dump(manifest, fh, indent=1)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in manifest["wheels"]) / 2 ** 20
    print(f"[wheelhouse] {len(manifest['wheels'])} wheels, {size:.1f} MiB in {out} for Python {args.python} "
          f"{args.platform}: {', '.join(manifest['collected'])}; left to the target's own ({len(left)}): "
          f"{', '.join(left)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
