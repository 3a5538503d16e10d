"""Sharded checkpoints: save, verify, find, convert to a universal checkpoint, load whole weights.

    runs/<name>/checkpoints/
        step_00000008/                 one complete checkpoint, published by a rename
            mp_rank_*_model_states.pt, *_optim_states.pt    DeepSpeed's shards (several processes)
            model.pt, optim.pt         the same for one process
            fpscale_rank00000.pt       per rank: step, its place in the layout, RNG streams, buffers
            meta.json                  step, layout, fingerprints, resolved config, TP split metadata
            manifest.json              size and sha256 of every file above (and which rank hashed
                                       how many bytes); written last
        .partial/step_.../             a save in progress: never read, cleared by the next save
        universal/step_.../            DeepSpeed's universal checkpoint, made once on a layout change

A checkpoint is complete when its manifest exists and every file matches it. ``resume: auto``
takes the newest complete one; a damaged one is skipped with a warning naming the file.
Hashing is shared: the files are dealt to the ranks by size (``deal``), each rank hashes its
share on save and on resume, so no rank reads more than about 1/world of a checkpoint; the
coordination of a save runs on a gloo group whose timeout grows with the bytes saved
(``save_timeout_s``), beside the compute group's ``parallel.timeout_s``.
Resuming a run from one is fpscale/train/resume.py; ``whole_weights`` (and ``load_model`` on it)
reads the whole weights of a checkpoint of any layout, for evaluation, export and
``train.init_weights``. Everything fpscale writes loads with ``torch.load(weights_only=True)``.
"""
from fpscale.errors import CheckpointError
from fpscale.train.checkpoint.format import (
    CHECKPOINTS,
    TAG,
    barrier,
    deal,
    fingerprint,
    hash_share,
    newest_complete,
    published,
    rank_file,
    rank_states,
    read_meta,
    split_info,
    tag_for,
    universal_info,
    verify,
    verify_together,
    whole_shapes,
    write_manifest,
)
from fpscale.train.checkpoint.load import (
    export_safetensors,
    load_buffers,
    load_model,
    prepare_universal,
    universal_folder,
    whole_buffers,
    whole_weights,
)
from fpscale.train.checkpoint.save import (
    NO_SPACE,
    describe,
    discard,
    fail_together,
    materialize_adam_state,
    rank_state,
    rotate,
    save,
    save_timeout_s,
    storage_failure,
)

__all__ = ["CHECKPOINTS", "NO_SPACE", "TAG", "CheckpointError", "barrier", "deal", "describe", "discard",
           "export_safetensors", "fail_together", "fingerprint", "hash_share", "load_buffers", "load_model",
           "materialize_adam_state", "newest_complete", "prepare_universal", "published", "rank_file", "rank_state",
           "rank_states", "read_meta", "rotate", "save", "save_timeout_s", "split_info", "storage_failure",
           "tag_for", "universal_folder", "universal_info", "verify", "verify_together", "whole_buffers",
           "whole_shapes", "whole_weights", "write_manifest"]
