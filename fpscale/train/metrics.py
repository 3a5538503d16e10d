"""Run metrics: one JSON object per logged step in metrics.jsonl, the same scalars in
TensorBoard and/or Weights & Biases (``train.loggers``), a console line with ETA. Per fixed-point
layer: iteration statistics.

W&B (``train.loggers: [tensorboard, wandb]``, ``pip install -e .[wandb]``): rank 0 only, project
``train.wandb_project``, the run named after the config's ``name`` with the resolved config as its
config, offline (files under runs/<name>/wandb, ``wandb sync`` them later) unless an API key is set
(WANDB_API_KEY or a ``wandb login``) or ``train.wandb_mode: online``. A resumed run continues the
same W&B run (its id is kept in runs/<name>/wandb_run_id); W&B drops the steps a resume trains
again (it accepts no step below the last one logged), which metrics.jsonl keeps.
"""
from __future__ import annotations

import json
import math
import os
import time

import numpy as np

from fpscale.log import get_logger

log = get_logger(__name__)


def peak_memory_gib(device) -> float:
    """Peak memory since the last ``reset_peak_memory``: the CUDA caching allocator's peak on a GPU; on
    CPU the process's resident-set high-water mark (Linux's VmHWM)."""
    import torch
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    try:
        with open("/proc/self/status") as fh:
            kib = next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))
    except (OSError, StopIteration):           # not Linux: since the start of the process
        import resource
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 2 ** 20


def reset_peak_memory(device) -> None:
    """Start a new peak (each log interval, each validation, has its own): the allocator's peak on a
    GPU, the high-water mark through /proc/self/clear_refs on Linux (elsewhere it is never reset)."""
    import torch
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


def summarize_layers(history: dict[str, list[dict]]) -> dict[str, dict]:
    """Aggregate the per-forward stats of each looped layer over a log interval: iterations (a
    halting layer's steps run) for every layer, then residuals and damping of a solver, or
    expected depth, halted fractions and KL of a halting layer."""
    out = {}
    for name, rows in history.items():
        its = np.array([r["iterations"] for r in rows], dtype=float)
        out[name] = {
            "iters_mean": float(its.mean()), "iters_median": float(np.median(its)),
            "iters_p90": float(np.percentile(its, 90)), "iters_max": float(its.max()),
        }
        if rows[-1].get("kind") == "halting":
            out[name].update(summarize_halting(rows))
            continue
        out[name].update({
            "residual_p50": float(np.mean([r["residual_p50"] for r in rows])),
            "residual_p90": float(np.mean([r["residual_p90"] for r in rows])),
            "converged_fraction": float(np.mean([r["converged_fraction"] for r in rows])),
            "eta": float(np.mean([r["eta"] for r in rows])),
        })
        if "entry_iterations_mean" in rows[-1]:     # fpsa with freezing: iterations per entry, per head
            out[name]["entry_iters_mean"] = float(np.mean([r["entry_iterations_mean"] for r in rows]))
            for head in rows[-1].get("head_iterations", {}):
                out[name][f"head_iters_{head}"] = float(np.mean([r["head_iterations"][head] for r in rows]))
        if "backward_iterations" in rows[-1]:
            out[name]["backward_iters_mean"] = float(np.mean([r.get("backward_iterations", 0) for r in rows]))
        if "windows" in rows[-1]:           # deep supervision: supervised windows per forward, their length
            out[name]["windows_mean"] = float(np.mean([r.get("windows", 0) for r in rows]))
            out[name]["window"] = rows[-1]["window"]
    return out


def summarize_halting(rows: list[dict]) -> dict:
    """A halting layer's interval: the means of its per-forward expected depth (mean, p50, p90),
    KL and bin entropy, and the fraction of tokens halted by each step (``halted_by_step_{t}``)."""
    keys = ("depth_mean", "depth_p50", "depth_p90", "halt_step_mean", "kl", "ponder", "bin_entropy")
    out = {key: float(np.mean([r[key] for r in rows])) for key in keys if key in rows[-1]}
    for t, frac in enumerate(np.mean([r["halted_by_step"] for r in rows], axis=0), start=1):
        out[f"halted_by_step_{t}"] = float(frac)
    return out


def scalars(record: dict, prefix: str = "train") -> dict[str, float]:
    """The scalars of a record, by the tag every logger gets: ``{prefix}/{key}`` and
    ``solver/{layer}/{key}``."""
    out = {}
    for key, value in record.items():
        if key in ("step", "kind") or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        out[f"{prefix}/{key}"] = value
    for layer, stats in record.get("layers", {}).items():
        for key, value in stats.items():
            out[f"solver/{layer}/{key}"] = value
    return out


def wandb_has_key() -> bool:
    """An API key in WANDB_API_KEY or in ~/.netrc (``wandb login``)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        import netrc
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbLogger:
    """One W&B run per fpscale run (resumed with it); see the module docstring."""

    def __init__(self, run_dir: str, name: str, config: dict, project: str = "fpscale", mode: str = "auto"):
        try:
            import wandb
        except ImportError:
            from fpscale.errors import ConfigError
            raise ConfigError("train.loggers", "wandb is not installed: pip install -e .[wandb] (or wandb)") from None
        id_file = os.path.join(run_dir, "wandb_run_id")
        if os.path.exists(id_file):
            run_id = open(id_file).read().strip()
        else:
            import secrets
            run_id = secrets.token_hex(4)
            with open(id_file, "w") as fh:
                fh.write(run_id)
        if mode == "auto":
            mode = os.environ.get("WANDB_MODE") or ("online" if wandb_has_key() else "offline")
        self.run = wandb.init(project=project, name=name, id=run_id, resume="allow", dir=run_dir, config=config,
                              mode=mode, settings=wandb.Settings(console="off", x_disable_stats=True, silent=True))

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class MetricsWriter:
    def __init__(self, run_dir: str, enabled: bool = True, loggers=("tensorboard",), name: str = "run",
                 config: dict | None = None, wandb_project: str = "fpscale", wandb_mode: str = "auto"):
        self.enabled = enabled
        self.tb = self.wandb = None
        self.file = None
        if enabled:
            os.makedirs(run_dir, exist_ok=True)
            self.file = open(os.path.join(run_dir, "metrics.jsonl"), "a")
            if "tensorboard" in loggers:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(os.path.join(run_dir, "tb"))
            if "wandb" in loggers:
                self.wandb = WandbLogger(run_dir, name, config or {}, wandb_project, wandb_mode)
        self.t0 = time.time()

    def log(self, record: dict, prefix: str = "train") -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        step, values = record["step"], scalars(record, prefix)
        if self.tb is not None:
            for tag, value in values.items():
                self.tb.add_scalar(tag, value, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(values, step)

    def console(self, step: int, total: int, record: dict) -> None:
        if not self.enabled:
            return
        elapsed = time.time() - self.t0
        eta = elapsed / max(step, 1) * (total - step)
        iters = " ".join(f"{name.split('.')[-1]}{name.split('.')[1]}:{s['iters_mean']:.1f}"
                         + (f" (depth {s['depth_mean']:.2f})" if "depth_mean" in s else "")
                         + (f" (dp max {s['iters_dp_max']:.1f})" if "iters_dp_max" in s else "")
                         + (f" (windows {s['windows_mean']:.1f} x {s['window']})" if "windows_mean" in s else "")
                         for name, s in record.get("layers", {}).items())
        wait = f" dp wait ~{record['dp_wait_est']:.0%}" if "dp_wait_est" in record else ""
        aux = f" aux {record['aux_loss']:.4f}" if "aux_loss" in record else ""
        mfu = (f" mfu {record['mfu_executed']:.1%}/{record['mfu_nominal']:.1%}" if "mfu_executed" in record
               else f" {record['tflops_executed'] * 1e3:.1f}/{record['tflops_nominal'] * 1e3:.1f} GFLOP/s")
        skipped = f" skipped {record['skipped_steps']}" if record.get("skipped_steps") else ""
        log.info(f"step {step:>6}/{total} loss {record['loss']:.4f}{aux} lr {record['lr']:.2e} "
                 f"gnorm {record['grad_norm']:.3f}{skipped} {record['tokens_per_s']:,.0f} tok/s{mfu} "
                 f"eta {eta / 60:.1f} min {('iters ' + iters) if iters else ''}{wait}")

    def close(self) -> None:
        """Flush and close; closing again does nothing."""
        if self.enabled and not self.file.closed:
            self.file.close()
            if self.tb is not None:
                self.tb.close()
            if self.wandb is not None:
                self.wandb.close()


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
