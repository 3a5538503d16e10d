"""The air-gapped install (docs/gpu.md): scripts/wheelhouse.sh collects, for this Python and
platform, what an environment lacks; scripts/setup.sh --offline installs fpscale from it with no
package index into an environment that already holds torch, which it leaves alone; that environment
then trains. The environment stands for a GPU node: this test venv's packages (torch among them)
seen through a .pth file, less what a node lacks (DeepSpeed, hjson, pydantic and theirs, fpscale)."""
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import sysconfig

import pytest

from tests.parallel.launch import ROOT, run

NODE_LACKS = {"deepspeed", "hjson", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "fpscale"}


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def node_site(folder) -> list[str]:
    """A site folder of links to this environment's packages except NODE_LACKS; their freeze."""
    site = sysconfig.get_paths()["purelib"]
    hidden, freeze = set(), []
    for dist in importlib.metadata.distributions():
        name = canonical(dist.metadata["Name"])
        if name in NODE_LACKS:
            hidden |= {str(f).split("/")[0] for f in dist.files or []}
        else:
            freeze.append(f"{dist.metadata['Name']}=={dist.version}")
    folder.mkdir()
    for entry in os.listdir(site):
        if entry in hidden or entry.startswith(("__editable__", "_fpscale")) or entry.endswith(".pth"):
            continue
        os.symlink(os.path.join(site, entry), folder / entry)
    return freeze


def glibc_platform() -> str:
    libc, version = platform.libc_ver()
    assert libc == "glibc", libc
    major, minor = version.split(".")[:2]
    return f"manylinux_{major}_{minor}_{platform.machine()}"


@pytest.mark.slow
def test_wheelhouse_then_offline_setup_over_an_installed_torch_trains(tmp_path):
    freeze = node_site(tmp_path / "node-site")
    (tmp_path / "freeze.txt").write_text("\n".join(freeze) + "\n")
    wheels = tmp_path / "wheels"
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    made = run(["bash", "scripts/wheelhouse.sh", "--python", py, "--platform", glibc_platform(),
                "--have", str(tmp_path / "freeze.txt"), "--out", str(wheels)], timeout=500,
               env={"PYTHON": sys.executable})
    manifest = json.loads((wheels / "wheelhouse.json").read_text())
    assert {"fpscale", "deepspeed", "hjson", "pydantic"} <= set(manifest["collected"]), made.stdout[-2000:]
    assert "torch" in manifest["left_to_target"] and not any(w.startswith("torch-") for w in manifest["wheels"])
    # the node: a fresh environment whose torch (and the rest) is already there
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(tmp_path / "node")], check=True, timeout=120)
    node_py = str(tmp_path / "node" / "bin" / "python")
    purelib = subprocess.run([node_py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    with open(os.path.join(purelib, "node-site.pth"), "w") as fh:
        fh.write(str(tmp_path / "node-site") + "\n")
    torch_before = subprocess.run([node_py, "-c", "import torch; print(torch.__version__, torch.__file__)"],
                                  capture_output=True, text=True, check=True, timeout=120).stdout
    assert str(tmp_path / "node-site") in torch_before
    # the checkout's scripts run before any install: they put the checkout on sys.path themselves
    assert subprocess.run([node_py, "-c", "import fpscale"], capture_output=True, timeout=120,
                          cwd=tmp_path).returncode != 0
    for script in ("launch/plan.py", "bench/plan.py"):
        proc = subprocess.run([node_py, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "usage:" in proc.stdout, (script, proc.stderr[-2000:])
    setup = run(["bash", "scripts/setup.sh", "--offline", str(wheels)], timeout=400,
                env={"PYTHON": node_py, "PIP_NO_INDEX": "1", "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")})
    assert "[setup] ready: torch" in setup.stdout and "[setup] kernels on cpu" in setup.stdout, setup.stdout
    assert "Uninstalling" not in setup.stdout
    where = subprocess.run([node_py, "-c", "import torch, deepspeed, pydantic, fpscale; print(torch.__version__, "
                            "torch.__file__); print(deepspeed.__file__, fpscale.__file__)"],
                           capture_output=True, text=True, check=True, timeout=120, cwd=tmp_path).stdout
    assert where.splitlines()[0] == torch_before.strip()                     # torch untouched, not reinstalled
    assert all(path.startswith(purelib) for path in where.splitlines()[1].split())   # installed from the wheels
    # one training step with the installed command, outside the checkout
    trained = run([str(tmp_path / "node" / "bin" / "fpscale-pretrain"), "--config",
                   os.path.join(ROOT, "configs", "tiny_fpsa.yaml"), "data.source=synthetic", "data.seq_len=16",
                   "train.steps=1", "train.eval_interval=1", "train.eval_batches=1", "train.global_batch_tokens=0",
                   "train.global_batch=2", "train.micro_batch=2", "train.export_final=false",
                   f"train.out_dir={tmp_path / 'runs'}"], timeout=300)
    rows = [json.loads(line) for line in open(tmp_path / "runs" / "tiny_fpsa" / "metrics.jsonl")]
    assert [r["kind"] for r in rows] == ["train", "val"], trained.stdout[-2000:]
