"""Checkpoints: exact resume, resume on another layout, evaluate / convert anywhere, crash safety,
preemption. Every run is launch/pretrain.py under torchrun (gloo on CPU) with a timeout."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import fpscale
from tests.parallel.launch import ROOT, free_port, pinned, run, torchrun_command

pytestmark = pytest.mark.multiprocess
BASE = ["data.source=synthetic", "data.seq_len=16", "model.vocab_size=32", "model.d_model=32",
        "model.max_seq_len=32", "train.micro_batch=4", "train.global_batch=16", "train.warmup=2",
        "train.steps=8", "train.log_interval=1", "train.eval_interval=4", "train.eval_batches=4",
        "train.save_interval=2", "train.keep_last=0", "solver.forward.stop_quantile=0.0"]
BASE += pinned("configs/tiny_mixed.yaml", BASE)      # fixed solver depths: a resume on another layout sums in
# another order, where a tolerance stop could flip an iteration (tests/parallel/launch.py)
LAYOUTS = {"zero1": (2, ["parallel.zero_stage=1"]), "zero3": (2, ["parallel.zero_stage=3"]),
           "tp2": (2, ["parallel.tp=2", "parallel.zero_stage=1"]),
           "tp2xdp2": (4, ["parallel.tp=2", "parallel.zero_stage=1"]),
           "dp4": (4, ["parallel.zero_stage=1"])}


def command(nproc: int, out, name: str, extra: list[str]) -> list[str]:
    return torchrun_command(nproc, "launch/pretrain.py", "--config", "configs/tiny_mixed.yaml", *BASE,
                            f"train.out_dir={out}", f"name={name}", *extra)


def pretrain(layout: str, out, name: str, *extra: str, timeout: float = 300):
    nproc, layout_args = LAYOUTS[layout]
    return run(command(nproc, out, name, layout_args + list(extra)), timeout=timeout)


def records(out, name: str, kind: str = "train") -> dict[int, dict]:
    """The last record of each step (a resumed run appends to the same metrics.jsonl)."""
    rows = [json.loads(line) for line in open(os.path.join(out, name, "metrics.jsonl"))]
    return {r["step"]: r for r in rows if r["kind"] == kind}


def descendants(pid: int) -> list[int]:
    """Processes below ``pid`` running launch/pretrain.py (torchrun's workers)."""
    found, todo = [], [pid]
    while todo:
        children = subprocess.run(["pgrep", "-P", str(todo.pop())], capture_output=True, text=True).stdout.split()
        for c in map(int, children):
            todo.append(c)
            try:
                if "launch/pretrain.py" in open(f"/proc/{c}/cmdline").read():
                    found.append(c)
            except OSError:
                pass
    return found


def copy_checkpoint(src_run, step: int, dst_run) -> None:
    tag = f"step_{step:08d}"
    os.makedirs(os.path.join(dst_run, "checkpoints"), exist_ok=True)
    shutil.copytree(os.path.join(src_run, "checkpoints", tag), os.path.join(dst_run, "checkpoints", tag))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Uninterrupted 8-step runs (checkpoints every 2 steps), one per layout, made on demand."""
    out = tmp_path_factory.mktemp("straight")
    done = {}

    def get(layout: str):
        if layout not in done:
            pretrain(layout, out, layout)
            done[layout] = out / layout
        return done[layout]
    return get


# DP2 ZeRO-1 and TP2 x DP2 resume on their own layout again and again, bit for bit, in the chaos test
# (tests/train/test_chaos.py); ZeRO-3, which it does not run, resumes here
@pytest.mark.parametrize("layout", ["zero3"])
def test_resume_on_the_same_layout_continues_exactly(tmp_path, straight, layout):
    ref = straight(layout)
    copy_checkpoint(ref, 4, tmp_path / "resumed")
    proc = pretrain(layout, tmp_path, "resumed")
    assert "resumed from" in proc.stdout and "step_00000004" in proc.stdout
    got, want = records(tmp_path, "resumed"), records(ref.parent, layout)
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:       # fp32 on CPU: the same optimizer state, RNG streams and sample stream
        assert got[step]["loss"] == want[step]["loss"], step
        assert got[step]["grad_norm"] == want[step]["grad_norm"], step
    assert records(tmp_path, "resumed", "val")[8]["val_loss"] == records(ref.parent, layout, "val")[8]["val_loss"]


@pytest.mark.parametrize("target", ["zero1", "dp4"])
def test_resume_on_another_layout_continues_the_run(tmp_path, straight, target):
    """Saved on TP2 x DP2, resumed on TP1 x DP2 and on DP4 through DeepSpeed's universal checkpoint."""
    ref = straight("tp2xdp2")
    copy_checkpoint(ref, 4, tmp_path / "moved")
    proc = pretrain(target, tmp_path, "moved")
    assert "through a universal checkpoint" in proc.stdout
    got, want = records(tmp_path, "moved"), records(ref.parent, "tp2xdp2")
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:      # the same micro-batches; sums in another order: 1e-5 relative
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-5), step
    assert (records(tmp_path, "moved", "val")[8]["val_loss"]
            == pytest.approx(records(ref.parent, "tp2xdp2", "val")[8]["val_loss"], rel=1e-5))


def test_evaluate_and_convert_a_tp_checkpoint_on_one_process(tmp_path, straight):
    """evaluate.py on one process reproduces the validation loss measured in training at that step;
    convert.py's safetensors in a fresh one-process model give the same loss; and back to a TP2
    checkpoint, evaluated again."""
    ref = straight("tp2xdp2")
    ckpt = ref / "checkpoints" / "step_00000004"
    want = records(ref.parent, "tp2xdp2", "val")[4]["val_loss"]
    run([sys.executable, "launch/evaluate.py", "--checkpoint", str(ckpt), "--out", str(tmp_path / "eval")],
        timeout=300)
    report = json.load(open(tmp_path / "eval" / "eval.json"))
    assert report["step"] == 4 and report["val_loss"] == pytest.approx(want, rel=1e-5)
    assert set(report["layers"]) == {"layers.1.fpsa", "layers.2.fpmamba", "layers.3.looped"}
    assert (tmp_path / "eval" / "iterations.png").stat().st_size > 1000

    run([sys.executable, "launch/convert.py", "--checkpoint", str(ckpt), "--out", str(tmp_path / "weights")],
        timeout=300)
    from safetensors.torch import load_file

    from fpscale.data.synthetic import SyntheticTask
    cfg = fpscale.load_config(str(tmp_path / "weights" / "config.yaml"))
    fresh = fpscale.build_model(cfg)
    fresh.load_state_dict(load_file(str(tmp_path / "weights" / "model.safetensors")))
    fresh.eval()
    val = SyntheticTask(cfg.data.task, cfg.model.vocab_size, cfg.data.seq_len, cfg.seed + 1_000_003, cfg.data.period)
    with torch.no_grad():
        losses = [float(fresh(b[:, :-1], targets=b[:, 1:])) for b in
                  (val.batch(list(range(i, i + 4))) for i in range(0, 16, 4))]
    assert sum(losses) / 4 == pytest.approx(want, rel=1e-5)

    run(torchrun_command(2, "launch/convert.py", "--weights", str(tmp_path / "weights"), "--name", "back",
                         "parallel.tp=2", f"train.out_dir={tmp_path}"), timeout=300)
    run([sys.executable, "launch/evaluate.py", "--checkpoint", str(tmp_path / "back" / "checkpoints" / "step_00000000"),
         "--out", str(tmp_path / "eval_back")], timeout=300)
    assert json.load(open(tmp_path / "eval_back" / "eval.json"))["val_loss"] == pytest.approx(want, rel=1e-5)


def test_killed_save_leaves_the_last_complete_checkpoint(tmp_path, straight):
    """Rank 0 dies by SIGKILL in the middle of step 4's save: the job ends (no hang), step 2 stays
    the newest complete checkpoint, and the resumed run continues as the uninterrupted one."""
    cmd = command(2, tmp_path, "killed", LAYOUTS["zero1"][1])
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
                                              "FPSCALE_FAULT": "SIGKILL@hash:4"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and time.time() - t0 < 240
    ckpts = tmp_path / "killed" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == ["step_00000002"]
    assert (ckpts / ".partial" / "step_00000004").exists()          # the half-written save, never published
    resumed = pretrain("zero1", tmp_path, "killed")
    assert "resumed from" in resumed.stdout and "step_00000002" in resumed.stdout
    want = records(straight("zero1").parent, "zero1")
    got = records(tmp_path, "killed")
    for step in range(3, 9):
        assert got[step]["loss"] == want[step]["loss"], step
    assert not (ckpts / ".partial" / "step_00000004").exists()


def test_damaged_checkpoint_is_skipped_with_a_warning_naming_the_file(tmp_path, straight):
    ref = straight("zero1")
    for step in (4, 6):
        copy_checkpoint(ref, step, tmp_path / "damaged")
    shard = tmp_path / "damaged" / "checkpoints" / "step_00000006" / "mp_rank_00_model_states.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    proc = pretrain("zero1", tmp_path, "damaged")
    assert "skipping checkpoint" in proc.stdout and str(shard) in proc.stdout and "sha256" in proc.stdout
    assert "step_00000004" in proc.stdout.split("resumed from")[1].splitlines()[0]
    got, want = records(tmp_path, "damaged"), records(ref.parent, "zero1")
    assert all(got[s]["loss"] == want[s]["loss"] for s in range(5, 9))


def test_sigterm_saves_exits_75_and_resumes_exactly(tmp_path, straight):
    cmd = command(2, tmp_path, "pre", LAYOUTS["zero1"][1] + ["train.save_interval=0"])
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    metrics = tmp_path / "pre" / "metrics.jsonl"
    try:
        deadline = time.time() + 240
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None and time.time() < deadline, "training did not start"
            time.sleep(0.1)
        workers = descendants(proc.pid)
        assert len(workers) == 2, workers
        for pid in workers:          # what SLURM or a cluster scheduler does to every task
            os.kill(pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert "preempted" in out and "exitcode  : 75" in out, out[-3000:]
    saved = [p.name for p in (tmp_path / "pre" / "checkpoints").iterdir() if p.name.startswith("step_")]
    assert len(saved) == 1
    stopped = int(saved[0].split("_")[1])
    assert 1 <= stopped < 8
    pretrain("zero1", tmp_path, "pre")
    got, want = records(tmp_path, "pre"), records(straight("zero1").parent, "zero1")
    assert all(got[s]["loss"] == want[s]["loss"] for s in range(1, 9))


def test_every_rank_hashes_its_share_of_a_save(straight):
    """A save's hashing is dealt over the ranks by bytes: rank 0 no longer hashes every shard of
    every rank (its bytes do not grow from 2 to 4 ranks), no rank hashes more than 1/world of the
    checkpoint plus one file, and every file is hashed exactly once (the manifest's record)."""
    from fpscale.train.checkpoint import verify
    per_world = {}
    for layout, world in (("zero1", 2), ("tp2xdp2", 4)):
        folder = os.path.join(straight(layout), "checkpoints", "step_00000008")
        manifest = json.load(open(os.path.join(folder, "manifest.json")))
        sizes = [f["bytes"] for f in manifest["files"].values()]
        hashed = {int(r): b for r, b in manifest["hashed_bytes_by_rank"].items()}
        assert sorted(hashed) == list(range(world)) and sum(hashed.values()) == sum(sizes)
        assert max(hashed.values()) <= sum(sizes) / world + max(sizes), hashed
        per_world[world] = hashed[0]
        assert verify(folder) is None and verify(folder, 1, world) is None
    assert per_world[4] <= per_world[2], per_world


def test_checkpoint_files_are_dealt_by_bytes():
    from fpscale.train.checkpoint import deal
    sizes = {"a": 100, "b": 60, "c": 50, "d": 10, "e": 10}
    shares = deal(sizes, 2)
    assert sorted(sum(shares, [])) == sorted(sizes)                       # each file exactly once
    assert sorted(sum(sizes[f] for f in s) for s in shares) == [110, 120]
    assert deal(sizes, 2) == shares and deal(sizes, 8)[5:] == [[], [], []]


def _resume_check_rank(rank: int, world: int, port: int, run_dir: str, out: str) -> None:
    """One rank of test_resume_verification_is_shared_by_the_ranks: counts the bytes it hashes."""
    import torch.distributed as dist

    from fpscale.parallel.state import ParallelState
    from fpscale.train import checkpoint
    from fpscale.train.checkpoint import format as checkpoint_format
    from fpscale.train.resume import choose_checkpoint
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    hashed, real = [], checkpoint_format.sha256_file

    def counting(path):
        hashed.append(os.path.getsize(path))
        return real(path)
    checkpoint_format.sha256_file = counting      # the manifest's hashing (fpscale.train.checkpoint.format)
    state = ParallelState(rank=rank, world_size=world, dp_rank=rank, dp_size=world)
    chosen = choose_checkpoint("auto", run_dir, state)
    auto_bytes = sum(hashed)
    try:
        choose_checkpoint(os.path.join(run_dir, "checkpoints", "step_00000004"), run_dir, state)
        error = None
    except checkpoint.CheckpointError as exc:
        error = str(exc)
    json.dump({"chosen": chosen, "auto_bytes": auto_bytes, "error": error},
              open(os.path.join(out, f"rank{rank}.json"), "w"))
    dist.barrier()
    dist.destroy_process_group()


def test_resume_verification_is_shared_by_the_ranks(tmp_path):
    """Resume checks a checkpoint with every rank hashing its share (as a save does), not every
    rank (or rank 0) re-reading all of it: on 4 ranks each hashes at most a quarter of the bytes
    plus one file, the files are each hashed once, and a damaged file is found whichever rank's
    share it falls in, with the same answer on every rank (the newest checkpoint is skipped for
    the one before it; naming it explicitly is an error on every rank)."""
    import torch.multiprocessing as mp

    from fpscale.train.checkpoint import write_manifest
    run_dir, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    sizes = [300_000, 200_000, 150_000, 120_000, 90_000, 60_000, 30_000, 10_000]
    for step in (2, 4):
        folder = run_dir / "checkpoints" / f"step_{step:08d}"
        folder.mkdir(parents=True)
        for i, n in enumerate(sizes):
            (folder / f"shard_{i}.pt").write_bytes(os.urandom(n))
        write_manifest(str(folder))
    damaged = run_dir / "checkpoints" / "step_00000004" / "shard_5.pt"     # same size, other bytes
    damaged.write_bytes(os.urandom(sizes[5]))
    world = 4
    ctx = mp.start_processes(_resume_check_rank, args=(world, free_port(), str(run_dir), str(out)), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise AssertionError("the ranks did not finish the resume check within 120 s")
    ranks = [json.load(open(out / f"rank{r}.json")) for r in range(world)]
    assert {r["chosen"] for r in ranks} == {str(run_dir / "checkpoints" / "step_00000002")}
    assert all(r["error"] and "shard_5.pt fails its sha256 checksum" in r["error"] for r in ranks), ranks
    # step 4 (stopped at the damaged file in one share) and step 2 in full: every rank a share of each
    hashed = [r["auto_bytes"] for r in ranks]
    assert max(hashed) <= 2 * (sum(sizes) / world + max(sizes)), hashed
    assert sum(hashed) <= 2 * sum(sizes) and min(hashed) > 0, hashed


def test_a_tp2_checkpoint_exports_the_hf_model_of_its_one_process_consolidation(tmp_path, straight):
    """--to hf from a TP2 checkpoint: the same weights as from convert.py's one-process
    consolidation, and the Hugging Face model's validation loss is the one the TP2 run measured."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from fpscale.data.synthetic import SyntheticTask
    ref = straight("tp2")
    ckpt = ref / "checkpoints" / "step_00000004"
    want = records(ref.parent, "tp2", "val")[4]["val_loss"]
    run([sys.executable, "launch/convert.py", "--checkpoint", str(ckpt), "--to", "hf", "--no-tokenizer",
         "--out", str(tmp_path / "hf_tp2")], timeout=300)
    run([sys.executable, "launch/convert.py", "--checkpoint", str(ckpt), "--out", str(tmp_path / "weights")],
        timeout=300)
    run([sys.executable, "launch/convert.py", "--checkpoint", str(tmp_path / "weights"), "--to", "hf",
         "--no-tokenizer", "--out", str(tmp_path / "hf_one")], timeout=300)
    a, b = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("hf_tp2", "hf_one"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.load(open(tmp_path / "hf_tp2" / "config.json")) == json.load(open(tmp_path / "hf_one" / "config.json"))

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf_tp2"), trust_remote_code=True).eval()
    cfg = fpscale.load_config(str(tmp_path / "weights" / "config.yaml"))
    val = SyntheticTask(cfg.data.task, cfg.model.vocab_size, cfg.data.seq_len, cfg.seed + 1_000_003, cfg.data.period)
    with torch.no_grad():
        losses = [float(hf(b, labels=b).loss) for b in (val.batch(list(range(i, i + 4))) for i in range(0, 16, 4))]
    assert sum(losses) / 4 == pytest.approx(want, rel=1e-5)
