"""The names of every file and folder hftrain writes in a run's `output_dir` (checkpoints, the final model, metrics,
run files). The bottom of the house: it imports nothing, so the recipe (config, which refuses an output_dir that
already holds a run) and the checkpoint code (which writes them) both take the names from here.
"""

STATE_FILE = "hftrain_state.json"
CONFIG_FILE = "hftrain_config.yaml"
COMPLETE_FILE = "hftrain_complete.json"
PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-"  # output_dir/.tmp-checkpoint-N, .tmp-final: a save in progress, renamed when complete
FINAL_DIR = "final"  # output_dir/final: the final model
MODEL_FILE = "model.safetensors"  # accelerate's save_state model file (the trained weights)
METRICS_FILE = "metrics.jsonl"  # output_dir/metrics.jsonl: one row per logging step and evaluation
PROFILE_DIR = "profile"  # output_dir/profile: profiler traces
REPORT_DIR = "report"  # output_dir/report: `hftrain report`'s plots and summary
DS_CONFIG_FILE = "ds_config.json"  # the DeepSpeed config actually used, next to every checkpoint and final model
FULL_STATE_FILE = "full_training_state.pt"  # tensor parallel: gathered model + optimizer state
REFERENCE_FILE = "reference_log_probs.safetensors"  # dpo with precompute_ref_log_probs: the reference's log-probs
PREFLIGHT_DIR = ".tmp-preflight"  # output_dir/.tmp-preflight: the checkpoint round trip before step 1, then removed
STREAM_STATE = "data_stream_process{index}.json"  # streaming: each process's stream position (hftrain.data.streaming)
UNIVERSAL_PREFIX = ".universal-"  # output_dir/.universal-checkpoint-N: a ZeRO checkpoint converted for another world
