"""Per-token halting with a geometric prior (seed 003, Epsilon, Secs. 3.4 and 4.2; PonderNet's KL).

After the t-th application of a shared block a token's state h_t gives a halting probability
lambda_t = sigmoid(w_t . h_t + b_t), spent from the token's remainder r (r_1 = 1):

    p_t = min(lambda_t, r_t),   r_{t+1} = r_t - p_t
    the token halts once r_{t+1} <= HALTED (or at the last step): the remainder goes to this,
    its own last step, so sum_t p_t = 1 exactly; a halted token's state stops changing
    y = sum_t p_t h_t

    KL(P || Q), Q(t) = q (1 - q)^(t - 1), q = 1 / target_mean, truncated at L_max with its tail
    (1 - q)^(L_max - 1) folded into the last step, as the token's own remainder is.

    halting = Halting(shape, device)
    for t in range(L):
        h = where(halting.running, block(h), h)
        p = halting.step(sigmoid(w[t] . h + b[t]), last=t == L - 1)
        y = y + p[..., None] * h
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

HALTED = 1e-6      # a token whose remainder is at most this has halted (the authors' 1 - 1e-6)


def geometric_prior(mean: float, steps: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """Q(1..steps) of a geometric distribution on {1, 2, ...} with the given mean, its tail
    beyond ``steps`` folded into the last entry (so it sums to 1)."""
    q = 1.0 / mean
    t = torch.arange(steps, dtype=torch.float64, device=device)
    prior = q * (1.0 - q) ** t
    prior[-1] = (1.0 - q) ** (steps - 1)
    return prior.to(dtype)


def halting_kl(probs: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) per token: ``probs`` [..., S] (S <= len(prior): a loop that ended early left
    every later probability 0), ``prior`` [L]. P is floored at 1e-9 inside the log, as the
    authors do: a zero of P contributes nothing and has a finite gradient (xlogy's is NaN at 0,
    and a halting probability underflows to 0 once its logit is very negative); Q is floored at
    1e-30 (a prior of mean 1 puts no mass after step 1)."""
    log_q = prior[: probs.shape[-1]].clamp_min(1e-30).log()
    return (probs * (probs.clamp_min(1e-9).log() - log_q)).sum(-1)


class Halting:
    """The halting process of one forward over a [batch, tokens] grid, in float32 (or wider)."""

    def __init__(self, shape: torch.Size, device: torch.device, dtype: torch.dtype = torch.float32):
        self.remainder = torch.ones(shape, device=device, dtype=dtype)
        self.running = torch.ones(shape, device=device, dtype=torch.bool)
        self.halt_step = torch.zeros(shape, device=device, dtype=torch.long)
        self.probs: list[torch.Tensor] = []

    def step(self, lam: torch.Tensor, last: bool) -> torch.Tensor:
        """p_t for every token (0 for tokens that halted earlier); updates who still runs."""
        r = self.remainder
        p = torch.where(self.running, r if last else torch.minimum(lam, r), 0.0)
        left = r - p
        halts = self.running & ((left <= HALTED) | last)
        p = p + torch.where(halts, left, 0.0)            # the remainder to the token's own last step
        self.remainder = torch.where(halts, 0.0, left)
        self.halt_step = torch.where(halts, len(self.probs) + 1, self.halt_step)
        self.running = self.running & ~halts
        self.probs.append(p)
        return p

    def any_running(self, consensus=None) -> bool:
        """Whether a token still runs, agreed over the TP shards (``consensus``: their MAX); one host read
        per step (epsilon's and fpsa_lh's loops)."""
        flag = self.running.any().to(torch.int32).view(1)
        if consensus is not None:
            flag = consensus(flag)
        return bool(flag.item())

    def distribution(self) -> torch.Tensor:
        """P [..., steps taken]: each token's halting distribution (sums to 1 once all halted)."""
        return torch.stack(self.probs, -1)


@dataclass
class HaltingStats:
    """What one forward of a halting layer did; tensors stay on the device until ``to_dict``."""

    iterations: int                 # applications of the block (the loop ran this many steps)
    max_iter: int                   # the cap it ran under (L_max, or the evaluation depth)
    distribution: torch.Tensor      # [B, T, iterations] p_t per token (sums to 1 per token)
    halt_step: torch.Tensor         # [B, T] the step at which the token halted (1-based)
    kl: torch.Tensor                # mean KL of the tokens' halting distributions from the prior
    bin_entropy: torch.Tensor | None = None    # mean entropy of HQSA's key-to-bin assignment (nats)

    @property
    def expected_depth(self) -> torch.Tensor:
        """[B, T] sum_t t p_t per token."""
        p = self.distribution
        return (p * torch.arange(1, p.shape[-1] + 1, device=p.device, dtype=p.dtype)).sum(-1)

    def summary(self) -> torch.Tensor:
        """Every number of ``to_dict`` as one float64 device tensor (fpscale.solvers.stats.to_dicts
        reads a log interval's statistics in one synchronisation): [p50, p90, depth mean, halt
        step mean, kl, halted by step (max_iter), (bin entropy)]."""
        depth = self.expected_depth.float().flatten()
        q = torch.quantile(depth, torch.tensor([0.5, 0.9], dtype=depth.dtype, device=depth.device))
        steps = torch.arange(1, self.max_iter + 1, device=self.halt_step.device)
        halted = (self.halt_step[..., None] <= steps).float().flatten(0, -2).mean(0)
        parts = [q, depth.mean().view(1), self.halt_step.float().mean().view(1), self.kl.reshape(1), halted]
        if self.bin_entropy is not None:
            parts.append(self.bin_entropy.reshape(1))
        return torch.cat([p.to(device=depth.device, dtype=torch.float64) for p in parts])

    def from_summary(self, values: list[float]) -> dict:
        out = {"kind": "halting", "iterations": self.iterations, "max_iter": self.max_iter,
               "depth_mean": values[2], "depth_p50": values[0], "depth_p90": values[1],
               "halt_step_mean": values[3], "halted_by_step": values[5:5 + self.max_iter],
               "kl": values[4]}
        if self.bin_entropy is not None:
            out["bin_entropy"] = values[5 + self.max_iter]
        return out

    def to_dict(self) -> dict:
        return self.from_summary(self.summary().tolist())
