"""Recipe loading: YAML + CLI coercion, precedence, validation reported all at once, presets, --help."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from hftrain.config import (
    FIELDS,
    HELP_GROUPS,
    TYPES,
    Recipe,
    _base_type,
    _coerce_all,
    build_arg_parser,
    load_recipe,
    read_yaml,
    recipe_from_dict,
    unused_settings,
)
from hftrain.errors import ConfigError, HftrainError, report_and_exit
from tests.conftest import REPO

MODEL = REPO / "models" / "tiny-llama"
CHAT = REPO / "data" / "chat.jsonl"
PRESETS = sorted((REPO / "recipes").glob("*.yaml"))


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run from an empty folder so relative defaults (outputs/tiny-chat, models/...) hit nothing of the repo."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write_yaml(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def valid(tmp_path: Path, **values) -> dict:
    """A usable recipe mapping (absolute model and data paths, a fresh output_dir) plus `values`."""
    return {"model_name_or_path": str(MODEL), "dataset_name": str(CHAT), "output_dir": str(tmp_path / "out"),
            **values}


def cli(tmp_path: Path) -> list[str]:
    return ["--model_name_or_path", str(MODEL), "--dataset_name", str(CHAT), "--output_dir", str(tmp_path / "out")]


def base_yaml(tmp_path: Path, extra: str = "") -> str:
    return (f"model_name_or_path: {MODEL}\ndataset_name: {CHAT}\noutput_dir: {tmp_path / 'out'}\n"
            "max_steps: 10\nlearning_rate: 1e-4\n" + extra)


# ------------------------------------------------------------------------------ coercion
def test_yaml_exponent_string_is_a_float(in_tmp):
    assert yaml.safe_load("learning_rate: 1e-4")["learning_rate"] == "1e-4"  # why the coercion is needed
    cfg = write_yaml(in_tmp / "r.yaml", base_yaml(in_tmp))
    recipe = load_recipe(["--config", str(cfg)])
    assert isinstance(recipe.learning_rate, float)
    assert recipe.learning_rate == 1e-4


def test_num_train_epochs_int_in_yaml_becomes_float(in_tmp):
    recipe = recipe_from_dict(valid(in_tmp, num_train_epochs=3))
    assert isinstance(recipe.num_train_epochs, float) and recipe.num_train_epochs == 3.0


@pytest.mark.parametrize("argv", [["--bf16"], ["--bf16", "--max_steps", "3"], ["--max_steps", "3", "--bf16"]])
def test_bare_bool_flag_is_true(in_tmp, argv):
    recipe = load_recipe(argv + cli(in_tmp))
    assert recipe.bf16 is True
    assert recipe.fp16 is False
    if "--max_steps" in argv:
        assert recipe.max_steps == 3  # the bare flag did not swallow the next option


@pytest.mark.parametrize("text,expected", [("true", True), ("yes", True), ("1", True), ("false", False),
                                           ("off", False), ("0", False)])
def test_bool_flag_with_value(in_tmp, text, expected):
    assert load_recipe(["--bf16", text, *cli(in_tmp)]).bf16 is expected


def test_bool_flag_rejects_nonsense(in_tmp):
    with pytest.raises(ConfigError) as info:
        load_recipe(["--bf16", "maybe", *cli(in_tmp)])
    assert len(info.value.problems) == 1
    assert "bf16" in info.value.problems[0] and "maybe" in info.value.problems[0]


def test_report_to_comma_list(in_tmp):
    recipe = load_recipe(["--report_to", "wandb,tensorboard", *cli(in_tmp)])
    assert recipe.report_to == ["wandb", "tensorboard"]


def test_report_to_none_on_command_line(in_tmp):
    # `--report_to none` is how HF users turn trackers off, and "none" is a documented value of the field.
    recipe = load_recipe(["--report_to", "none", *cli(in_tmp)])
    assert recipe.report_to == ["none"]


def test_report_to_none_in_yaml(in_tmp):
    for text in ("report_to: none", "report_to: [none]"):
        recipe = recipe_from_dict(valid(in_tmp, **yaml.safe_load(text)))
        assert recipe.report_to == ["none"]


# every list field of the schema by its item type; a new list[int] field is covered by the same tests
LIST_FIELDS = {name: typing.get_args(_base_type(TYPES[name])[0])[0] for name in FIELDS
               if typing.get_origin(_base_type(TYPES[name])[0]) is list and name != "dataset_mixture"}
GOOD_ITEMS = {str: ["q_proj", "v_proj"], float: [1.0, 0.5], int: [3, 4], bool: [True, False]}
BAD_ITEMS = {str: ("[q_proj, 1.5]", None), float: ("[1.0, abc]", "1,abc"), int: ("[3, 2.5]", "3,2.5"),
             bool: ("[true, maybe]", "true,maybe")}


def test_the_list_fields_are_the_ones_these_tests_know():
    assert {"reward_weights", "reward_funcs", "report_to", "lora_target_modules"} <= set(LIST_FIELDS)
    assert set(LIST_FIELDS.values()) <= set(GOOD_ITEMS), LIST_FIELDS


@pytest.mark.parametrize("name", sorted(LIST_FIELDS))
def test_a_list_field_reads_its_item_type_from_yaml_and_the_command_line(name):
    """`reward_weights: [1.0, 0.5]` (TRL's form) was refused as "expected a list of strings", and `--reward_weights
    1,2` was read as strings that failed later in torch.tensor."""
    good = GOOD_ITEMS[LIST_FIELDS[name]]
    words = [str(v).lower() for v in good]
    forms = {"yaml": (yaml.safe_load(f"{name}: [{', '.join(words)}]"), False)}
    for label, argv in {"commas": [",".join(words)], "words": words, "flow": [f"[{', '.join(words)}]"]}.items():
        forms[label] = ({name: build_arg_parser().parse_args([f"--{name}", *argv]).__dict__[name]}, True)
    for label, (values, from_cli) in forms.items():
        typed, problems = _coerce_all(values, from_cli=from_cli)
        assert not problems, (label, problems)
        assert typed[name] == good and [type(v) for v in typed[name]] == [type(v) for v in good], label


@pytest.mark.parametrize("name", sorted(LIST_FIELDS))
def test_a_list_item_of_another_type_is_a_one_line_problem(name):
    in_yaml, on_cli = BAD_ITEMS[LIST_FIELDS[name]]
    _, problems = _coerce_all(yaml.safe_load(f"{name}: {in_yaml}"), from_cli=False)
    assert len(problems) == 1 and problems[0].startswith(f"{name}: expected a list of") and "item 2" in problems[0]
    assert "\n" not in problems[0]
    if on_cli is not None:  # on the command line every word is a string
        _, problems = _coerce_all({name: [on_cli]}, from_cli=True)
        assert len(problems) == 1 and "item 2" in problems[0], problems


def test_reward_weights_from_the_command_line_reach_the_recipe_as_numbers(in_tmp):
    recipe = load_recipe([*cli(in_tmp), "--objective", "grpo", "--reward_funcs", "a.f", "b.g", "--reward_weights",
                          "1,0.5", "--eval_strategy", "no"], for_training=False)
    assert recipe.reward_funcs == ["a.f", "b.g"] and recipe.reward_weights == [1.0, 0.5]
    cfg = write_yaml(in_tmp / "r.yaml", base_yaml(in_tmp, "reward_weights: [1.0, 0.5]\n"))
    for word in ("none", "null"):  # an optional list field is unset on the command line as any optional field
        assert load_recipe(["--config", str(cfg), "--reward_weights", word], for_training=False).reward_weights is None


def test_optional_field_none_from_cli(in_tmp):
    cfg = write_yaml(in_tmp / "r.yaml", base_yaml(in_tmp, "eval_steps: 5\n"))
    assert load_recipe(["--config", str(cfg)]).eval_steps == 5
    assert load_recipe(["--config", str(cfg), "--eval_steps", "none"]).eval_steps is None


def test_eval_or_save_strategy_no_alone_turns_a_recipes_cadence_off(in_tmp):
    """`--eval_strategy no` on a recipe with eval_steps (tiny-chat.yaml has eval_steps: 30, save_steps: 30) was
    refused until `--eval_steps null` was added too; the recipe's values stay as given, noted as unused."""
    cfg = write_yaml(in_tmp / "r.yaml", base_yaml(in_tmp, f"eval_steps: 30\nsave_steps: 30\nsave_total_limit: 2\n"
                                                          f"eval_dataset_name: {CHAT}\n"
                                                          "validation_split_percentage: 0\n"))
    recipe = load_recipe(["--config", str(cfg), "--eval_strategy", "no", "--save_strategy", "no"])
    assert (recipe.eval_strategy, recipe.eval_steps, recipe.save_strategy, recipe.save_steps) == ("no", 30, "no", 30)
    assert not recipe.reads_eval_dataset
    assert unused_settings(recipe) == [f"eval_strategy no: eval_steps=30, eval_dataset_name={CHAT} not used",
                                       "save_strategy no: save_steps=30, save_total_limit=2 not used"]
    assert unused_settings(load_recipe(["--config", str(cfg)])) == []
    with pytest.raises(ConfigError, match="eval_steps=30 applies to eval_strategy=steps.*--eval_steps null"):
        load_recipe(["--config", str(cfg), "--eval_strategy", "epoch"])


# --------------------------------------------------------------------------- precedence
def test_cli_overrides_beat_file_values(in_tmp):
    cfg = write_yaml(in_tmp / "r.yaml", base_yaml(in_tmp, "seed: 7\nlr_scheduler_type: cosine\n"))
    recipe = load_recipe(["--config", str(cfg), "--max_steps", "3", "--learning_rate", "0.5", "--seed", "11"])
    assert (recipe.max_steps, recipe.learning_rate, recipe.seed) == (3, 0.5, 11)
    assert recipe.lr_scheduler_type == "cosine"  # file value kept where the CLI says nothing
    assert recipe.output_dir == str(in_tmp / "out")
    assert recipe.per_device_train_batch_size == Recipe().per_device_train_batch_size  # default where neither does


def test_cli_fixes_a_file_value_that_alone_is_invalid(in_tmp):
    out = in_tmp / "out"
    (out / "checkpoint-3").mkdir(parents=True)
    cfg = write_yaml(in_tmp / "r.yaml", base_yaml(in_tmp))
    with pytest.raises(ConfigError) as info:
        load_recipe(["--config", str(cfg)])
    assert len(info.value.problems) == 1 and "already holds a run" in info.value.problems[0]
    assert load_recipe(["--config", str(cfg), "--overwrite_output_dir"]).overwrite_output_dir is True
    assert load_recipe(["--config", str(cfg), "--resume_from_checkpoint", "latest"]).resume_from_checkpoint == "latest"


def test_output_dir_with_final_model_holds_a_run(in_tmp):
    (in_tmp / "out" / "final").mkdir(parents=True)
    with pytest.raises(ConfigError, match="already holds a run"):
        recipe_from_dict(valid(in_tmp))


def test_the_advice_for_an_output_dir_that_holds_a_run_depends_on_what_it_holds(in_tmp):
    """Issue 49 (4): resume is offered only when a checkpoint can be resumed (its completion marker written); a
    folder holding only a final model or checkpoints never completed gets overwrite_output_dir or another folder,
    not resume_from_checkpoint=latest, which would refuse it for having no checkpoint (a dead end)."""
    out = in_tmp / "out"
    (out / "final").mkdir(parents=True)
    (out / "checkpoint-4").mkdir()  # a save cut short: no completion marker

    def advice() -> str:
        with pytest.raises(ConfigError) as info:
            recipe_from_dict(valid(in_tmp))
        (problem,) = info.value.problems
        assert "already holds a run" in problem
        return problem

    dead_end = advice()
    assert "resume_from_checkpoint" not in dead_end, dead_end
    assert "overwrite_output_dir" in dead_end and "another output_dir" in dead_end
    (out / "checkpoint-4" / "hftrain_complete.json").write_text('{"files": {}}')
    resumable = advice()
    assert "resume_from_checkpoint=latest" in resumable and "checkpoint-4" in resumable
    assert "overwrite_output_dir" in resumable and "another output_dir" in resumable


def test_output_dir_with_other_files_is_fine(in_tmp):
    (in_tmp / "out").mkdir()
    (in_tmp / "out" / "notes.txt").write_text("x")
    (in_tmp / "out" / ".tmp-checkpoint-2").mkdir()  # an interrupted save is not a run
    assert recipe_from_dict(valid(in_tmp)).output_dir == str(in_tmp / "out")


def test_output_dir_that_is_a_file(in_tmp):
    (in_tmp / "out").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        recipe_from_dict(valid(in_tmp))


# ------------------------------------------------------------------- problems together
def test_every_problem_reported_in_one_error(in_tmp):
    cfg = write_yaml(in_tmp / "r.yaml", base_yaml(in_tmp, (
        "num_train_epoch: 2\n"  # unknown key, close to num_train_epochs
        "per_device_train_batch_size: eight\n"  # wrong type
        "bf16: true\nfp16: true\n"  # both precisions
        "warmup_steps: 5\nwarmup_ratio: 0.1\n"  # both warmups
        "lr_scheduler_type: constant\n"  # constant schedule with warmup
    )))
    with pytest.raises(ConfigError) as info:
        load_recipe(["--config", str(cfg)])
    problems = info.value.problems
    assert len(problems) == 5, problems
    joined = "\n".join(problems)
    assert "unknown key 'num_train_epoch'" in joined and "did you mean" in joined and "num_train_epochs" in joined
    assert any(p.startswith("per_device_train_batch_size:") and "'eight'" in p for p in problems)
    assert any("bf16" in p and "fp16" in p for p in problems)
    assert any("warmup_steps" in p and "warmup_ratio" in p for p in problems)
    assert any("constant" in p and "warmup" in p for p in problems)
    message = str(info.value)
    assert "5 problems" in message and str(cfg) in message
    for i in range(1, 6):
        assert f"({i})" in message


def test_cli_and_file_problems_reported_together(in_tmp):
    cfg = write_yaml(in_tmp / "r.yaml", base_yaml(in_tmp, "seeed: 3\n"))
    with pytest.raises(ConfigError) as info:
        load_recipe(["--config", str(cfg), "--max_steps", "ten", "--no_such_flag", "1"])
    problems = info.value.problems
    assert len(problems) == 3, problems  # the value after an unknown flag is not a problem of its own
    assert any("'--no_such_flag'" in p for p in problems)
    assert not any("unexpected value" in p for p in problems)
    assert any(p.startswith("max_steps:") and "'ten'" in p for p in problems)
    assert any(p.startswith("unknown key 'seeed'") for p in problems)


def test_a_command_line_typo_is_the_command_lines_problem_not_the_recipe_files(in_tmp):
    """Issue 49 (8): `--learning_rat` with a recipe file was "invalid recipe r.yaml, 1 problem: (1) unknown argument
    '--learning_rat'": the file was blamed for the command line's word. Each problem now comes under its source."""
    cfg = write_yaml(in_tmp / "r.yaml", base_yaml(in_tmp))
    with pytest.raises(ConfigError) as info:
        load_recipe(["--config", str(cfg), "--learning_rat", "1e-3"])
    assert str(info.value) == ("invalid command line, 1 problem: (1) unknown argument '--learning_rat' (did you mean "
                               "learning_rate?)")
    cfg = write_yaml(in_tmp / "r.yaml", base_yaml(in_tmp, "seeed: 3\n"))
    with pytest.raises(ConfigError) as info:
        load_recipe(["--config", str(cfg), "--learning_rat", "1e-3", "--max_steps", "ten"])
    assert str(info.value) == (
        "invalid command line, 2 problems: (1) unknown argument '--learning_rat' (did you mean learning_rate?) "
        "(2) max_steps: expected an integer, got 'ten'; "
        f"invalid recipe {cfg}, 1 problem: (1) unknown key 'seeed' (did you mean seed?)")
    assert len(info.value.problems) == 3


def test_stray_value_and_misspelt_flag(in_tmp):
    with pytest.raises(ConfigError) as info:
        load_recipe(["stray", "--lerning_rate", "1e-3"])
    assert info.value.problems[:2] == ["unexpected value 'stray' (fields are given as --name value)",
                                       "unknown argument '--lerning_rate' (did you mean learning_rate?)"]


def test_a_flag_prefix_is_a_problem_not_a_guess(in_tmp):
    """argparse would take --learning_rat for --learning_rate (and fail with its usage on --lora, which prefixes
    four fields); hftrain reports both as unknown, with the rest, in one error."""
    with pytest.raises(ConfigError) as info:
        load_recipe(["--learning_rat", "1e-3", "--lora", "1"])
    assert info.value.problems[:2] == ["unknown argument '--learning_rat' (did you mean learning_rate?)",
                                       "unknown argument '--lora' (did you mean lora_r?)"]


def test_a_file_value_overridden_on_the_command_line_is_not_checked(in_tmp):
    cfg = write_yaml(in_tmp / "r.yaml", base_yaml(in_tmp, "max_steps: ten\n"))
    assert load_recipe(["--config", str(cfg), "--max_steps", "7"]).max_steps == 7


def test_did_you_mean_for_a_misspelt_key(in_tmp):
    with pytest.raises(ConfigError) as info:
        recipe_from_dict(valid(in_tmp, lerning_rate=1e-3))
    (problem,) = info.value.problems
    assert "unknown key 'lerning_rate'" in problem
    assert "did you mean" in problem and "learning_rate" in problem


def test_single_problem_wording(in_tmp):
    with pytest.raises(ConfigError) as info:
        recipe_from_dict(valid(in_tmp, max_length=1))
    assert info.value.problems == ["max_length must be >= 2 tokens, got 1"]
    assert "1 problem:" in str(info.value)


def test_choices_are_checked(in_tmp):
    with pytest.raises(ConfigError) as info:
        recipe_from_dict(valid(in_tmp, optim="adafactor", lr_scheduler_type="polynomial"))
    problems = info.value.problems
    assert len(problems) == 2
    assert any(p.startswith("optim='adafactor'") and "adamw_torch" in p and "sgd" in p for p in problems)
    assert any(p.startswith("lr_scheduler_type='polynomial'") and "cosine" in p for p in problems)


def test_negative_loss_chunk_is_refused_with_the_other_problems(in_tmp):
    with pytest.raises(ConfigError) as info:
        recipe_from_dict(valid(in_tmp, loss_chunk_tokens=-1, optim="adafactor"))
    assert len(info.value.problems) == 2
    assert "loss_chunk_tokens must be >= 0 (0 = no chunking), got -1" in info.value.problems


def test_compile_mode_without_compile_is_refused_with_the_other_problems(in_tmp):
    with pytest.raises(ConfigError) as info:
        recipe_from_dict(valid(in_tmp, torch_compile_mode="max-autotune", loss_chunk_tokens=-1))
    assert len(info.value.problems) == 2
    assert any(p.startswith("torch_compile_mode=max-autotune is set but torch_compile is false")
               for p in info.value.problems)
    assert recipe_from_dict(valid(in_tmp, torch_compile=True, torch_compile_mode="max-autotune")).torch_compile
    with pytest.raises(ConfigError, match="torch_compile with tp_size > 1 is refused"):
        recipe_from_dict(valid(in_tmp, torch_compile=True, tp_size=2))


def test_liger_under_tensor_parallelism_is_refused_with_the_reason(in_tmp):
    """The fused loss takes lm_head.weight as the whole head; transformers' tp plan leaves each rank a vocabulary
    shard (hftrain.estimate's tp placement test shows the split), so the pair is refused from the recipe alone."""
    with pytest.raises(ConfigError) as info:
        recipe_from_dict(valid(in_tmp, use_liger_kernel=True, tp_size=2))
    (problem,) = info.value.problems
    assert problem.startswith("use_liger_kernel with tp_size=2 is refused") and "1/tp_size of the vocabulary" in problem
    assert recipe_from_dict(valid(in_tmp, use_liger_kernel=True)).use_liger_kernel  # alone: the machine decides


def test_lora_under_tensor_parallelism_is_refused_with_the_reason(in_tmp):
    """peft's adapters are not sharded with the layers they wrap: measured to fail in the first forward (sft and
    dpo alike), so the recipe is refused before anything loads; full fine-tuning under tp_size stays allowed."""
    with pytest.raises(ConfigError) as info:
        recipe_from_dict(valid(in_tmp, use_peft=True, tp_size=2))
    (problem,) = info.value.problems
    assert problem.startswith("use_peft with tp_size=2 is refused") and "data parallelism" in problem
    assert recipe_from_dict(valid(in_tmp, tp_size=2, objective="dpo",
                                  dataset_name=str(REPO / "data" / "preference.jsonl"))).tp_size == 2


def test_sequence_parallelism_alone_tensor_and_context_parallelism_together(in_tmp):
    for sizes in ({"tp_size": 2, "sp_size": 2}, {"cp_size": 2, "sp_size": 2}):
        with pytest.raises(ConfigError) as info:
            recipe_from_dict(valid(in_tmp, **sizes))
        assert any(p.startswith("sp_size=2 with tp_size=") and "Ulysses sequence parallelism runs under DeepSpeed"
                   in p for p in info.value.problems)
    with pytest.raises(ConfigError) as info:
        recipe_from_dict(valid(in_tmp, cp_size=0))
    assert "cp_size must be >= 1 (1 = off), got 0" in info.value.problems
    both = recipe_from_dict(valid(in_tmp, tp_size=2, cp_size=2))  # tp x cp: the launch is checked in the preflight
    assert (both.tp_size, both.cp_size) == (2, 2)
    for field in ("sp_size", "cp_size"):
        with pytest.raises(ConfigError, match=f"{field}=2 with objective=simpo is not supported: preference losses "
                                              "need each row's whole log-probability on one process"):
            recipe_from_dict(valid(in_tmp, **{field: 2}, objective="simpo"))
        assert getattr(recipe_from_dict(valid(in_tmp, **{field: 2})), field) == 2


def test_missing_config_file(in_tmp):
    with pytest.raises(ConfigError, match="cannot read recipe file"):
        load_recipe(["--config", str(in_tmp / "nope.yaml")])


def test_yaml_that_is_not_a_mapping(in_tmp):
    cfg = write_yaml(in_tmp / "r.yaml", "- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        read_yaml(str(cfg))


# ------------------------------------------------------------------------------- --help
def test_help_mentions_every_field():
    text = build_arg_parser().format_help()
    missing = [name for name in FIELDS if f"--{name}" not in text]
    assert not missing
    assert "--config" in text
    # the help of a field reaches --help (first words, as argparse may rewrap the rest)
    assert " ".join(FIELDS["learning_rate"].metadata["help"].split()[:2]) in " ".join(text.split())



def recipe_help(capsys, *argv: str, prog: str = "hftrain finetune") -> str:
    """What the recipe's parser prints for `argv` (it exits 0 after printing)."""
    with pytest.raises(SystemExit) as info:
        build_arg_parser(prog).parse_known_args(list(argv))
    assert info.value.code == 0
    return capsys.readouterr().out


def test_hftrain_finetune_help_is_named_so_and_lists_the_groups_and_common_fields(capsys, monkeypatch):
    """Issue 49: `hftrain finetune --help` was 954 lines under the name hftrain.finetune. It is the command's name,
    and by default each group in a line with its commonly used fields, one line each."""
    from hftrain.cli import main

    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as info:
        main(["finetune", "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and out.startswith("usage: hftrain finetune [--help [GROUP|FIELD|all]]")
    lines = out.splitlines()
    assert len(lines) <= 80 and max(len(line) for line in lines) <= 100
    for group, (_, common) in HELP_GROUPS.items():
        assert any(line.startswith(f"{group} (") for line in lines), group
        for name in common:
            assert sum(line.lstrip().startswith(f"--{name} ") for line in lines) == 1, name
    assert "(--help data)" in out and "all: every field" in out


def test_every_field_is_reached_through_the_full_help(capsys):
    """Nothing is lost: `--help all` shows every field with its whole help, `--help GROUP` each group's, `--help
    FIELD` one field's, with its default."""
    everything = recipe_help(capsys, "--help", "all")
    assert [name for name in FIELDS if f"--{name} " not in everything] == []
    by_group = {group: recipe_help(capsys, "--help", group) for group in HELP_GROUPS}
    for name, f in FIELDS.items():
        assert f"--{name} " in by_group[f.metadata["group"]], name
    one = " ".join(recipe_help(capsys, "--help", "learning_rate").split())
    assert "--learning_rate FLOAT Peak learning rate. (default: 5e-05)" in one and "--lora_r" not in one
    with pytest.raises(SystemExit) as info:
        build_arg_parser().parse_known_args(["--help", "nonsense"])
    assert info.value.code == 2 and "no such group or field" in capsys.readouterr().err


def test_the_help_groups_name_every_group_and_only_fields():
    assert list(HELP_GROUPS) == list(dict.fromkeys(f.metadata["group"] for f in FIELDS.values()))
    assert [name for _, common in HELP_GROUPS.values() for name in common if name not in FIELDS] == []


def test_hftrain_finetune_help_imports_neither_torch_nor_transformers():
    """The help is the recipe's, printed before the training module (torch, transformers, datasets) is imported."""
    code = ("import sys\nfrom hftrain.cli import main\ntry:\n    main(['finetune', '--help'])\nexcept SystemExit:\n"
            "    pass\nprint('imported:', sorted(m for m in ('torch', 'transformers', 'datasets', 'accelerate') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.startswith("usage: hftrain finetune") and out.splitlines()[-1] == "imported: []"

# ------------------------------------------------------------------------------ presets
def test_there_are_presets():
    assert PRESETS, "recipes/*.yaml should hold at least one preset"


def same_value(got, value) -> bool:
    """`got` (a Recipe attribute) is what the YAML `value` says, after the documented coercions."""
    if dataclasses.is_dataclass(got) and isinstance(value, dict):
        return all(same_value(getattr(got, k), v) for k, v in value.items())
    if isinstance(got, list):
        items = value.split(",") if isinstance(value, str) else value
        return len(got) == len(items) and all(same_value(g, v) for g, v in zip(got, items, strict=True))
    if isinstance(got, float):
        return got == pytest.approx(float(value))
    return got == value


@pytest.mark.parametrize("preset", PRESETS, ids=[p.name for p in PRESETS])
def test_every_preset_parses(preset, monkeypatch):
    monkeypatch.chdir(REPO)  # presets name repo-relative model and data paths
    values = read_yaml(str(preset))
    checked = {**values, "overwrite_output_dir": True}
    prepared = re.search(r"prepare once: python scripts/convert_gguf.py (\S+)", preset.read_text(encoding="utf-8"))
    if prepared and not Path(values["model_name_or_path"]).is_dir():
        assert prepared.group(1) == values["model_name_or_path"]  # the prepare step makes the recipe's model folder
        checked["model_name_or_path"] = str(MODEL)  # not converted on this machine: check every other field
    staged = re.search(r"prepare once: hftrain launch --preset \S+ --config (\S+)", preset.read_text(encoding="utf-8"))
    if staged and not Path(values["model_name_or_path"]).is_dir():  # a second stage: the first stage's final model
        assert f"{read_yaml(staged.group(1))['output_dir']}/final" == values["model_name_or_path"]
        checked["model_name_or_path"] = str(MODEL)
    recipe = recipe_from_dict(checked, source=f"recipe {preset}")
    for key, value in values.items():
        if checked[key] != value:
            continue
        assert same_value(getattr(recipe, key), value), key


@pytest.mark.parametrize("preset", PRESETS, ids=[p.name for p in PRESETS])
def test_every_preset_starts_with_its_launch_command(preset):
    head = "\n".join(preset.read_text(encoding="utf-8").splitlines()[:5])
    assert f"--config recipes/{preset.name}" in head


# ------------------------------------------------------------------------------ paths
def test_missing_model_folder_and_data_files_reported(in_tmp):
    model, data, evald = in_tmp / "no-model", in_tmp / "missing.jsonl", in_tmp / "missing-eval.jsonl"
    with pytest.raises(ConfigError) as info:
        recipe_from_dict(valid(in_tmp, model_name_or_path=str(model), dataset_name=str(data),
                               eval_dataset_name=str(evald), validation_split_percentage=0))
    problems = info.value.problems
    assert len(problems) == 3, problems
    assert any(p.startswith("model_name_or_path") and str(model) in p for p in problems)
    assert any(p.startswith("dataset_name") and str(data) in p for p in problems)
    assert any(p.startswith("eval_dataset_name") and str(evald) in p for p in problems)


def test_relative_local_paths_and_hub_ids(in_tmp):
    with pytest.raises(ConfigError, match="model_name_or_path './nowhere'"):
        recipe_from_dict(valid(in_tmp, model_name_or_path="./nowhere"))
    # a hub id (org/name) is not checked locally
    recipe = recipe_from_dict(valid(in_tmp, model_name_or_path="someorg/somemodel", dataset_name="someorg/chat"))
    assert recipe.model_name_or_path == "someorg/somemodel"


def test_model_file_is_not_a_model_folder(in_tmp):
    (in_tmp / "weights.bin").write_text("x")
    with pytest.raises(ConfigError, match="is not a folder"):
        recipe_from_dict(valid(in_tmp, model_name_or_path=str(in_tmp / "weights.bin")))


def test_resume_from_missing_folder_reported(in_tmp):
    missing = in_tmp / "out" / "checkpoint-7"
    with pytest.raises(ConfigError) as info:
        recipe_from_dict(valid(in_tmp, resume_from_checkpoint=str(missing)))
    (problem,) = info.value.problems
    assert problem.startswith("resume_from_checkpoint") and str(missing) in problem
    missing.mkdir(parents=True)
    recipe = recipe_from_dict(valid(in_tmp, resume_from_checkpoint=str(missing)))
    assert recipe.resume_from_checkpoint == str(missing)


# ------------------------------------------------------------------------------ errors
def test_report_and_exit_prints_one_paragraph(capsys):
    problems = [f"problem number {i} with a rather long explanation of what to change in the recipe"
                for i in range(4)]
    error = ConfigError(problems, "recipe r.yaml")
    with pytest.raises(SystemExit) as info:
        report_and_exit(error)
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err
    assert err.startswith("hftrain: error:")
    assert err.endswith("\n") and "\n\n" not in err and err.strip() == err.rstrip("\n")
    assert len(err.strip().splitlines()) > 1  # long text is wrapped ...
    assert all(len(line) <= 100 for line in err.splitlines())
    assert " ".join(err.split()) == f"hftrain: error: {error}"  # ... but nothing is lost


def test_report_and_exit_plain_error(capsys):
    with pytest.raises(SystemExit) as info:
        report_and_exit(HftrainError("dataset 'x' is empty"))
    assert info.value.code == 2
    assert capsys.readouterr().err == "hftrain: error: dataset 'x' is empty\n"


def test_an_error_every_process_meets_is_left_to_each_machines_first_process(monkeypatch, capsys):
    """A recipe error in every process of a launch: the first process of the machine (LOCAL_RANK 0, or no launcher)
    reports it at once; the others wait for the launcher to stop them (the first has exited with the error), and
    report it themselves only if that does not happen."""
    from hftrain import errors, finetune

    waits = []
    monkeypatch.setattr(errors.time, "sleep", waits.append)
    for local_rank, waited in ((None, []), ("0", []), ("1", [errors.ALIKE_WAIT_SECONDS])):
        if local_rank is None:
            monkeypatch.delenv("LOCAL_RANK", raising=False)
        else:
            monkeypatch.setenv("LOCAL_RANK", local_rank)
        waits.clear()
        with pytest.raises(SystemExit) as info:
            finetune.main(["--learning_rate", "-1", "--output_dir", "/nonexistent/out"])
        assert info.value.code == 2 and waits == waited
        assert "learning_rate must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # an error of this process's own is reported at once
        report_and_exit(HftrainError("rank 1 timed out"))
    assert waits == [errors.ALIKE_WAIT_SECONDS] and "rank 1 timed out" in capsys.readouterr().err


def test_grpo_runs_under_sequence_and_context_parallelism_preference_losses_do_not(in_tmp):
    grpo = {"objective": "grpo", "reward_funcs": ["hftrain.rl.example_rewards.vowel_share"]}
    assert recipe_from_dict(valid(in_tmp, **grpo, sp_size=2)).sp_size == 2
    assert recipe_from_dict(valid(in_tmp, **grpo, cp_size=2)).cp_size == 2
    with pytest.raises(ConfigError) as info:  # preference losses still need a pair's whole log-probability
        recipe_from_dict(valid(in_tmp, objective="dpo", cp_size=2))
    assert any(p.startswith("cp_size=2 with objective=dpo is not supported") for p in info.value.problems)
    with pytest.raises(ConfigError) as info:
        recipe_from_dict(valid(in_tmp, **grpo, sp_size=2, use_vllm=True))
    assert any(p.startswith("sp_size=2 with use_vllm is not supported") for p in info.value.problems)
