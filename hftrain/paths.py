"""Where hftrain's files are: the files shipped inside the package (presets, the default model and data) and the
name of every file and folder hftrain writes in a run's `output_dir` (checkpoints, the final model, metrics, run
files). The bottom of the house: it imports nothing of hftrain, so the recipe (config and its groups, which
refuse an output_dir that already holds a run and name the shipped presets) and the code that writes or reads
the files (checkpoint, report, the CLI) all take the names from here.
"""

from pathlib import Path

# Files shipped inside the package, laid out as in the repository (there, hftrain/shipped/ holds symlinks to the
# top-level folders; a built wheel holds copies), so that an installed hftrain works from any folder.
SHIPPED = Path(__file__).resolve().parent / "shipped"
PRESET_DIR = SHIPPED / "accelerate_configs"  # the launch presets; their deepspeed_config_file is ds_configs/<name>.json
DEFAULT_MODEL = SHIPPED / "models" / "tiny-llama"  # the embedded default: a tiny random Llama (0.18M parameters)
DEFAULT_DATASET = SHIPPED / "data" / "chat.jsonl"  # and the demo chat data
RECIPE_DIR = SHIPPED / "recipes"  # the repository's recipes/, by name: `--config tiny-dpo`
DEMO_RECIPE = RECIPE_DIR / "tiny-chat.yaml"  # what `make demo` trains, and `hftrain launch` without --config


STATE_FILE = "hftrain_state.json"
CONFIG_FILE = "hftrain_config.yaml"
COMPLETE_FILE = "hftrain_complete.json"
PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-"  # output_dir/.tmp-checkpoint-N, .tmp-final: a save in progress, renamed when complete
FINAL_DIR = "final"  # output_dir/final: the final model
MODEL_FILE = "model.safetensors"  # accelerate's save_state model file (the trained weights)
METRICS_FILE = "metrics.jsonl"  # output_dir/metrics.jsonl: one row per logging step and evaluation
COMPLETIONS_FILE = "completions.jsonl"  # log_completions (all but grpo): eval prompts' completions per evaluation
ROLLOUTS_FILE = "rollouts.jsonl"  # what the run sampled and trained on: grpo's rollouts, distill's on-policy samples
EVAL_ROLLOUTS_FILE = "eval_rollouts.jsonl"  # grpo: every evaluation's completions, with the step it evaluated
PROFILE_DIR = "profile"  # output_dir/profile: profiler traces
REPORT_DIR = "report"  # output_dir/report: `hftrain report`'s plots and summary
HUB_UPLOAD_DIR = ".hub-upload"  # output_dir/.hub-upload: the model for use a save pushes to the hub (push_to_hub)
DS_CONFIG_FILE = "ds_config.json"  # the DeepSpeed config actually used, next to every checkpoint and final model
FULL_STATE_FILE = "full_training_state.pt"  # tensor parallel: gathered model + optimizer state
REFERENCE_FILE = "reference_log_probs.safetensors"  # dpo with precompute_ref_log_probs: the reference's log-probs
PREFLIGHT_DIR = ".tmp-preflight"  # output_dir/.tmp-preflight: the checkpoint round trip before step 1, then removed
STREAM_STATE = "data_stream_process{index}.json"  # streaming: each process's stream position (hftrain.data.streaming)
PIPELINE_CONVERTED_PREFIX = ".unpipelined-"  # output_dir/.unpipelined-checkpoint-N: a pp checkpoint for 1 process
UNIVERSAL_PREFIX = ".universal-"  # output_dir/.universal-checkpoint-N: a ZeRO checkpoint converted for another world


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """The checkpoint-N folders of `output_dir` whose completion marker exists (what a resume can take), oldest
    first."""
    found = [p for p in output_dir.glob(f"{PREFIX}*")
             if p.name[len(PREFIX):].isdigit() and (p / COMPLETE_FILE).exists()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def holds_a_run(output_dir: Path) -> bool:
    """`output_dir` holds a run's files: a checkpoint-N (complete or not) or a final model."""
    return output_dir.is_dir() and any(output_dir.glob(f"{PREFIX}*")) or (output_dir / FINAL_DIR).exists()
