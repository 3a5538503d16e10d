"""The training loop: one process with torch's AdamW, or several through the DeepSpeed engine
(ZeRO stage from ``parallel.zero_stage``), with the same optimizer, schedule and data order.

    python launch/pretrain.py --config configs/tiny_fpsa.yaml train.steps=50
    deepspeed --num_gpus 2 launch/pretrain.py --config configs/tiny_mixed.yaml
"""
from __future__ import annotations

import math
import os
import time

import torch
import torch.distributed as dist
import yaml

from fpscale.config import Config, config_to_dict
from fpscale.data.loader import DistributedBatches
from fpscale.log import get_logger
from fpscale.ops import kernels
from fpscale.parallel import agree
from fpscale.parallel.compile import apply_compile
from fpscale.parallel.heartbeat import Heartbeat
from fpscale.parallel.layers import global_grad_norm
from fpscale.parallel.parallelize import parallelize
from fpscale.parallel.random import RNGTracker, seed_default_stream
from fpscale.parallel.state import ParallelState, init_parallel, new_host_group
from fpscale.solvers.chunked import check_cuda_graphs
from fpscale.solvers.stats import as_dicts
from fpscale.train import checkpoint, faults
from fpscale.train.build import build_datasets, check_deep_supervision, initial_model
from fpscale.train.config import resolve_batch
from fpscale.train.deepspeed_config import deepspeed_config
from fpscale.train.flops import peak_tflops, training_flops
from fpscale.train.imbalance import dp_imbalance
from fpscale.train.metrics import MetricsWriter, peak_memory_gib, perplexity, reset_peak_memory, summarize_layers
from fpscale.train.optimizers import apply_schedule, attach_layout, build_optimizer, param_groups  # noqa: F401
from fpscale.train.precision import autocast, set_matmul_precision
from fpscale.train.resume import plan_resume, resume
from fpscale.train.signals import StepBoundary
from fpscale.train.state import TrainState
from fpscale.train.validation import depth_scalars, validate, validate_depths, validation_lines

logger = get_logger(__name__)


def split_batch(batch: torch.Tensor, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    batch = batch.to(device) if device is not None else batch
    return batch[:, :-1], batch[:, 1:]


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch on ``device``: on CUDA through pinned memory, copied without blocking the host (the
    copy is queued on the stream; the host goes on launching)."""
    if device.type == "cuda":
        return batch.pin_memory().to(device, non_blocking=True)
    return batch.to(device)


def collect_layer_stats(model, into: dict[str, list]) -> None:
    """Append the last forward's statistics of every looped layer to ``into``: the SolverStats
    or HaltingStats themselves, whose tensors stay on the device until a log step reads them
    (``as_dicts``)."""
    for name, stats in model.layer_stats().items():
        into.setdefault(name, []).append(stats)


class Trainer:
    """One training run. Use it as a context manager (or call ``close``): on leaving, the metrics
    are flushed and, when the trainer initialised torch.distributed itself, the process groups
    are destroyed.

        with Trainer(cfg) as trainer:
            trainer.train()
    """

    def __init__(self, cfg: Config, log: bool = True, state: ParallelState | None = None,
                 deepspeed_overrides: dict | None = None):
        """``deepspeed_overrides`` are merged into the DeepSpeed config (e.g. its comms logger)."""
        self.cfg = cfg
        t = cfg.train
        self.owns_state = state is None
        self.state = state or init_parallel(cfg.parallel.tp, cfg.parallel.timeout_s, cfg.parallel.engine)
        cfg.parallel.engine = self.state.engine           # config.yaml records the engine that runs
        self.heartbeat = None             # names a rank that vanishes (fpscale/parallel/heartbeat.py)
        if self.state.distributed:
            self.heartbeat = Heartbeat.start(self.state.rank, self.state.world_size, cfg.parallel.timeout_s)
        if t.micro_batch == "auto":       # the largest that fits this device (fpscale.train.memory_plan)
            from fpscale.train.memory_plan import auto_micro_batch
            t.micro_batch = auto_micro_batch(cfg, self.state.dp_size, self.state.device, self.state.engine)
            cfg._check_solvers(t.micro_batch)
            if self.state.is_main and log:
                logger.info("train.micro_batch: auto -> %d (the largest that fits, fpscale-plan)", t.micro_batch)
        self.batch = resolve_batch(t, self.state.dp_size)
        check_deep_supervision(cfg, self.state.dp_size)
        cfg.check_micro_batch(self.batch.micro_batch)
        if self.state.is_main and log:
            logger.info(self.batch.describe(cfg.data.seq_len))
        self.device = self.state.device
        set_matmul_precision(t.precision, self.device)       # TF32 for an fp32 run on CUDA
        model = initial_model(cfg, self.state)
        seed_default_stream(cfg.seed, self.state)
        rng = RNGTracker.for_tp(cfg.seed, self.state)
        self.model = parallelize(model, self.state, rng).to(self.device)
        agree.attach(self.model, self.state)          # solver.forward.agree: dp
        check_cuda_graphs(self.model, self.device, self.state.tp_size)      # solver.execution.cuda_graph: CUDA, no TP
        apply_compile(self.model, t.compile, log=log and self.state.is_main, device=self.device)   # train.compile
        if self.state.distributed:         # checkpoint waits scale with the (whole) model
            whole_params = model.num_params() * self.state.tp_size
            self.state.host_group = new_host_group(checkpoint.save_timeout_s(cfg.parallel, whole_params))
        self.train_ds, self.val_ds = build_datasets(cfg)
        self.batches = DistributedBatches(self.train_ds, t.global_batch, self.batch.micro_batch, self.state.dp_rank,
                                          self.state.dp_size, seed=cfg.seed)
        self.progress = TrainState(self.batches, rng)
        optimizer, groups = build_optimizer(self.model, cfg, self.state.tp_group)
        if self.state.is_main and log:
            for line in groups:
                logger.info(line)
        self.run_dir = os.path.join(t.out_dir, cfg.name)
        plan = plan_resume(cfg, self.state, self.run_dir, self.model, self.progress)
        self.engine = None
        if self.state.deepspeed:
            import deepspeed
            if cfg.parallel.zero_stage == 3 and self.model.lm_head is None:
                # the tied embedding is read again by the output projection, outside its module
                deepspeed.zero.register_external_parameter(self.model, self.model.embed.weight)
            universal = plan is not None and plan.universal
            inner = optimizer
            self.engine, optimizer, _, _ = deepspeed.initialize(
                model=self.model, optimizer=optimizer,
                config={**deepspeed_config(cfg, self.batch, universal), **(deepspeed_overrides or {})},
                mpu=self.state if self.state.tp_size > 1 else None)
            attach_layout(optimizer, inner)          # Muon: where its matrices lie in ZeRO's partitions
        self.optimizer = optimizer
        if plan is not None:
            settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            resume(plan, cfg, self.state, self.model, self.optimizer, self.engine, self.progress)
            for group, mine in zip(self.optimizer.param_groups, settings):
                group.update(mine)          # this run's lr_scale, decay, betas, Muon settings, not the saved ones
        self.preempted = False
        self.ahead: tuple[int, list[torch.Tensor]] | None = None      # the next step's batches (prefetch)
        log = log and self.state.is_main
        self.metrics = MetricsWriter(self.run_dir, enabled=log, loggers=t.loggers, name=cfg.name,
                                     config=config_to_dict(cfg), wandb_project=t.wandb_project, wandb_mode=t.wandb_mode)
        if log:
            with open(os.path.join(self.run_dir, "config.yaml"), "w") as fh:
                yaml.safe_dump(config_to_dict(cfg), fh, sort_keys=False)

    def close(self, wait_for_peers: bool = True) -> None:
        """On an error (``wait_for_peers=False``) the heartbeat keeps watching, so that the
        command can still name a peer that vanished."""
        self.metrics.close()
        if self.heartbeat is not None and wait_for_peers:
            self.heartbeat.stop_watching()        # from the last barrier on, ranks leave at will
        if self.owns_state:
            self.state.close(wait_for_peers)
        if self.heartbeat is not None and wait_for_peers:
            self.heartbeat.stop()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(wait_for_peers=exc_type is None)

    @property
    def step(self) -> int:
        """Optimizer steps taken (skipped ones included): ``progress.step``."""
        return self.progress.step

    def save_checkpoint(self) -> str:
        """A checkpoint of the current step (every rank calls it); returns its folder."""
        return checkpoint.save(self.run_dir, self.cfg, self.state, self.model, self.optimizer, self.engine,
                               self.progress)

    def autocast(self):
        """bf16 autocast for ``train.precision: bf16`` (parameters and optimizer stay fp32); the
        same context launch/evaluate.py uses (fpscale.train.precision)."""
        return autocast(self.cfg.train.precision, self.device)

    def train_step(self) -> dict:
        t = self.cfg.train
        model = self.model
        model.train()
        model.set_step(self.progress.step)
        lr = apply_schedule(self.optimizer.param_groups, self.progress.step, t)
        micro_batches = self.next_batches()
        # cross-entropy and the auxiliary losses (epsilon's KL), summed on the device
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        layer_stats: dict[str, list] = {}
        grad_norm = None
        for i, batch in enumerate(micro_batches):
            inputs, targets = split_batch(batch)
            if self.engine is not None:        # DeepSpeed scales by the accumulation steps itself
                loss = self.engine(inputs, targets=targets)
                self.engine.backward(loss)
                if i == len(micro_batches) - 1 and self.cfg.parallel.zero_stage == 0:
                    # ZeRO-0 reports no norm and does not skip: the gradients are all-reduced by
                    # now; the norm (TP-aware, the same on every rank) decides the skip
                    grad_norm = global_grad_norm(model.parameters(), self.state.tp_group)
                    self.optimizer.skip_next = not math.isfinite(float(grad_norm))
                self.engine.step()
            else:
                with self.autocast():
                    loss = model(inputs, targets=targets) / len(micro_batches)
                loss.backward()
            total += self.loss_parts() / len(micro_batches)
            collect_layer_stats(model, layer_stats)
        if self.engine is not None:
            if grad_norm is None:      # ZeRO 1-3 skip a non-finite step themselves and report inf
                grad_norm = self.engine.get_global_grad_norm()
            total = self.dp_mean(total)
        else:
            params = [p for p in model.parameters() if p.grad is not None]
            grad_norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip if t.grad_clip > 0 else float("inf"))
            if getattr(self.optimizer, "skips_on_device", False):    # fused AdamW: no host read (train/optim.py)
                self.optimizer.found_inf = (~torch.isfinite(grad_norm)).float()
            else:
                self.optimizer.skip_next = not math.isfinite(float(grad_norm))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.progress.step + 1 < t.steps:
            self.prefetch()              # the next step's copies queued while the device finishes this one
        grad_norm = torch.as_tensor(grad_norm, dtype=torch.float64, device=self.device)
        # losses and norm in one read of the device (one process and ZeRO-0 read the norm before the
        # update too: whether to skip it); per-micro-batch values never leave the device
        ce, aux, grad_norm = torch.cat([total, grad_norm.view(1)]).tolist()
        skipped = not math.isfinite(grad_norm)
        self.progress.skipped_steps += skipped
        self.progress.step += 1
        out = {"loss": ce, "lr": lr, "grad_norm": grad_norm, "skipped": skipped, "layer_stats": layer_stats,
               "tokens": self.state.dp_size * sum(b.shape[0] * (b.shape[1] - 1) for b in micro_batches)}
        if self.model.last_losses.get("aux") is not None:
            out["aux_loss"] = aux
        return out

    def next_batches(self) -> list[torch.Tensor]:
        """This step's micro-batches on the device: the ones ``prefetch`` copied at the end of the last
        step where they are this step's (the loader's position unchanged since), else read now."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[0] == self.batches.consumed_samples:
            self.batches.consumed_samples += self.batches.global_batch
            return ahead[1]
        return [to_device(b, self.device) for b in self.batches.next_global_batch()]

    def prefetch(self) -> None:
        """Read the next step's micro-batches and queue their copies to the device, before this step's one
        host read; the loader does not advance (a checkpoint saved now resumes at the next step's batch)."""
        self.ahead = (self.batches.consumed_samples,
                      [to_device(b, self.device) for b in self.batches.peek_global_batch()])

    def loss_parts(self) -> torch.Tensor:
        """[cross-entropy, auxiliary loss] of the last micro-batch, on the device (float64)."""
        parts = self.model.last_losses
        aux = parts["aux"] if parts["aux"] is not None else torch.zeros((), device=self.device)
        return torch.stack([parts["ce"].double(), aux.double()])

    def compute_record(self, layers: dict[str, dict], tokens_per_s: float) -> dict:
        """TFLOP/s and MFU, nominal (one iteration per looped layer) and executed, and memory."""
        loops = {int(name.split(".")[1]): m for name, m in self.model.looped_layers().items()}
        stats, modes, steps = [], [], []
        for i, kind in enumerate(self.model.layer_types):
            summary = layers.get(f"layers.{i}.{kind}")
            stats.append(None if i not in loops or summary is None else
                         {"iterations": summary["iters_mean"],
                          "backward_iterations": summary.get("backward_iters_mean", 0.0),
                          "windows": summary.get("windows_mean", 0.0), "window": summary.get("window", 0)})
            modes.append(loops[i].backward_mode if i in loops else "-")
            steps.append(loops[i].phantom_steps if i in loops else 1)
        nominal, executed = training_flops(self.cfg.model, self.cfg.data.seq_len, stats, modes, steps)
        world = self.state.world_size
        out = {"flops_per_token_nominal": nominal, "flops_per_token_executed": executed,
               "tflops_nominal": nominal * tokens_per_s / 1e12 / world,       # per device
               "tflops_executed": executed * tokens_per_s / 1e12 / world}
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        peak = peak_tflops(name, self.cfg.train.precision, self.cfg.train.peak_tflops,
                           tf32=torch.backends.cuda.matmul.allow_tf32)
        if peak:
            out["mfu_nominal"], out["mfu_executed"] = out["tflops_nominal"] / peak, out["tflops_executed"] / peak
        out["memory_gib"] = peak_memory_gib(self.device)          # this interval's peak (reset at each log)
        return out

    def new_interval(self) -> None:
        """Start counting a new interval's peak memory and kernel calls (each train log record and
        each validation record reports its own)."""
        reset_peak_memory(self.device)
        kernels.reset()

    def dp_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean of a per-rank scalar tensor (on the compute device) over the data-parallel group."""
        if not self.state.distributed:
            return value
        value = value.clone()
        dist.all_reduce(value, group=self.state.dp_group)
        return value / self.state.dp_size

    def evaluate(self) -> dict:
        """The validation record: loss, perplexity and per-layer iterations at the configured
        evaluation cap; with ``train.eval_depths``, also ``depths`` (one record per depth) and
        flat scalars ``val_loss_depth_{d}``, ``val_ppl_depth_{d}``, ``val_iters_mean_depth_{d}``."""
        t = self.cfg.train
        faults.at("val", self.step)
        forward = self.engine if self.engine is not None else self.model
        args = (forward, self.model, self.val_ds, t.micro_batch, t.eval_batches)
        out = validate(*args, self.state, self.autocast, progress=self.metrics.enabled)
        if t.eval_depths:          # the same depths in the same order on every rank (from the config)
            depths = validate_depths(*args, t.eval_depths, self.state, self.autocast, progress=self.metrics.enabled)
            out.update(depth_scalars(depths), depths=depths)
        return {"step": self.step, "kind": "val", **out, "memory_gib": peak_memory_gib(self.device),
                "kernels": kernels.used()}

    def train(self) -> list[dict]:
        """Train to ``train.steps`` with checkpoints every ``save_interval`` steps, every
        ``save_interval_minutes`` (rank 0's clock) and at the end. A SIGTERM / SIGUSR1 on any rank
        saves at the next step boundary and returns early with ``self.preempted`` set
        (launch/pretrain.py then exits with EXIT_PREEMPTED)."""
        boundary = StepBoundary(self.cfg.train.save_interval_minutes)
        try:
            return self._train(boundary)
        finally:
            boundary.restore()

    def _train(self, boundary: StepBoundary) -> list[dict]:
        t = self.cfg.train
        history: list[dict] = []
        window: dict[str, list] = {}       # SolverStats of the log interval, read at the log step
        tokens, t_last, skipped_before, logged_step = 0, time.perf_counter(), self.progress.skipped_steps, self.step
        self.new_interval()
        end = min(t.steps, t.stop_at or t.steps)          # the schedule still runs to train.steps
        if self.step >= end:
            logger.info("nothing to train: resumed at step %d of train.steps = %d", self.step, t.steps)
        while self.step < end:
            faults.at("step", self.step + 1)
            out = self.train_step()
            tokens += out["tokens"]
            per_step = 0
            for name, rows in out["layer_stats"].items():
                window.setdefault(name, []).extend(rows)
                per_step = len(rows)
            if self.step % t.log_interval == 0 or self.step == t.steps:
                now = time.perf_counter()
                tokens_per_s = tokens / max(now - t_last, 1e-9)
                rows = as_dicts(window)
                layers = summarize_layers(rows)
                spread, dp_wait = dp_imbalance(rows, per_step, self.state)     # one gather over DP
                for name, extra in spread.items():
                    layers[name].update(extra)
                # loss and ppl: the cross-entropy; aux_loss: what the looped layers added to it
                record = {"step": self.step, "kind": "train", "loss": out["loss"], "ppl": perplexity(out["loss"]),
                          **({"aux_loss": out["aux_loss"]} if "aux_loss" in out else {}),
                          "lr": out["lr"], "grad_norm": out["grad_norm"], "skipped_steps": self.progress.skipped_steps,
                          "tokens_per_s": tokens_per_s, **({"dp_wait_est": dp_wait} if dp_wait is not None else {}),
                          **self.compute_record(layers, tokens_per_s), "kernels": kernels.used(), "layers": layers}
                self.metrics.log(record)
                self.metrics.console(self.step, t.steps, record)
                if self.progress.skipped_steps - skipped_before == self.step - logged_step:     # none applied
                    logger.warning("steps %d-%d all skipped (non-finite gradient norm; %d of %d so far): the weights "
                                   "did not change", logged_step + 1, self.step, self.progress.skipped_steps, self.step)
                skipped_before, logged_step = self.progress.skipped_steps, self.step
                history.append(record)
                window, tokens, t_last = {}, 0, now
                self.new_interval()
            if self.step % t.eval_interval == 0 or self.step == t.steps:
                record = self.evaluate()
                self.metrics.log(record, prefix="val")
                self.new_interval()           # a validation's memory and kernels are its own record's
                history.append(record)
                if self.metrics.enabled:
                    for line in validation_lines(record):
                        logger.info(line)
            preempted, timer_due = boundary.agree(self.state)
            if preempted:
                self.save_checkpoint()
                self.preempted = True
                logger.info("preempted (signal %s): saved step %d", boundary.received or "on another rank",
                            self.step)
                break
            if self.step < end and (timer_due or (t.save_interval and self.step % t.save_interval == 0)):
                self.save_checkpoint()
                boundary.saved()
        if not self.preempted:
            final = self.save_checkpoint()
            if t.export_final and self.state.is_main:      # one process merges every shard: opt-in
                checkpoint.export_safetensors(final, os.path.join(self.run_dir, "final"))
        self.metrics.close()
        return history
