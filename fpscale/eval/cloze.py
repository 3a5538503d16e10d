"""An offline lm-evaluation-harness task built from held-out documents: ``fpscale_cloze``.

    python launch/lm_eval_task.py --files cache/corpus/raw/corpus.parquet --out runs/lm_eval_tasks
    for depth in 1 8; do
      lm_eval --model hf --model_args pretrained=exported/hf,trust_remote_code=True,eval_depth=$depth \\
              --include_path runs/lm_eval_tasks --tasks fpscale_cloze --output_path runs/lm_eval/depth_$depth
    done

Each item is a passage of a validation document (the documents data/prepare_fineweb.py holds out:
the same hash of the id and ``val_fraction``) and four continuations: the sentence that follows
it, and three sentences of about its length from other validation documents. The model is right
when it gives the true sentence the highest log-likelihood (acc; acc_norm per byte of the
continuation). Chance is 0.25. The task is written in the harness's own format (a YAML file and
a jsonl of items), so any harness model runs it; nothing is fetched.
"""
from __future__ import annotations

import json
import os
import random
import re

from fpscale.data.fineweb import expand_files, iter_texts, open_documents
from fpscale.data.writer import is_validation
from fpscale.errors import DataError

TASK = "fpscale_cloze"
CHOICES = 4
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE.split(" ".join(text.split())) if s.strip()]


def make_items(docs: list[tuple[str, str]], n_items: int, seed: int = 0, context_chars: int = 400,
               min_len: int = 40, max_len: int = 160) -> list[dict]:
    """Up to ``n_items`` cloze items from (id, text) documents; deterministic in ``seed``."""
    rng = random.Random(seed)
    per_doc = {doc_id: sentences(text) for doc_id, text in docs}
    pool = [(doc_id, s) for doc_id, ss in per_doc.items() for s in ss if min_len <= len(s) <= max_len]
    slots = [(doc_id, i) for doc_id, ss in per_doc.items() for i in range(2, len(ss))
             if min_len <= len(ss[i]) <= max_len]
    rng.shuffle(slots)
    items = []
    for doc_id, i in slots[:n_items]:
        ss = per_doc[doc_id]
        context = " ".join(ss[:i])[-context_chars:]
        context = context[context.find(" ") + 1:] if len(" ".join(ss[:i])) > context_chars else context
        gold = ss[i]
        others = [s for d, s in pool if d != doc_id and abs(len(s) - len(gold)) <= 0.3 * len(gold)]
        if len(others) < CHOICES - 1:
            continue
        choices = rng.sample(others, CHOICES - 1) + [gold]
        rng.shuffle(choices)
        items.append({"context": context, "choices": [" " + c for c in choices], "label": choices.index(gold),
                      "doc_id": doc_id})
    return items


def write_task(files: list[str], out: str, n_items: int = 200, val_fraction: float = 0.05, seed: int = 0,
               text_column: str = "text") -> str:
    """Write ``out/fpscale_cloze.yaml`` and ``out/fpscale_cloze.jsonl``; returns the YAML's path."""
    rows = open_documents(expand_files(files), text_column=text_column)
    docs = [(doc_id, text) for doc_id, text in iter_texts(rows, text_column, skip_empty=True)
            if is_validation(doc_id, val_fraction)]
    if not docs:
        raise DataError(f"no validation document in {files} at val_fraction {val_fraction}")
    items = make_items(docs, n_items, seed)
    if len(items) < 10:
        raise DataError(f"only {len(items)} cloze items could be made from {len(docs)} validation documents")
    os.makedirs(out, exist_ok=True)
    data = os.path.abspath(os.path.join(out, f"{TASK}.jsonl"))
    with open(data, "w") as fh:
        for item in items:
            fh.write(json.dumps(item) + "\n")
    path = os.path.join(out, f"{TASK}.yaml")
    with open(path, "w") as fh:
        fh.write(f"""# written by fpscale.eval.cloze ({len(items)} items from {len(docs)} validation documents)
task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    return path
