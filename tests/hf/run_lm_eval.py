"""lm-evaluation-harness on an exported folder at several depths, in one process (used by
tests/hf/test_lm_eval.py). Each depth is what ``lm_eval --model hf --model_args
pretrained=FOLDER,trust_remote_code=True,eval_depth=D --include_path TASKS --tasks fpscale_cloze
--batch_size 4 --device cpu --log_samples`` runs: the same ``--model_args`` string parsed by lm_eval's
``create_from_arg_string`` and the same ``simple_evaluate``. What the CLI adds and this leaves out:
its argument parser, its output files and its index of lm_eval's ~14,700 bundled tasks (30+ s per
run on the 2-core machine; the task manager here reads the include path only).

    python tests/hf/run_lm_eval.py HF_FOLDER TASKS_DIR OUT.json 1 8
"""
import json
import sys


def main():
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    folder, tasks, out, *depths = sys.argv[1:]
    manager = TaskManager(include_path=tasks, include_defaults=False)
    report = {}
    for depth in depths:
        model_args = f"pretrained={folder},trust_remote_code=True,eval_depth={depth}"
        lm = get_model("hf").create_from_arg_string(model_args, {"batch_size": 4, "max_batch_size": None,
                                                                 "device": "cpu"})
        results = simple_evaluate(model=lm, tasks=["fpscale_cloze"], task_manager=manager, log_samples=True)
        report[depth] = {"acc": results["results"]["fpscale_cloze"]["acc,none"],
                         "eval_depth": lm.model.config.eval_depth,
                         "rows": [r["filtered_resps"] for r in results["samples"]["fpscale_cloze"]]}
    with open(out, "w") as fh:
        json.dump(report, fh)


if __name__ == "__main__":
    main()
