"""Benchmarks with EleutherAI's lm-evaluation-harness (`pip install 'hftrain[eval]'`), on a folder or the live model.

    hftrain eval outputs/run/final --tasks hellaswag,arc_easy [--limit 100] [--num_fewshot 5] [--output results.json]
    hftrain eval outputs/run/final --tasks path/to/my_task.yaml        # a local task: its YAML file
    hftrain eval outputs/embedding/final --retrieval data/retrieval-eval   # an embedding model or a reranker

FOLDER is a final, merged or adapter folder, or a checkpoint-N saved by one process or DDP (hftrain.trained). Tasks are
names of lm-eval's installed tasks (globs such as `mmlu_*` too) or paths to task YAML files; every one is checked,
and loaded, before the model is. The results print as lm-eval's table; `--output` writes lm-eval's results JSON
(with every example's inputs and scores under --log_samples). The numbers are `lm_eval.simple_evaluate`'s on the
same model: the folder's model, as loaded for `hftrain chat`, is handed to lm-eval's HFLM.

In training, the recipe's `eval_tasks` runs the same tasks on the live model (`TaskEvaluation`) at each evaluation
and at the end, without saving it first; results are logged as `eval/<task>/<metric>` to metrics.jsonl and every
tracker.
"""

from __future__ import annotations

import argparse
import difflib
import json
import warnings
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from hftrain import trained
from hftrain.errors import HftrainError, first_line, run_tool
from hftrain.options import Parser, add_switch
from hftrain.retrieval_eval import evaluate_folder
from hftrain.run_parts import TrainRun
from hftrain.tracking import errors_only

INSTALL = "pip install 'hftrain[eval]' (lm-eval)"


def import_lm_eval():
    try:
        import lm_eval  # optional extra: only hftrain eval and eval_tasks need it
        from lm_eval.tasks import TaskManager  # noqa: F401 - the submodules used below, imported once
    except ImportError:
        raise HftrainError(f"lm-evaluation-harness is not installed; {INSTALL}") from None
    return lm_eval


def quiet_lm_eval() -> AbstractContextManager[None]:
    """lm-eval's info logging and its warnings about a pre-built model (hftrain passes one on purpose) hidden."""
    return errors_only("lm_eval")


def is_task_file(spec: str) -> bool:
    return spec.endswith((".yaml", ".yml"))


class Tasks:
    """The task specs, checked and loaded once: unknown names and unreadable YAML files are refused here, before any
    model loads. `names`: what simple_evaluate is given (globs expanded, files as absolute paths)."""

    def __init__(self, specs: list[str]):
        lm_eval = import_lm_eval()
        if not specs:
            raise HftrainError("no tasks given; name lm-eval tasks (e.g. --tasks hellaswag,arc_easy) or task YAML "
                               "files")
        missing = [s for s in specs if is_task_file(s) and not Path(s).expanduser().is_file()]
        if missing:
            raise HftrainError(f"task file {missing[0]!r} does not exist; give the path of a task YAML file or the "
                               "name of an installed lm-eval task")
        files = [str(Path(s).expanduser().resolve()) for s in specs if is_task_file(s)]
        with quiet_lm_eval():  # the folders of local files are indexed too: a YAML may name its sibling tasks
            self.manager = lm_eval.tasks.TaskManager(include_path=sorted({str(Path(f).parent) for f in files}) or None)
        self.names: list[str] = []
        for spec in specs:
            if is_task_file(spec):
                self.names.append(str(Path(spec).expanduser().resolve()))
                continue
            matched = self.manager.match_tasks([spec])
            if not matched:
                close = difflib.get_close_matches(spec, self.manager.all_tasks, n=3)
                hint = f" (close: {', '.join(close)})" if close else ""
                raise HftrainError(f"lm-eval knows no task {spec!r}{hint}: give one of its "
                                   f"{len(self.manager.all_tasks):,} installed tasks, groups or tags (`lm-eval ls "
                                   "tasks` lists them) or the path of a task YAML file")
            self.names += [m for m in matched if m not in self.names]
        for name in self.names:
            try:
                with quiet_lm_eval():
                    self.manager.load([name])  # reads its dataset: a missing file or an offline hub fails here
            except Exception as exc:  # noqa: BLE001 - lm-eval's and datasets' many errors, one paragraph
                raise HftrainError(f"lm-eval cannot load task {name!r}: {first_line(exc)}") from None


def evaluate_model(model, tokenizer, tasks: Tasks, *, limit: float | None = None, batch_size: int = 8,
                   num_fewshot: int | None = None, log_samples: bool = False, apply_chat_template: bool = False,
                   seed: int = 0) -> dict:
    """lm-eval's `simple_evaluate` of `tasks` on a model object (HFLM: no copy, no save); returns its results."""
    lm_eval = import_lm_eval()
    from lm_eval.models.huggingface import HFLM  # optional extra: lm_eval (see import_lm_eval)

    with quiet_lm_eval(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        results = lm_eval.simple_evaluate(model=lm, tasks=tasks.names, task_manager=tasks.manager, limit=limit,
                                          num_fewshot=num_fewshot, log_samples=log_samples,
                                          apply_chat_template=apply_chat_template, random_seed=seed,
                                          numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
    return results


def metrics(results: dict) -> dict[str, float]:
    """`eval/<task>/<metric>` of every numeric result (lm-eval's `acc,none` named `acc`, as its W&B logger does;
    other filters kept: `exact_match,strict-match`)."""
    row = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            if "," in key and isinstance(value, (int, float)) and not isinstance(value, bool):
                row[f"eval/{task}/{key.removesuffix(',none')}"] = float(value)
    return row


def table(results: dict) -> str:
    from lm_eval.utils import make_table  # optional extra: lm_eval

    text = make_table(results)
    return text + ("\n" + make_table(results, "groups") if results.get("groups") else "")


def write_results(results: dict, path: Path) -> None:
    from lm_eval.utils import handle_non_serializable  # optional extra: lm_eval

    path.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n",
                    encoding="utf-8")


# ----------------------------------------------------------------------------------------------- the command
def run_eval(args: argparse.Namespace) -> None:
    if bool(args.tasks) == bool(args.retrieval):
        raise HftrainError("give --tasks (lm-evaluation-harness tasks, for a model that writes text) or --retrieval "
                           "(a folder of queries.jsonl, corpus.jsonl and qrels.tsv, for an embedding model or a "
                           "reranker), one of the two")
    if args.retrieval:
        return run_retrieval(args)
    problems = []
    if args.limit is not None and args.limit <= 0:
        problems.append(f"--limit must be > 0 (examples per task, or a fraction below 1), got {args.limit}")
    if args.batch_size < 1:
        problems.append(f"--batch_size must be >= 1, got {args.batch_size}")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        problems.append(f"--num_fewshot must be >= 0, got {args.num_fewshot}")
    if args.output is not None and (args.output.is_dir() or not args.output.parent.is_dir()):
        problems.append(f"--output {str(args.output)!r} must be a file in an existing folder")
    if problems:
        raise HftrainError("; ".join(problems))
    found = trained.inspect(args.folder, args.base_model_name_or_path)  # a bad folder before the task index
    tasks = Tasks([t for spec in args.tasks for t in spec.split(",") if t])
    loaded = trained.load(args.folder, args.base_model_name_or_path, dtype=args.dtype)
    print(f"hftrain eval: {found.describe()} on {loaded.model.device}: {', '.join(Path(n).name for n in tasks.names)}"
          f"{f', limit {args.limit:g}' if args.limit else ''}", flush=True)
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    results = evaluate_model(loaded.model, loaded.tokenizer, tasks, limit=limit, batch_size=args.batch_size,
                             num_fewshot=args.num_fewshot, log_samples=args.log_samples,
                             apply_chat_template=args.apply_chat_template, seed=args.seed)
    print(table(results))
    if args.output is not None:
        if not args.log_samples:
            results.pop("samples", None)
        write_results(results, args.output)
        print(f"hftrain eval: results written to {args.output}")


def run_retrieval(args: argparse.Namespace) -> None:
    """--retrieval: NDCG@10, MRR@10 and recall@k of an embedding model's or a reranker's folder
    (hftrain.retrieval_eval), printed as JSON (and written to --output)."""
    metrics = evaluate_folder(args.folder, args.retrieval, batch_size=args.batch_size)
    print(json.dumps(metrics, indent=2))
    if args.output is not None:
        args.output.write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
        print(f"hftrain eval: results written to {args.output}")


def build_arg_parser(prog: str = "hftrain eval") -> argparse.ArgumentParser:
    parser = Parser(prog=prog, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:3]))
    parser.add_argument("folder", type=Path, help="final, merged, adapter or checkpoint-N folder")
    parser.add_argument("--tasks", action="append", help="Comma-separated lm-eval task names "
                        "(globs too) or task YAML files; may be repeated.")
    parser.add_argument("--retrieval", type=Path, default=None, help="Instead of --tasks, for an embedding model's "
                        "or a reranker's folder (objectives embedding, reranker): a folder of BEIR's queries.jsonl, "
                        "corpus.jsonl and qrels.tsv (a reranker scores each query's candidates.tsv documents, or "
                        "the whole corpus); prints NDCG@10, MRR@10 and recall@1/5/10 (docs/retrieval.md).")
    parser.add_argument("--limit", type=float, default=None, help="At most this many examples per task (a fraction "
                        "below 1: that share of each task); for quick checks, not for reported numbers.")
    parser.add_argument("--batch_size", type=int, default=8, help="Examples per forward (default 8).")
    parser.add_argument("--num_fewshot", type=int, default=None, help="Few-shot examples per prompt (default: "
                        "each task's own).")
    add_switch(parser, "--apply_chat_template", help="Render prompts with the folder's chat template "
               "(instruction-tuned models), as lm-eval's option.")
    parser.add_argument("--output", type=Path, default=None, help="Write lm-eval's results JSON to this file.")
    add_switch(parser, "--log_samples", help="With --output: include every example's prompt, answers and scores.")
    parser.add_argument("--seed", type=int, default=0, help="lm-eval's seeds (few-shot sampling; default 0).")
    trained.add_loading_arguments(parser)
    return parser


def main(argv: list[str] | None = None, prog: str = "hftrain eval") -> None:
    args = build_arg_parser(prog).parse_args(argv)
    run_tool(run_eval, args)


# ---------------------------------------------------------------------------------------- during training
class TaskEvaluation:
    """The recipe's eval_tasks on the live model, at each evaluation and at the end of training (`Finetune.evaluate`).

    lm-eval's HFLM takes a model object as one process's: the main process evaluates the causal LM inside the
    loss wrapper (adapters on, in eval mode, then back to training mode) while the other ranks wait at a barrier.
    That needs the whole model on the main process: one process, DDP, DeepSpeed ZeRO-1/2. Layouts that split the
    weights (FSDP2, ZeRO-3, tensor or pipeline parallelism) or the sequences (sp, cp) are refused at setup."""

    def __init__(self, recipe, backend):
        self.recipe, self.backend = recipe, backend
        record = backend.record
        splits = [reason for split, reason in (
            ("weights" in record.sharded, f"{record.name} shards the weights"),
            (record.model_shards > 1, f"{record.name} splits the model over {record.model_shards} processes"),
            (record.sequence_shards > 1, f"{record.name} splits each sequence over {record.sequence_shards} "
                                         "processes")) if split]
        if splits:
            raise HftrainError(f"eval_tasks runs lm-eval on the main process's whole model while the other processes "
                               f"wait, but {splits[0]}, so no process holds it whole. Remove eval_tasks and run "
                               "`hftrain eval output_dir/final --tasks ...` after training, or train with one "
                               "process, DDP or DeepSpeed ZeRO-1/2")
        self.tasks = Tasks(recipe.eval_tasks) if backend.accelerator.is_main_process else None
        backend.accelerator.wait_for_everyone()

    def __call__(self, run: TrainRun) -> dict:
        """Every rank calls this; the main process returns the metrics row's `eval/<task>/<metric>` items."""
        accelerator, row = self.backend.accelerator, {}
        if accelerator.is_main_process:
            lm = self.backend.unwrap(run.model).lm
            try:
                with torch.no_grad():
                    results = evaluate_model(lm, run.tokenizer, self.tasks, limit=self.recipe.eval_tasks_limit,
                                             batch_size=self.recipe.per_device_eval_batch_size,
                                             num_fewshot=self.recipe.eval_tasks_num_fewshot, seed=self.recipe.seed)
            finally:
                lm.train()
            row = metrics(results)
            run.say(f"hftrain: eval_tasks after step {run.progress.step}:\n{table(results)}")
        accelerator.wait_for_everyone()
        return row


if __name__ == "__main__":
    main()
