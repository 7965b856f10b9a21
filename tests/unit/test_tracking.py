"""What trackers receive: the flattened resolved config with secrets redacted; monitoring fields validated."""

from __future__ import annotations

import logging

import pytest

from hftrain.config import recipe_from_dict
from hftrain.errors import ConfigError
from hftrain.preflight import machine_problems
from hftrain.tracking import REDACTED, errors_only, tracker_config
from tests.conftest import REPO


def recipe(tmp_path, **values):
    return recipe_from_dict({"model_name_or_path": str(REPO / "models" / "tiny-llama"),
                             "dataset_name": str(REPO / "data" / "chat.jsonl"),
                             "output_dir": str(tmp_path / "out"), **values})


RUN_INFO = {"launch": {"distributed_type": "MULTI_CPU", "num_processes": 2}, "effective_batch_size": 32,
            "total_steps": 10, "data": {"train": {"examples": 100, "format": "messages"}},
            "hub_token": "hf_abcdefghijklmnopqrstuvwxyz", "extra": {"api_key": "12345", "note": "sk-abcdefghijklmnop"}}


def test_tracker_config_is_flat_scalar_and_redacted(tmp_path):
    config = tracker_config(recipe(tmp_path, learning_rate=1e-4, wandb_tags=["a", "b"], report_to=["wandb"]),
                            RUN_INFO)
    assert config["learning_rate"] == 1e-4 and config["launch/num_processes"] == 2
    assert config["data/train/examples"] == 100 and config["effective_batch_size"] == 32
    assert config["wandb_tags"] == "['a', 'b']"  # lists become strings every tracker accepts
    # by name (token/key/secret/password) and by the shape of well-known tokens
    assert config["hub_token"] == config["extra/api_key"] == config["extra/note"] == REDACTED
    assert all(isinstance(v, (int, float, str, bool)) or v is None for v in config.values())
    assert "hf_abcdefghijklmnopqrstuvwxyz" not in str(config) and "12345" not in str(config)


def test_harmless_values_are_not_redacted(tmp_path):
    config = tracker_config(recipe(tmp_path), RUN_INFO)
    assert config["max_grad_norm"] == 1.0 and config["tokenizer_name_or_path"] is None  # unset: nothing to hide
    assert config["model_name_or_path"].endswith("tiny-llama")


@pytest.mark.parametrize("values, message", [
    ({"wandb_tags": ["x"]}, "wandb_tags / wandb_group are set but report_to does not include wandb"),
    ({"straggler_threshold": 1.5}, "straggler_threshold must be in (0, 1)"),
    ({"profile_steps": -1}, "profile_steps must be >= 0"),
    ({"device_peak_tflops": 0}, "device_peak_tflops must be > 0"),
    ({"cost_per_gpu_hour": -2}, "cost_per_gpu_hour must be > 0"),
    ({"hang_timeout": -1}, "hang_timeout must be >= 0 seconds (0 = off) or unset (automatic), got -1"),
    ({"hang_timeout": 600, "ddp_timeout": 300}, "hang_timeout (600s) must be below ddp_timeout (300s)"),
])
def test_monitoring_fields_are_validated(tmp_path, values, message):
    with pytest.raises(ConfigError) as error:
        recipe(tmp_path, **values)
    assert message in str(error.value)


def test_mlflow_needs_its_package(tmp_path, monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    problems = machine_problems(recipe(tmp_path, report_to=["mlflow"]), cuda=False)
    assert problems and "mlflow package is not installed" in problems[0]


class Stream:
    def __init__(self, terminal: bool):
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


@pytest.mark.parametrize(("main", "terminal", "bars"), [(True, True, True), (True, False, False),
                                                        (False, True, False), (False, False, False)])
def test_library_progress_bars_show_on_the_main_processs_terminal_only(main, terminal, bars):
    """transformers' and datasets' bars (loading weights, mapping rows) redraw in place on a terminal; written to a
    log or a pipe each redraw is a line, and other processes would draw the same bars again."""
    import datasets
    import transformers

    from hftrain.tracking import quiet_console

    transformers.utils.logging.enable_progress_bar()
    datasets.enable_progress_bars()
    verbosity = transformers.utils.logging.get_verbosity(), datasets.utils.logging.get_verbosity()
    try:
        quiet_console(type("Accelerator", (), {"is_main_process": main})(), Stream(terminal))
        assert transformers.utils.logging.is_progress_bar_enabled() is bars
        assert datasets.is_progress_bar_enabled() is bars
    finally:
        transformers.utils.logging.enable_progress_bar()
        datasets.enable_progress_bars()
        transformers.utils.logging.set_verbosity(verbosity[0])
        datasets.utils.logging.set_verbosity(verbosity[1])


def test_errors_only_hides_a_librarys_warnings_inside_the_block_and_restores_its_level(caplog):
    """What quiet_torchao / quiet_lm_eval rely on: inside the block a child logger's warning is dropped and its error
    kept; after it the library logs warnings again at the level it had."""
    library = logging.getLogger("somelib")
    library.setLevel(logging.INFO)
    with caplog.at_level(logging.DEBUG), errors_only("somelib"):
        logging.getLogger("somelib.ext").warning("cannot load the CUDA extension")
        logging.getLogger("somelib.ext").error("broken")
        logging.getLogger("otherlib").warning("kept")
    assert [r.getMessage() for r in caplog.records] == ["broken", "kept"]
    assert library.level == logging.INFO
