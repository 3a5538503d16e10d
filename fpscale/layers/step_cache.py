"""Per-iteration decoding caches of a fixed-point layer: cached decoding repeats the full forward.

In the full forward, iteration j of token t reads the iterate z^j of every earlier token (its keys,
its scan state), not their fixed point. A cache of the converged past alone gives token t another
trajectory, equal to the full forward's only once both converged (within the tolerance), and not at
all where the solve stops at its cap. So each looped layer caches, per past token, what its map
reads of that token at every iteration j (``iters``: fpsa's keys, the looped core's K/V per
sublayer, fpmamba's y and scan state after it) and at the applications after the solve
(``finals``: the output step of jfb/phantom, ``SolverConfig.eval_output``), and the new token's
f reads entry j at its iteration j. With ``solver.forward.decisions: token`` (the default) token t's own
damping and patience follow its own residual, and it retires once every token up to it is done: the
cache keeps ``prefix`` [B], the iteration from which every past token is done (the last past token's
retirement), which the new tokens' prefix rule reads. So the new token's trajectory is the full
forward's, and past the iteration where a token retired its entries stop changing: an entry list
ends with the final one, read for every later index.

Index bookkeeping: f's calls in a solve are the loop's K (inputs z^0 .. z^{K-1}) and, after
``on_final``, the applications to z^K (the output step; with none, the layer applies f to z* once
to record it). ``iters`` holds K + 1 entries, z^0 .. z^K; ``finals`` the inputs of the output
steps. The new token's solve runs at least as many iterations as the past recorded (``min_iter``):
an entry that depends on earlier tokens (a scan state, the core's deeper sublayers) is complete
only from there on. Every tensor is batch-first ([B, J, ...]: beam search reorders dim 0).

Memory: J = (iterations + 1) entries per cached tensor instead of one (J <= eval cap + 1). What grows along a
token axis (keys, values) lives in an ``EntryBuffer``, preallocated for ``model.max_seq_len`` tokens: a token's
entries are written in place, and a map's entry j is a view into it where the new tokens' entries are written
each iteration (``entry``), so neither a decoding step nor an iteration copies the past; J grows (a copy of the
filled part) only when a token takes more iterations than every earlier one.

Static caches (``LoopedLM.new_caches(static=True)``, ``generate(..., static=True)``, docs/decoding.md): every
shape of a decoding step is the same at every position, so a compiled step (``torch.compile(dynamic=False)``,
CUDA graphs) is built once. A ``TokenBuffer`` then counts its filled tokens in a device tensor, writes the
new tokens at that index and hands the map its whole capacity, which attention reads under
``fpscale.ops.attention.causal_mask`` (the positions are a tensor too: ``positions_of``). ``fixed_point``
mode only: ``exact`` keeps J entries per token, J changing from token to token.

A map restricted to some of the batch's rows (row compaction, fpscale.solvers.rows) reads and records through
``rows(index)``; a row that left has, at the calls it missed, the entries of its z* (``store``).

``fixed=True`` (``decode.cache: fixed_point``, docs/decoding.md): one entry per past token, what the map
reads of it at the fixed point (the first application after the loop: the entry of z*). Every
iteration of a new token reads it, no past iteration count binds the new solve (``min_iter`` 0) and the
past is done from the start (``prefix`` None): a token stops at its own convergence. The new token's
solve then runs against a past that already sits at its fixed point, so its result equals the full
forward's where both solves converged (within the tolerance), and differs where they stop at a cap.
"""
from __future__ import annotations

import copy
from typing import Callable

import torch

from fpscale.ops.attention import causal_mask

Combine = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
CACHE_MODES = ("exact", "fixed_point")          # decode.cache (fpscale.models.config.DecodeConfig)


def replace(past: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """A state that the new tokens supersede (the scan state and y after the last token)."""
    return new


class along:
    """Entries that grow by the new tokens along ``dim`` of the per-entry tensor (keys, values)."""

    def __init__(self, dim: int):
        self.dim = dim

    def __call__(self, past: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        return torch.cat([past, new], self.dim + 1)       # +1: the entry axis


def is_static(cache: dict | None) -> bool:
    """Whether a layer's decoding cache is static (module docstring: ``LoopedLM.new_caches(static=True)``)."""
    return cache is not None and bool(cache.get("static", False))


def attention_keys(cache: dict | None, has_past: bool, pad, pos, length: int, capacity: int, device):
    """What a decoding step's attention takes for ``pad``: the rows' padding, or, in a static cache that holds a
    past, the mask of the keys each new token reads over the cache's whole capacity (``causal_mask``)."""
    if is_static(cache) and has_past:
        return causal_mask(pad, pos, length, capacity, device)
    return pad


class TokenBuffer:
    """Entries along a token axis ``dim``, preallocated for ``capacity`` tokens (``model.max_seq_len``): the
    past is never copied per token. ``with_new`` writes the new tokens' entries after the filled part and
    returns past and new as one view (what a map attends over, each iteration); ``advance`` keeps them.
    Past the capacity (a caller that outgrows it) the buffer doubles, once per doubling.

    ``static``: the count ``n`` is a 0-dim long tensor, ``with_new`` writes at it and returns the whole
    buffer (the same shape at every position: the reader masks what is not filled, ``causal_mask``); it
    never grows (a caller past the capacity gets an error: ``LoopedLM.hidden`` and ``generate`` check first)."""

    def __init__(self, first: torch.Tensor, dim: int, capacity: int, static: bool = False):
        shape = list(first.shape)
        shape[dim] = max(capacity, shape[dim])
        self.data, self.dim, self.static = first.new_empty(shape), dim, static
        self.n = first.new_zeros((), dtype=torch.long) if static else 0
        if static:     # the unfilled slots are read (under a mask: their weights are 0, their values must be finite)
            self.data.zero_()
        self.with_new(first)
        self.advance(first.shape[dim])

    @classmethod
    def over(cls, data: torch.Tensor, dim: int, n: int) -> TokenBuffer:
        """A (dynamic) buffer over ``data`` whose first ``n`` tokens along ``dim`` are filled."""
        out = object.__new__(cls)
        out.data, out.dim, out.n, out.static = data, dim, n, False
        return out

    def with_new(self, new: torch.Tensor) -> torch.Tensor:
        t = new.shape[self.dim]
        if self.static:
            self.data.index_copy_(self.dim, self.n + torch.arange(t, device=self.data.device), new)
            return self.data
        if self.n + t > self.data.shape[self.dim]:
            self.data = torch.cat([self.data, torch.empty_like(self.data)], self.dim)
            return self.with_new(new)
        self.data.narrow(self.dim, self.n, t).copy_(new)
        return self.data.narrow(self.dim, 0, self.n + t)

    def advance(self, t: int) -> None:
        if self.static:
            self.n.add_(t)
        else:
            self.n += t

    def view(self) -> torch.Tensor:
        return self.data.narrow(self.dim, 0, int(self.n))

    def index_select(self, dim: int, index: torch.Tensor) -> TokenBuffer:
        """Beam search's reordering of the rows (dim 0)."""
        out = copy.copy(self)
        out.data = self.data.index_select(dim, index)
        if self.static:
            out.n = self.n.clone()
        return out


class EntryBuffer(TokenBuffer):
    """``exact`` mode's entries [B, J, ...] of a tensor that grows along the token axis ``dim`` (of the stacked
    tensor: keys [B, J, H, T, dh] along 3), preallocated for ``capacity`` tokens. ``append`` writes a step's
    entries after the filled part; a token's entries past its last equal its last (``_pad``'s rule), so a step
    of fewer entries than J repeats its last, and one of more first extends every past token's (a copy of the
    filled part, when J grows: a token slower than every one before it)."""

    def __init__(self, first: torch.Tensor, dim: int, capacity: int):
        self.J = first.shape[1]
        super().__init__(first, dim, capacity)

    def with_new(self, new: torch.Tensor) -> torch.Tensor:        # (the first entries: ``append`` after)
        self.data.narrow(self.dim, self.n, new.shape[self.dim]).copy_(new)
        return self.view()

    def view(self) -> torch.Tensor:
        return self.data[:, :self.J].narrow(self.dim, 0, self.n)

    def entry(self, j: int) -> TokenBuffer:
        """Entry j (past J: the last) as a TokenBuffer over this storage: a map's ``with_new`` writes the new
        tokens' entries after the past there (``append`` writes the step's own over them after the solve)."""
        return TokenBuffer.over(self.data[:, min(j, self.J - 1)], self.dim - 1, self.n)

    def append(self, new: torch.Tensor) -> None:
        """The new tokens' entries [B, Jn, ...]: J becomes max(J, Jn)."""
        jn, t = new.shape[1], new.shape[self.dim]
        J = max(self.J, jn)
        if J > self.data.shape[1] or self.n + t > self.data.shape[self.dim]:     # grow: J, or tokens by doubling
            shape = list(self.data.shape)
            shape[1] = J
            shape[self.dim] *= 1 if self.n + t <= shape[self.dim] else 2
            grown = self.data.new_empty(shape)
            grown[:, :self.J].narrow(self.dim, 0, self.n).copy_(self.view())
            self.data = grown
        if J > self.J:          # the past tokens' entries J .. : their last
            past = self.data.narrow(self.dim, 0, self.n)
            past[:, self.J:J] = past[:, self.J - 1:self.J]
        slot = self.data.narrow(self.dim, self.n, t)
        slot[:, :jn] = new
        slot[:, jn:J] = new[:, -1:]
        self.J, self.n = J, self.n + t


def take_rows(x, index: torch.Tensor, room: int = 0):
    """Rows ``index`` (dim 0) of a per-row input or cache entry, for a map restricted to them (fpscale.solvers.rows):
    None stays None; a TokenBuffer becomes a new one holding those rows' filled part and ``room`` free tokens
    (what the restricted map's ``with_new`` writes each iteration: no copy per iteration)."""
    if x is None:
        return None
    if isinstance(x, TokenBuffer):
        shape = list(x.data.shape)
        shape[0], shape[x.dim] = index.numel(), x.n + room
        out = TokenBuffer.over(x.data.new_empty(shape), x.dim, x.n)
        out.data.narrow(x.dim, 0, x.n).copy_(x.view().index_select(0, index))
        return out
    return x.index_select(0, index)


def rope_rows(cos: torch.Tensor, sin: torch.Tensor, pad: torch.Tensor | None, index: torch.Tensor):
    """(cos, sin, pad) of rows ``index`` for a restricted attention map: the rotary tables are per row
    ([B, T, ...]) only where left padding shifts the positions (``pad`` given), else shared by every row."""
    if pad is None:
        return cos, sin, None
    return cos.index_select(0, index), sin.index_select(0, index), pad.index_select(0, index)


def with_new(past, new: torch.Tensor, dim: int) -> torch.Tensor:
    """The past's entries (a tensor, or a TokenBuffer written in place) followed by the new tokens'."""
    return past.with_new(new) if isinstance(past, TokenBuffer) else torch.cat([past, new], dim)


def _pad(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` [B, J, ...] to [B, n, ...], repeating its last entry (the entries past the last are equal)."""
    if t.shape[1] >= n:
        return t
    return torch.cat([t, t[:, -1:].expand(-1, n - t.shape[1], *t.shape[2:])], 1)


class StepCache:
    """One forward's view of a layer's per-iteration cache ``cache[key]`` (None: no cache)."""

    def __init__(self, cache: dict | None, key: str = "steps", fixed: bool = False, capacity: int = 0):
        past = cache.get(key) if cache is not None else None
        self.fixed, self.capacity, self.static = fixed, capacity, is_static(cache)
        mode = CACHE_MODES[fixed]
        if self.static and not fixed:
            raise ValueError("a static decoding cache takes decode.cache: fixed_point (exact keeps an entry per "
                             "iteration, their number changing from token to token)")
        if past and past.get("mode", "exact") != mode:
            raise RuntimeError(f"a decoding cache filled with decode.cache {past.get('mode', 'exact')!r} is read "
                               f"with {mode!r}: keep one mode for a generation (new caches to change it)")
        self.past_iters: dict | None = past["iters"] if past else None
        self.past_finals: dict | None = past["finals"] if past else None
        # per token (solver.forward.decisions: token): the iteration from which every past token is done
        # (fixed: every past token is done from iteration 0, None)
        self.prefix: torch.Tensor | None = past.get("prefix") if past and not fixed else None
        self.retired_at: torch.Tensor | None = None      # the solve's, for the next chunk
        self.final = False
        self.index: torch.Tensor | None = None           # a restricted map's rows (``rows``; None: every row)
        self.room = 0                                    # its new tokens (``take_rows``'s room)
        self.iters: list[dict] = []
        self.restricted: dict[int, torch.Tensor] = {}    # exact: the calls of a restricted map -> its rows
        self.finals: list[dict] = []

    @property
    def min_iter(self) -> int:
        """Iterations the new tokens' solve must cover: as many as the past recorded (z^0 .. z^{J-1})."""
        if not self.past_iters or self.fixed:
            return 0
        t = next(iter(self.past_iters.values()))
        return (t.J if isinstance(t, EntryBuffer) else t.shape[1]) - 1

    def on_final(self) -> None:
        """The loop ended: f's next calls are the applications after the solve."""
        self.final = True

    def past(self, name: str) -> torch.Tensor | None:
        """What f reads of the past tokens at this call: the iteration's entry, or the final ones."""
        src, index = (self.past_finals, len(self.finals)) if self.final else (self.past_iters, len(self.iters))
        if src is None:
            return None
        t = src[name]
        if self.fixed:          # one entry per token: a TokenBuffer (read with ``with_new``) or the state
            return t
        if isinstance(t, EntryBuffer):       # a view: the map writes its new entries in place
            t = t.entry(index)
            return t if self.index is None else take_rows(t, self.index, self.room)
        t = t[:, min(index, t.shape[1] - 1)]
        return t if self.index is None else t.index_select(0, self.index)

    def record(self, **entries: torch.Tensor) -> None:
        """What this call's f computed of the new tokens (after reading ``past``)."""
        if self.fixed:       # the entry of z* alone (a copy: a TokenBuffer's slot is written again later)
            if self.final and not self.finals:
                self.finals.append({k: v.detach().clone() for k, v in entries.items()})
            return
        if self.index is not None:      # a restricted map's call: the other rows' entries are their final ones
            self.restricted[len(self.iters)] = self.index
        (self.finals if self.final else self.iters).append({k: v.detach() for k, v in entries.items()})

    def rows(self, index: torch.Tensor, room: int = 0) -> StepCache:
        """This cache as a map restricted to rows ``index`` reads and records it (fpscale.solvers.rows; the loop's
        calls only). fixed_point: the past's rows taken once (``take_rows``; ``room`` free tokens in a
        TokenBuffer). exact: the entry list is this cache's, so a read follows its iteration (those rows of the
        past's entry j, taken per call), and a record holds those rows; ``store`` gives the rows that left their
        final entry at those calls. A row leaves once it froze: at or after its past's ``prefix`` (the prefix
        rule), from where neither its iterate nor its past changes, so its entries at every later call are those
        of the application to z* (rows.py, "Why")."""
        view = copy.copy(self)          # shares ``iters`` and ``restricted``
        view.index, view.room = index, room
        if self.fixed and self.past_iters is not None:
            view.past_iters = {n: take_rows(t, index, room) for n, t in self.past_iters.items()}
        return view

    def past_kv(self, blocks: int) -> list[dict] | None:
        """Attention blocks' past keys and values at this call (``k{l}``, ``v{l}``; the looped core's
        sublayers, the attractor head's blocks), or None before any past."""
        if self.past_iters is None:
            return None
        return [{"k": self.past(f"k{l}"), "v": self.past(f"v{l}")} for l in range(blocks)]

    def record_kv(self, collected: list) -> None:
        """The new tokens' keys and values of each block's (k, v) in ``collected``."""
        self.record(**{f"{kv}{l}": t for l, pair in enumerate(collected) for kv, t in zip("kv", pair)})

    def store_kv(self, cache: dict, blocks: int) -> None:
        """``store`` for keys and values, which grow along the token axis."""
        self.store(cache, {f"{kv}{l}": along(2) for l in range(blocks) for kv in "kv"})

    def store(self, cache: dict, combine: dict[str, Combine], key: str = "steps") -> None:
        """Merge the new tokens' entries into ``cache[key]`` (call after at least one final entry)."""
        if not self.finals:
            raise RuntimeError("StepCache.store: no final entry recorded (apply f to z* after on_final)")
        if self.fixed:          # one entry per token, kept in place (TokenBuffer) where it grows
            new = self.finals[0]
            if self.past_iters is None:
                kept = {n: TokenBuffer(new[n], how.dim, self.capacity, self.static) if isinstance(how, along)
                        else new[n] for n, how in combine.items()}
            else:
                kept = dict(self.past_iters)
                for n, how in combine.items():
                    if isinstance(how, along):
                        kept[n].with_new(new[n])
                        kept[n].advance(new[n].shape[how.dim])
                    else:
                        kept[n] = how(kept[n], new[n])
            cache[key] = {"iters": kept, "finals": kept, "mode": "fixed_point"}
            return
        final = self.finals[0]      # the entries of z*: those of a row that left a restricted map, at its calls
        iters = [{n: final[n].index_copy(0, self.restricted[j], v) for n, v in e.items()} if j in self.restricted
                 else e for j, e in enumerate(self.iters)]
        new_iters = {n: torch.stack([e[n] for e in iters + self.finals[:1]], 1) for n in combine}
        new_finals = {n: torch.stack([e[n] for e in self.finals], 1) for n in combine}
        if self.past_iters is not None:
            new_iters = _merge(self.past_iters, new_iters, combine)
            new_finals = _merge(self.past_finals, new_finals, combine)
        else:            # what grows along the tokens: preallocated for ``capacity`` tokens (EntryBuffer)
            for new in (new_iters, new_finals):
                for n, how in combine.items():
                    if isinstance(how, along):
                        new[n] = EntryBuffer(new[n], how.dim + 1, self.capacity)
        cache[key] = {"iters": new_iters, "finals": new_finals, "mode": "exact"}
        if self.retired_at is not None:
            cache[key]["prefix"] = self.retired_at


def _merge(past: dict, new: dict, combine: dict[str, Combine]) -> dict:
    out = {}
    for name, how in combine.items():
        if isinstance(past[name], EntryBuffer):       # written in place
            past[name].append(new[name])
            out[name] = past[name]
            continue
        n = max(past[name].shape[1], new[name].shape[1])
        out[name] = how(_pad(past[name], n), _pad(new[name], n))
    return out
