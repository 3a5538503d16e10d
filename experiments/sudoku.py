"""Seed 004 (FPRM), Table 2 (Sudoku-Extreme) at CPU scale: hard 9x9 puzzles with unique solutions from our own
generator, small-sample training (1,000 puzzles, as HRM's benchmark), FPRM against a fixed-depth transformer
of equal parameters; test accuracy (cells and whole puzzles) and FPRM's iterations against the givens.

Generator (``generate``, no data from a hub): a random complete grid (randomised backtracking), then cells
removed in a random order while the puzzle keeps a unique solution (a bitmask solver counting up to two
solutions), until no cell can be removed: a minimal puzzle (typically 22-27 givens). Hardness is the number of
guesses our solver's backtracking needs (most-constrained cell first); the ``--min-guesses`` filter keeps the
puzzles that need at least that many (Sudoku-Extreme keeps those that need search; 0: all).

The model is fpscale's causal decoder, so a puzzle is read twice: the 81 cells (0 = blank), then the 81 cells
again, where position 81 + i predicts the digit of cell i having seen every given (loss only there). Training
augments each puzzle with a random relabelling of the digits and a random transposition (HRM's augmentations).

  FPRM      the looped core (2 blocks, pre-norm + residual scaling), deep supervision in windows of 4, fixed-
            point halting (tol 0.1, p = 0.25, patience), phantom k = 4; cap 16 in training, 64 in evaluation
  baseline  two attention blocks (the same parameters less the core's two scalings), one pass

    PYTHONPATH=. python experiments/sudoku.py            # full: ~25 min on the shared 2 cores
    PYTHONPATH=. python experiments/sudoku.py --quick    # seconds: pipeline check

Scale-down (experiments/README.md): the paper trains 60,000 epochs of 1,000 puzzles at batch 768 (Table 4: ~78M puzzle
presentations, hidden 512); here STEPS x BATCH (the full setting: 1,500 x 16 = 24,000 presentations, 24 epochs,
3,250x fewer) at d_model 64; test on 200 fresh puzzles of the same generator.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from experiments.common import Timer, parse_args, plt, save, small_model, table, train_aligned  # noqa: E402

D = 64
FPRM_SOLVER = {"max_iter": 16, "eval_max_iter": 64, "tol": 0.1, "stop_quantile": 0.25, "patience": 3, "decay": 0.5,
               "eta_min": 0.05, "backward": "phantom", "phantom_steps": 4}
MODELS = {"FPRM (looped core, DS, fixed-point halting)":
          ([{"type": "looped", "core_blocks": 2, "a1_init": 0.5, "a2_init": 0.5,
             "deep_supervision": {"window": 4}}], FPRM_SOLVER),
          "transformer, 2 attention blocks": ([{"type": "attn", "repeat": 2}], {})}

# -- the generator ----------------------------------------------------------------------------------------
UNITS = [[r * 9 + c for c in range(9)] for r in range(9)] + [[r * 9 + c for r in range(9)] for c in range(9)] + \
        [[(br * 3 + r) * 9 + bc * 3 + c for r in range(3) for c in range(3)] for br in range(3) for bc in range(3)]
PEERS = [sorted({p for u in UNITS if i in u for p in u} - {i}) for i in range(81)]
ALL = 0x3FE          # bits 1..9


def solve_count(grid: list[int], limit: int = 2, stats: dict | None = None) -> int:
    """How many solutions ``grid`` (81 ints, 0 blank) has, counting up to ``limit``; ``stats["guesses"]``
    counts the branches taken beyond the first at each choice (the search a solver needs)."""
    grid = list(grid)
    cand = [0] * 81
    for i in range(81):
        if grid[i] == 0:
            used = 0
            for p in PEERS[i]:
                used |= 1 << grid[p]
            cand[i] = ALL & ~used
            if cand[i] == 0:
                return 0
    blanks = [i for i in range(81) if grid[i] == 0]

    def rec() -> int:
        best, best_n = -1, 10
        for i in blanks:
            if grid[i] == 0:
                used = 0
                for p in PEERS[i]:
                    used |= 1 << grid[p]
                free = ALL & ~used
                n = bin(free).count("1")
                if n == 0:
                    return 0
                if n < best_n:
                    best, best_n, best_free = i, n, free
                    if n == 1:
                        break
        if best < 0:
            return 1
        total = 0
        for k, d in enumerate(d for d in range(1, 10) if best_free >> d & 1):
            if k and stats is not None:
                stats["guesses"] = stats.get("guesses", 0) + 1
            grid[best] = d
            total += rec()
            grid[best] = 0
            if total >= limit:
                break
        return total

    return rec()


def full_grid(rng: np.random.Generator) -> list[int]:
    grid = [0] * 81

    def fill(i: int) -> bool:
        if i == 81:
            return True
        used = {grid[p] for p in PEERS[i]}
        for d in rng.permutation(9) + 1:
            if d not in used:
                grid[i] = int(d)
                if fill(i + 1):
                    return True
        grid[i] = 0
        return False

    fill(0)
    return grid


def generate(n: int, seed: int, min_guesses: int = 0) -> list[dict]:
    """``n`` minimal puzzles with unique solutions: {puzzle, solution, givens, guesses}."""
    rng, out = np.random.default_rng(seed), []
    while len(out) < n:
        solution = full_grid(rng)
        puzzle = list(solution)
        for i in rng.permutation(81):
            keep, puzzle[i] = puzzle[i], 0
            if solve_count(puzzle) != 1:
                puzzle[i] = keep
        stats: dict = {}
        solve_count(puzzle, limit=2, stats=stats)
        if stats.get("guesses", 0) >= min_guesses:
            out.append({"puzzle": puzzle, "solution": solution, "givens": sum(c > 0 for c in puzzle),
                        "guesses": stats.get("guesses", 0)})
    return out


def cached(path: str, n: int, seed: int, min_guesses: int) -> list[dict]:
    if os.path.exists(path):
        with open(path) as fh:
            return json.load(fh)
    data = generate(n, seed, min_guesses)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(data, fh)
    return data


# -- the task ---------------------------------------------------------------------------------------------
class SudokuTask:
    """``examples(indices)`` -> (inputs [B, 162], targets [B, 162]) for ``train_aligned``; index i is
    puzzle i mod n, augmented (digit relabelling, transposition) from a generator seeded by i."""

    def __init__(self, data: list[dict], augment: bool):
        self.puzzles = np.array([d["puzzle"] for d in data], dtype=np.int64)
        self.solutions = np.array([d["solution"] for d in data], dtype=np.int64)
        self.augment = augment

    def example(self, i: int):
        p, s = self.puzzles[i % len(self.puzzles)], self.solutions[i % len(self.puzzles)]
        if self.augment:
            rng = np.random.default_rng(i)
            relabel = np.concatenate([[0], rng.permutation(9) + 1])
            p, s = relabel[p], relabel[s]
            if rng.random() < 0.5:
                p, s = p.reshape(9, 9).T.ravel(), s.reshape(9, 9).T.ravel()
        inputs = np.concatenate([p, p])
        targets = np.concatenate([np.full(81, -100), s])
        return inputs, targets

    def examples(self, indices):
        pairs = [self.example(i) for i in indices]
        return (torch.from_numpy(np.stack([a for a, _ in pairs])), torch.from_numpy(np.stack([b for _, b in pairs])))


@torch.no_grad()
def evaluate(model, data: list[dict], batch: int = 50) -> dict:
    """Cell accuracy (over the blanks), whole-puzzle accuracy; the puzzles are evaluated in batches of equal
    givens, so ``iters`` [(givens, iterations of that batch's solve)] is the solve of those puzzles alone."""
    task = SudokuTask(data, augment=False)
    model.eval()
    cells = right = solved = 0
    per_puzzle = []
    order = sorted(range(len(data)), key=lambda i: data[i]["givens"])
    groups = []
    for i in order:
        if groups and data[groups[-1][0]]["givens"] == data[i]["givens"] and len(groups[-1]) < batch:
            groups[-1].append(i)
        else:
            groups.append([i])
    for idx in groups:
        inputs, targets = task.examples(idx)
        pred = model(inputs).argmax(-1)[:, 81:]
        blank = inputs[:, :81] == 0
        ok = (pred == targets[:, 81:]) | ~blank
        cells += int(blank.sum())
        right += int(((pred == targets[:, 81:]) & blank).sum())
        solved += int(ok.all(1).sum())
        its = max((s.iterations for s in model.solver_stats().values()), default=1)
        per_puzzle += [(data[i]["givens"], its) for i in idx]
    model.train()
    return {"cell_acc": right / max(cells, 1), "puzzle_acc": solved / len(data), "iters": per_puzzle}


def main():
    args = parse_args(__doc__, lambda p: p.add_argument("--min-guesses", type=int, default=10,
                                                        help="keep puzzles that need at least this many guesses"))
    if args.quick:
        n_train, n_test, steps, batch = 4, 2, 2, 4
    else:
        n_train, n_test, steps, batch = 1000, 200, 1500, 16
    runs_dir = os.path.join(args.out, "runs")
    with Timer() as gen:
        if args.quick:
            train, test = generate(n_train, 1, 0), generate(n_test, 2, 0)
        else:
            train = cached(os.path.join(runs_dir, f"sudoku_train_{n_train}_g{args.min_guesses}.json"), n_train, 1,
                           args.min_guesses)
            test = cached(os.path.join(runs_dir, f"sudoku_test_{n_test}_g{args.min_guesses}.json"), n_test, 2,
                          args.min_guesses)
    givens = [d["givens"] for d in train + test]
    guesses = [d["guesses"] for d in train + test]
    print(f"puzzles: {len(train)} train, {len(test)} test in {gen.s:.0f} s; givens {min(givens)}-{max(givens)} "
          f"(median {int(np.median(givens))}); guesses median {int(np.median(guesses))}, max {max(guesses)}",
          flush=True)
    results = {"settings": {"d_model": D, "n_train": n_train, "n_test": n_test, "steps": steps, "batch": batch,
                            "min_guesses": args.min_guesses, "fprm_solver": FPRM_SOLVER},
               "data": {"givens_min": min(givens), "givens_max": max(givens), "givens_median": float(np.median(givens)),
                        "guesses_median": float(np.median(guesses)), "generate_s": gen.s}, "runs": {}}
    with Timer() as total:
        for name, (layers, solver) in MODELS.items():
            print(f"== {name}", flush=True)
            model, _ = small_model(10, D, layers, solver, max_seq_len=162)
            with Timer() as t:
                curve = train_aligned(model, SudokuTask(train, augment=True), steps, batch, 1e-3,
                                      warmup=min(100, steps // 4 + 1), weight_decay=0.1,
                                      log_every=max(1, steps // 6), label=name[:10])
            ev = evaluate(model, test)
            tr = evaluate(model, train[:200])
            results["runs"][name] = {"params": model.num_params(), "train_s": t.s, "curve": curve, "test": ev,
                                     "train_cell_acc": tr["cell_acc"], "train_puzzle_acc": tr["puzzle_acc"]}
            print(f"  test cells {ev['cell_acc']:.3f} puzzles {ev['puzzle_acc']:.3f}; train cells "
                  f"{tr['cell_acc']:.3f}", flush=True)
    rows = [[name, r["params"], r["test"]["cell_acc"], r["test"]["puzzle_acc"], r["train_cell_acc"],
             round(r["train_s"])] for name, r in results["runs"].items()]
    text = table(["model", "params", "test cell acc", "test puzzle acc", "train cell acc", "train s"], rows,
                 f"Sudoku: {n_train} training puzzles, {n_test} test puzzles")
    fprm = results["runs"][next(iter(MODELS))]["test"]["iters"]
    by_givens: dict[int, list] = {}
    for g, its in fprm:
        by_givens.setdefault(g, []).append(its)
    text += "\n" + table(["givens", "puzzles", "FPRM iterations (mean over batches)"],
                         [[g, len(v), float(np.mean(v))] for g, v in sorted(by_givens.items())],
                         "FPRM's evaluation iterations against the number of givens (cap 64)")
    print(f"total wall {total.s:.0f} s", flush=True)
    results["wall_s"], results["table"] = total.s, text
    fig = plt().figure(figsize=(8, 3.4))
    ax = fig.add_subplot(1, 2, 1)
    for name, r in results["runs"].items():
        steps_, losses = zip(*r["curve"])
        ax.plot(steps_, losses, label=name[:24])
    ax.set_xlabel("step"), ax.set_ylabel("training cross-entropy"), ax.legend(fontsize=6)
    ax = fig.add_subplot(1, 2, 2)
    ax.plot(sorted(by_givens), [np.mean(by_givens[g]) for g in sorted(by_givens)], marker="o")
    ax.set_xlabel("givens"), ax.set_ylabel("FPRM iterations (eval)")
    save(args, "sudoku", results, fig)


if __name__ == "__main__":
    main()
