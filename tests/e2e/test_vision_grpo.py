"""grpo on an image-text model (the tiny random LLaVA, whose processor expands each <image> into 16 image tokens)
through the real entry script, on prompts with images in TRL's vision format (data/image-prompts.jsonl): completions
sampled with the processor's pixels, every completion in rollouts.jsonl with its prompt's image; steps 1 and 2 equal
a plain-PyTorch recomputation from rollouts.jsonl (each prompt rendered and its image encoded again by the
processor, the policy's and the frozen reference's log-probs of the completion tokens on those pixels: dapo's loss
with beta's KL, clipping, SGD, the projector trained with the language model), for LLaVA and Gemma 3 (whose
token_type_ids travel with the pixels); step 1 equals TRL 1.16's GRPOTrainer on the same rows (its generation
replaced by the rollouts' completions, everything else TRL's own: the prompt ids, the pixels, the rewards'
advantages, the loss and the update); 1 process x 8 completions == 2 accumulated micro-batches of 4 == 2 DDP
processes of 4 (gloo); a checkpoint inside a window resumes exactly; the evaluation completes prompts with images;
LoRA trains against the adapter-off model on the same pixels; the shipped recipe raises its image-reading reward.

Runs are shared by the assertions (a module fixture): 2 steps of 8 completions of <= 6 tokens each, SGD (its update
is proportional to the gradient, as tests/e2e/test_grpo.py explains)."""

from __future__ import annotations

import importlib.util
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoProcessor

from hftrain import vision
from tests.conftest import FSDP_LAUNCHER, REPO, launch, run_script, write_jsonl

pytestmark = pytest.mark.launch
MODEL = REPO / "models" / "tiny-vlm"
DATA = REPO / "data" / "image-prompts.jsonl"
REWARD = "hftrain.rl.example_rewards.colour_letters"
BETA = 0.5
# sequential: window w holds the data's prompts 2w and 2w + 1; the projector trains with the language model, so the
# pixels reach the gradient (the vision tower stays frozen, its default)
BASE = ["--model_name_or_path", str(MODEL), "--dataset_name", str(DATA), "--objective", "grpo",
        "--reward_funcs", REWARD, "--num_generations", "4", "--max_completion_length", "6", "--max_steps", "2",
        "--optim", "sgd", "--learning_rate", "1.0", "--weight_decay", "0", "--lr_scheduler_type", "constant",
        "--warmup_steps", "0", "--max_grad_norm", "1.0", "--eval_strategy", "no", "--save_strategy", "no",
        "--logging_steps", "1", "--report_to", "none", "--seed", "3", "--ddp_timeout", "120", "--beta", str(BETA),
        "--train_sampling_strategy", "sequential", "--freeze_projector", "false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vlm-grpo")
    return {
        "one": run_script(tmp / "one", *BASE, "--per_device_train_batch_size", "8", "--save_strategy", "steps",
                          "--save_steps", "1", "--checkpoint_preflight", "false"),
        "accum": run_script(tmp / "accum", *BASE, "--per_device_train_batch_size", "4",
                            "--gradient_accumulation_steps", "2"),
        "ddp": launch(tmp / "ddp", *BASE, "--per_device_train_batch_size", "4", preset="cpu_ddp"),
        # generation under sharded weights with the pixels: ZeRO-3 gathers them around generate, FSDP2 generates
        # through its shards (synced_gpus: a rank whose completions all ended keeps gathering with the other)
        "zero3": launch(tmp / "zero3", *BASE, "--per_device_train_batch_size", "4", preset="zero3", processes=2),
        "fsdp2": launch(tmp / "fsdp2", *BASE, "--per_device_train_batch_size", "4", preset="fsdp2", processes=2,
                        script=FSDP_LAUNCHER),
    }


def rollouts(run) -> list[dict]:
    return [json.loads(line) for line in (run.output_dir / "rollouts.jsonl").read_text().splitlines()]


def data_rows() -> list[dict]:
    return [json.loads(line) for line in DATA.read_text().splitlines()]


def plain_log_probs(model, processor, row: dict, prompt: dict) -> torch.Tensor:
    """The completion tokens' log-probs of `row` (rollouts.jsonl) under `model`, its prompt rendered from the data
    row `prompt` by the processor's chat template and its image encoded again (TRL's placement of the image before
    the first user message's text for string content): every processor output goes to the model (Qwen-VL's
    image_grid_thw too: the model derives its multimodal rotary positions), a per-token one (Gemma 3's
    token_type_ids, Qwen-VL's mm_token_type_ids) extended with 0 over the completion."""
    messages = [{"role": m["role"], "content": [{"type": "image"}, {"type": "text", "text": m["content"]}]}
                if isinstance(m["content"], str) else m for m in prompt["prompt"]]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    image = Image.open(DATA.parent / prompt["images"][0]).convert("RGB")
    inputs = processor(text=[text], images=[image], return_tensors="pt", add_special_tokens=False)
    assert inputs.pop("input_ids")[0].tolist() == row["prompt_ids"]  # the rollouts' prompt, the image's tokens in it
    inputs.pop("attention_mask")
    n = len(row["completion_ids"])
    for key in {"token_type_ids", "mm_token_type_ids"} & set(inputs):
        inputs[key] = torch.cat([inputs[key], torch.zeros(1, n, dtype=inputs[key].dtype)], dim=1)
    ids = torch.tensor([row["prompt_ids"] + row["completion_ids"]])
    logps = torch.log_softmax(model(input_ids=ids, **inputs).logits[0, :-1].float(), -1)
    return logps[-n:].gather(1, torch.tensor(row["completion_ids"])[:, None]).squeeze(1)


def plain_step(model, reference, processor, rows: list[dict]) -> float:
    """One optimizer step written out: dapo's -sum(A * exp(logp - logp.detach())) + beta x TRL's KL
    (exp(ref - logp) - (ref - logp) - 1, times the ratio: use_bias_correction_kl) over the completion tokens, divided
    by their count; clipping at 1.0, SGD at 1.0. Returns the KL's token mean (the step's `kl` metric)."""
    prompts = data_rows()
    tokens = sum(len(r["completion_ids"]) for r in rows)
    loss, kl_sum = 0.0, 0.0
    for r in rows:
        prompt = prompts[2 * r["window"] + r["group"]]
        assert r["images"] == prompt["images"]  # rollouts.jsonl names the prompt's image as the data gives it
        logps = plain_log_probs(model, processor, r, prompt)
        with torch.no_grad():
            ref = plain_log_probs(reference, processor, r, prompt)
        ratio = torch.exp(logps - logps.detach())
        kl = (torch.exp(ref - logps) - (ref - logps) - 1) * ratio
        loss = loss + (-(r["advantage"] * ratio) + BETA * kl).sum()
        kl_sum += kl.detach().sum().item()
    (loss / tokens).backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0).step()
    model.zero_grad()
    return kl_sum / tokens


def starting_model(folder=MODEL):
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    for name, param in model.named_parameters():  # freeze_vision_tower's default
        if vision.part_of(name) == "vision":
            param.requires_grad_(False)
    return model


def assert_weights(got: dict, model, **tolerance) -> None:
    """Every trained tensor of `model` (a checkpoint holds those, under the loss wrapper's names) equals `got`'s."""
    got = {k.removeprefix("lm."): v for k, v in got.items()}
    state = model.state_dict()
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained <= set(got), sorted(trained - set(got))[:3]
    for name, value in ((n, v) for n, v in state.items() if n in got):
        torch.testing.assert_close(got[name], value, msg=lambda m, name=name: f"{name}: {m}", **tolerance)


def assert_two_steps_equal_plain_pytorch(run, folder) -> None:
    """Step 1 (the policy is the reference: KL 0) and step 2 (KL > 0, the logged `kl`) written out from
    rollouts.jsonl, against checkpoint-1 and the final folder; the projector moved."""
    rows = rollouts(run)
    assert [r["step"] for r in rows] == [1] * 8 + [2] * 8 and all(len(r["images"]) == 1 for r in rows)
    processor = AutoProcessor.from_pretrained(folder)
    image = processor.image_token_id  # in each prompt, never sampled
    assert all(image in r["prompt_ids"] and image not in r["completion_ids"] for r in rows)
    model, reference = starting_model(folder), starting_model(folder).eval()
    kl1 = plain_step(model, reference, processor, [r for r in rows if r["step"] == 1])
    assert kl1 == pytest.approx(0.0, abs=1e-7)
    assert_weights(load_file(run.output_dir / "checkpoint-1" / "model.safetensors"), model, rtol=1e-4, atol=2e-6)
    kl2 = plain_step(model, reference, processor, [r for r in rows if r["step"] == 2])
    assert kl2 > 0 and run.train_rows()[1]["kl"] == pytest.approx(kl2, rel=1e-4)
    final = AutoModelForImageTextToText.from_pretrained(run.output_dir / "final", dtype=torch.float32).state_dict()
    assert_weights(final, model, rtol=1e-4, atol=2e-6)
    start = reference.state_dict()
    assert any(not torch.equal(start[k], final[k]) for k in start if vision.part_of(k) == "projector")


def test_two_steps_equal_plain_pytorch_on_the_same_pixels(runs):
    """LLaVA: each prompt holds its image's 16 tokens."""
    assert all(r["prompt_ids"].count(753) == 16 for r in rollouts(runs["one"]))  # models/tiny-vlm's image token
    assert_two_steps_equal_plain_pytorch(runs["one"], MODEL)


def test_gemma3_with_its_token_types_equals_plain_pytorch(image_text_model, tmp_path):
    """Gemma 3 (built by scripts/make_tiny_model.py): its processor's token_type_ids mark the image tokens, which
    attend to each other both ways; they reach generate (left-padded) and every forward (0 over the completion), so
    two steps equal the plain computation given the processor's outputs."""
    folder = image_text_model("gemma3")
    run = run_script(tmp_path / "gemma3", *[str(folder) if a == str(MODEL) else a for a in BASE],
                     "--per_device_train_batch_size", "8", "--save_strategy", "steps", "--save_steps", "1",
                     "--checkpoint_preflight", "false")
    assert_two_steps_equal_plain_pytorch(run, folder)


# each 2-process run's launch as its state.json records it: process count, wrapper and, for ZeRO-3, the stage
LAUNCHED = {"ddp": (2, "DistributedDataParallel", None), "zero3": (2, "DeepSpeedEngine", 3),
            "fsdp2": (2, "FSDPGRPOLoss", None)}


@pytest.mark.parametrize("other", ["accum", "ddp", "zero3", "fsdp2"])
def test_accumulation_and_two_processes_equal_one_batch(runs, other):
    """The same prompts, completions, images and advantages in rollouts.jsonl, the same per-step metrics and final
    weights; under ZeRO-3 and FSDP2 the completions are sampled through the sharded model with the pixels."""
    a, b = runs["one"], runs[other]
    if other in LAUNCHED:
        state = b.state()
        assert state["launch"]["backend"] == "gloo"
        assert (state["launch"]["num_processes"], state["launch"]["model_wrapper"],
                state["parallelism"].get("zero_stage")) == LAUNCHED[other]
    keys = ("step", "group", "prompt_ids", "completion_ids", "images")
    assert [[r[k] for k in keys] for r in rollouts(a)] == [[r[k] for k in keys] for r in rollouts(b)]
    torch.testing.assert_close(torch.tensor([r["advantage"] for r in rollouts(b)]),
                               torch.tensor([r["advantage"] for r in rollouts(a)]), rtol=1e-5, atol=1e-6)
    for x, y in zip(a.train_rows(), b.train_rows(), strict=True):
        for name in ("loss", "grad_norm", "reward", "kl", "entropy"):
            assert y[name] == pytest.approx(x[name], rel=1e-4, abs=1e-6), name
    expected = load_file(a.output_dir / "final" / "model.safetensors")
    for name, value in load_file(b.output_dir / "final" / "model.safetensors").items():
        torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-5, msg=name)


def test_first_step_equals_trl_grpo_trainer(runs, tmp_path):
    """TRL 1.16's GRPOTrainer on the first window's two prompts (the data's first rows, their images decoded as PIL
    images), with the run's settings: its generation (`_generate_single_turn`) hands back the rollouts' completions
    of each prompt it tokenized (looked up by TRL's own prompt ids, so they must equal rollouts.jsonl's: the image
    expanded by TRL's processor call), a reward function returns the recorded rewards; the rest is TRL's: the pixels
    of its forward (its processor call on the images), the reference's log-probs, the advantages, the loss and the
    SGD update. Its trained weights equal hftrain's checkpoint-1."""
    assert_first_step_equals_trl(runs["one"], MODEL, tmp_path)


def assert_first_step_equals_trl(run, folder, tmp_path) -> None:
    """test_first_step_equals_trl_grpo_trainer on `run` of the image-text model in `folder` (any family)."""
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    rows = [r for r in rollouts(run) if r["step"] == 1]
    completions, rewards = {}, {}
    for r in rows:
        completions.setdefault(tuple(r["prompt_ids"]), []).append(r["completion_ids"])
        rewards[(r["group"], tuple(r["completion_ids"]))] = r["reward"]
    prompts = data_rows()[:2]
    for p in prompts:  # one Arrow type for every row's content: a string prompt with its image part, as TRL places it
        p["prompt"] = [{"role": m["role"], "content": [{"type": "image"}, {"type": "text", "text": m["content"]}]}
                       if isinstance(m["content"], str) else m for m in p["prompt"]]
    dataset = datasets.Dataset.from_list([{"prompt": p["prompt"], "images": [str(DATA.parent / p["images"][0])],
                                           "group": g} for g, p in enumerate(prompts)])
    dataset = dataset.cast_column("images", datasets.Sequence(datasets.Image()))

    def recorded(prompts, completions, completion_ids, group, **kwargs):
        return [rewards[(g, tuple(ids))] for g, ids in zip(group, completion_ids)]

    model = starting_model(folder)
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=6, beta=BETA, loss_type="dapo", optim="sgd",
                      learning_rate=1.0, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
                      max_steps=1, logging_steps=1, save_strategy="no", report_to=[], seed=3, shuffle_dataset=False,
                      disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=[recorded], args=args, train_dataset=dataset,
                          processing_class=AutoProcessor.from_pretrained(folder))

    def replayed(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        taken: dict = {}
        out = []
        for ids in prompt_ids:
            key = tuple(ids.tolist() if hasattr(ids, "tolist") else ids)
            out.append(completions[key][taken.get(key, 0)])
            taken[key] = taken.get(key, 0) + 1
        return out, None

    trainer._generate_single_turn = replayed
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["grad_norm"] == pytest.approx(run.train_rows()[0]["grad_norm"], rel=1e-4)
    assert logged["reward"] == pytest.approx(run.train_rows()[0]["reward"], rel=1e-5)
    assert_weights(load_file(run.output_dir / "checkpoint-1" / "model.safetensors"), trainer.model, rtol=1e-4,
                   atol=2e-6)


def test_the_shipped_recipe_raises_the_reward_read_from_the_images(tmp_path):
    """recipes/tiny-vlm-grpo.yaml as shipped (20 steps of 16 completions): the mean reward of the last 5 steps is
    above the first 5 steps' (colour_letters reads the shape's colour from each prompt's image), and every completion
    in rollouts.jsonl names its prompt's image as the data does."""
    run = run_script(tmp_path / "recipe", "--config", str(REPO / "recipes" / "tiny-vlm-grpo.yaml"), "--logging_steps",
                     "1")
    rewards = [r["reward"] for r in run.train_rows()]
    assert len(rewards) == 20 and sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.05, rewards
    shipped = {json.dumps(row["images"]) for row in data_rows()}
    assert all(json.dumps(r["images"]) in shipped for r in rollouts(run))


def test_a_checkpoint_inside_a_window_resumes_exactly_and_evaluation_completes_prompts_with_images(tmp_path):
    """steps_per_generation 2: one window of 8 completions trains steps 1 and 2 (step 2 against the stored old
    log-probs, computed on the window's pixels), so checkpoint-1 lies inside the window and holds its second
    micro-batch, pixels included (their dtypes saved beside them). Resumed from it, step 2 and the final weights are
    the uninterrupted run's. The evaluation at the end completes 2 eval prompts with images (eval_rollouts.jsonl names
    each one's image as the eval data gives it, and scores it with the image-reading reward)."""
    evals = [{**row, "images": [str(DATA.parent / row["images"][0])]} for row in data_rows()[-2:]]
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps(row) + "\n" for row in evals))
    args = [*BASE, "--per_device_train_batch_size", "4", "--steps_per_generation", "2", "--save_strategy", "steps",
            "--save_steps", "1", "--checkpoint_preflight", "false", "--eval_strategy", "steps", "--eval_steps", "2",
            "--eval_dataset_name", str(eval_file), "--per_device_eval_batch_size", "4"]
    done = run_script(tmp_path / "run", *args)
    (state,) = (done.output_dir / "checkpoint-1").glob("data_stream_process*.json")
    saved = json.loads(state.read_text())
    assert saved["dtypes"]["pixel_values"] == "float32" and len(saved["micro_batches"]) == 2
    uninterrupted, expected = done.train_rows()[-1], load_file(done.output_dir / "final" / "model.safetensors")
    eval_rows = [json.loads(line) for line in (done.output_dir / "eval_rollouts.jsonl").read_text().splitlines()]
    assert len(eval_rows) == 8 and {json.dumps(r["images"]) for r in eval_rows} == {json.dumps(e["images"])
                                                                                    for e in evals}
    assert all(r["reward"] is not None for r in eval_rows) and any("eval_reward" in m for m in done.metrics())
    shutil.rmtree(done.output_dir / "final")
    shutil.rmtree(done.output_dir / "checkpoint-2")
    resumed = run_script(tmp_path / "run", *args, "--resume_from_checkpoint", "latest")
    assert "resuming from" in resumed.stdout
    row = resumed.train_rows()[-1]
    assert row["step"] == 2
    for key in ("loss", "grad_norm", "kl"):
        assert row[key] == pytest.approx(uninterrupted[key], rel=1e-5, abs=1e-7), key
    for name, value in load_file(resumed.output_dir / "final" / "model.safetensors").items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("bits", [None, 4])
def test_lora_with_beta_trains_against_the_adapter_off_model_on_the_same_pixels(tmp_path, bits):
    """LoRA (q_proj, v_proj) with beta 0.5, and QLoRA (the same on the base loaded in 4 bits by bitsandbytes, NF4,
    float32 compute, on the CPU): step 2 written out with peft from checkpoint-1's adapter, on the base as plain
    transformers loads it (QLoRA: the same 4-bit settings, then peft's prepare_model_for_kbit_training), the
    reference the base (hftrain disables the adapters), both on each prompt's pixels: the logged kl and the adapter
    after one SGD step (clipping at 1.0) equal the run's checkpoint-2."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    quantized = ["--load_in_4bit", "true"] if bits else []
    run = run_script(tmp_path / "lora", *BASE, "--per_device_train_batch_size", "8", "--use_peft", "--lora_r", "4",
                     "--lora_alpha", "8", "--lora_dropout", "0", "--lora_target_modules", "q_proj,v_proj",
                     "--save_strategy", "steps", "--save_steps", "1", "--checkpoint_preflight", "false", *quantized)
    processor = AutoProcessor.from_pretrained(MODEL)

    def base():
        if not bits:
            return starting_model()
        model = AutoModelForImageTextToText.from_pretrained(MODEL, dtype=torch.float32, quantization_config=(
            BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)))
        layers = [m for m in model.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
        assert layers  # Linear4bit, kept in their training layout as in the run
        for module in layers:
            module.support_avx512bf16_for_cpu = False
        return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)

    policy = get_peft_model(base(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                               lora_dropout=0.0))
    four_bit = sum(type(m).__name__ == "Linear4bit" and type(m).__module__.startswith("bitsandbytes")
                   for m in policy.modules())
    assert run.state()["model"]["quantized_linear_layers"] == ({"Linear4bit": four_bit} if bits else {})
    assert (four_bit > 0) == bool(bits)
    trained = {k.removeprefix("lm."): v for k, v in load_file(run.output_dir / "checkpoint-1" /
                                                              "model.safetensors").items()}
    assert trained and all("lora_" in k for k in trained)
    missing, unexpected = policy.load_state_dict(trained, strict=False)
    assert not unexpected and not [k for k in missing if "lora_" in k]
    kl = plain_step(policy, base().eval(), processor, [r for r in rollouts(run) if r["step"] == 2])
    assert kl > 0 and run.train_rows()[1]["kl"] == pytest.approx(kl, rel=1e-4)
    got = {k.removeprefix("lm."): v for k, v in load_file(run.output_dir / "checkpoint-2" /
                                                          "model.safetensors").items()}
    expected = {k: v for k, v in policy.state_dict().items() if "lora_" in k}
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=2e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_under_zero3_a_prompt_without_an_image_is_refused_before_the_model_loads(tmp_path):
    """ZeRO-3 gathers the vision tower's weights from every process in each of its forwards, frozen or not: a
    process whose batch held no image would leave the other waiting. A prompt set with one prompt without an image
    (the vision tower and projector frozen, which DDP would take) stops the run at the data, naming the count."""
    rows = [{**row, "images": [str(DATA.parent / row["images"][0])]} for row in data_rows()[:8]]
    rows[3] = {"prompt": [{"role": "user", "content": "Say something."}]}
    data = write_jsonl(tmp_path / "mixed.jsonl", rows)
    assert BASE[-2:] == ["--freeze_projector", "false"]  # left out: both parts frozen
    args = [str(data) if a == str(DATA) else a for a in BASE[:-2]]
    run = launch(tmp_path / "zero3", *args, "--per_device_train_batch_size", "4", preset="zero3", processes=2,
                 check=False, env={"TRANSFORMERS_VERBOSITY": "info"})  # from_pretrained logs "loading weights file"
    assert run.returncode != 0
    first = run.stderr.index("hftrain: error:")
    message = " ".join(run.stderr[first:].split("\n\n")[0].split())
    assert "1 of 8 prompts hold no image" in message and "under ZeRO-3 or FSDP2" in message
    assert "Traceback" not in run.stderr[:first]  # the launcher's report of the failed processes comes after
    assert "loading weights file" not in run.stderr and not (tmp_path / "zero3" / "final").exists()


# ChatML with tool calling (models/tiny-tools' template, each content a string or a list of parts, an image part
# written <image>: the tiny LLaVA's; IMAGE_PART for other families) and tiny-tools' response_template, so that the
# turns parse into tool calls
TOOLS_TEMPLATE = (
    "{%- macro text(content) %}{%- if content is string %}{{- content }}{%- else %}{%- for part in content %}"
    "{%- if part['type'] == 'image' %}{{- '<image>' }}{%- elif part['type'] == 'text' %}{{- part['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}{%- endmacro %}"
    + (REPO / "models" / "tiny-tools" / "chat_template.jinja").read_text()
    .replace("messages[0].content + '\\n\\n'", "text(messages[0].content) + '\\n\\n'")
    .replace("messages[0].content + '<|im_end|>\\n'", "text(messages[0].content) + '<|im_end|>\\n'")
    .replace("(message.content or '')", "text(message.content or '')")
    .replace("'<|im_start|>tool\\n' + message.content", "'<|im_start|>tool\\n' + text(message.content)")
    .replace("'\\n' + message.content + '<|im_end|>\\n'", "'\\n' + text(message.content) + '<|im_end|>\\n'")
)


IMAGE_PART = {"llava": "<image>", "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>"}


def tool_calling_vlm(base, folder):
    """The image-text model `base` copied with TOOLS_TEMPLATE (its family's image part) and tiny-tools'
    response_template."""
    shutil.copytree(base, folder)
    family = json.loads((base / "config.json").read_text())["model_type"]
    (folder / "chat_template.jinja").write_text(TOOLS_TEMPLATE.replace("'<image>'", repr(IMAGE_PART[family])))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["response_template"] = json.loads((REPO / "models" / "tiny-tools" / "tokenizer_config.json").read_text()
                                             )["response_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


def test_tool_calling_with_images_equals_trl_grpo_trainer(tmp_path):
    """The tiny LLaVA (each prompt's image: 16 tokens): assert_tools_with_images_equal_trl; and 2 DDP processes of 4
    completions (gloo; a process with nothing left to continue samples a row again and drops it, with its pixels)
    equal the one process of 8: the rollouts (turns, tool calls, masks), the step's values and the weights."""
    one, args = assert_tools_with_images_equal_trl(MODEL, tmp_path)
    assert all(r["prompt_ids"].count(753) == 16 for r in rollouts(one))
    two = launch(tmp_path / "ddp", *args[:-1], "4", preset="cpu_ddp", script=SCRIPTED)
    assert (two.state()["launch"]["num_processes"], two.state()["launch"]["backend"]) == (2, "gloo")
    keys = ("group", "prompt_ids", "completion_ids", "tool_mask", "tool_calls", "images", "reward")
    assert [[r[k] for k in keys] for r in rollouts(one)] == [[r[k] for k in keys] for r in rollouts(two)]
    for name in ("loss", "grad_norm", "reward", "entropy", "tools/call_frequency", "tools/failure_frequency"):
        assert two.train_rows()[0][name] == pytest.approx(one.train_rows()[0][name], rel=1e-4, abs=1e-6), name
    expected = load_file(one.output_dir / "final" / "model.safetensors")
    for name, value in load_file(two.output_dir / "final" / "model.safetensors").items():
        torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-5, msg=name)


SCRIPTED = REPO / "tests" / "e2e" / "launchers" / "scripted_tools.py"


ENVIRONMENT = '''from hftrain.rl.example_tools import OPERATIONS


class Calculator:
    def reset(self, **row):
        return " Use the calculator."

    def calculator(self, a: int, op: str, b: int) -> int:
        """Compute a op b.

        Args:
            a: The left operand.
            op: One of +, - and *.
            b: The right operand.
        """
        if op not in OPERATIONS:
            raise ValueError(f"unknown operation {op!r}; use one of + - *")
        return OPERATIONS[op](int(a), int(b))
'''


def test_an_environment_with_images_equals_trl_grpo_trainer(tmp_path):
    """environment_factory on prompts with images: each environment's reset observation is appended to its
    prompt's last message as a text part (TRL's rule for list content), the prompt rendered again by the processor
    with its image, and its pixels encoded again for generate and the forward; its calculator method is the tool.
    One step equals TRL's GRPOTrainer with the same environment class (assert_tools_with_images_equal_trl)."""
    (tmp_path / "calculator_env.py").write_text(ENVIRONMENT)
    run, _ = assert_tools_with_images_equal_trl(MODEL, tmp_path, environment=tmp_path / "calculator_env.py")
    text = AutoProcessor.from_pretrained(MODEL).tokenizer.decode(rollouts(run)[0]["prompt_ids"])
    assert text.count("<image>") == 16 and "What is 50 + 44? Use the calculator.<|im_end|>" in text


def assert_tools_with_images_equal_trl(base, tmp_path, environment=None) -> tuple:
    """Multi-turn tool calling on prompts with images (`base` with a tool-calling template): the turns are
    written by tests/e2e/launchers/scripted_tools.py's policy (a random model writes no calls) while the run's generate
    still runs on every turn's context with the prompt's pixels; one step of 8 completions equals TRL 1.16's
    GRPOTrainer with the same tool on the same rows, its generation replaced by the rollouts' sampled turns, looked up
    by the context TRL itself built (its processor's rendering of the prompt with the tools' schemas and the image's
    16 tokens, then the turns and its own tool suffixes: so those must equal hftrain's token for token); the rest is
    TRL's: its calculator calls, tool masks, pixels, advantages, loss and update (the projector trained, so the pixels
    reach the gradient). Returns the run and its arguments (the last: the batch size)."""
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    from hftrain.rl.example_tools import calculator

    folder = tool_calling_vlm(base, tmp_path / "model")
    image = str(DATA.parent / "images" / "red-square.png")
    # two prompts of one length: TRL 1.16 left-pads the prompt ids of its forward but takes their per-token fields
    # (Qwen-VL's mm_token_type_ids) from its processor call with padding=True, right-padded by this tokenizer, so for
    # prompts of different lengths its rotary positions are shifted by the padding (hftrain's follow each row's own)
    questions = [("What is 50 + 44?", 94), ("What is 23 + 51?", 74)]
    prompts = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
                "images": [image], "answer": a} for q, a in questions]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    tool = ["--tools", "hftrain.rl.example_tools.calculator"] if environment is None else [
        "--environment_factory", f"{environment}:Calculator"]
    args = [*BASE, "--model_name_or_path", str(folder), "--dataset_name", str(data),
            "--reward_funcs", "hftrain.rl.example_rewards.final_answer", *tool, "--max_tool_calling_iterations", "2",
            "--max_completion_length", "128", "--max_steps", "1", "--beta", "0", "--seed", "32",
            "--per_device_train_batch_size", "8"]
    run = run_script(tmp_path / "run", *args, script=SCRIPTED)
    turns = [line for line in run.stdout.splitlines() if line.startswith("scripted turn:")]
    assert len(turns) >= 2 and all(not line.endswith(" 0 images") for line in turns), turns  # pixels every turn
    rows = rollouts(run)
    assert len(rows) == 8 and all(r["images"] == [image] for r in rows)
    assert len({len(r["prompt_ids"]) for r in rows}) == 1
    assert any(c["kept"] and not c["failed"] for r in rows for c in r["tool_calls"])  # a call ran, then a turn
    assert all(AutoProcessor.from_pretrained(folder).image_token_id in r["prompt_ids"] for r in rows)

    taken: dict = {}

    def replayed(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """Each context's next sampled turn: the k-th rollout (in order) that continues it with sampled tokens."""
        assert images and multimodal_fields.get("pixel_values") is not None  # TRL generates with the pixels too
        out = []
        for ids in prompt_ids:
            context = list(ids.tolist() if hasattr(ids, "tolist") else ids)
            follows = [r for r in rows if len(context) >= len(r["prompt_ids"])
                       and (r["prompt_ids"] + r["completion_ids"])[:len(context)] == context
                       and len(context) - len(r["prompt_ids"]) < len(r["completion_ids"])]
            k = taken.get(tuple(context), 0)
            assert k < len(follows), "TRL built a context that no rollout holds"
            taken[tuple(context)] = k + 1
            r, start = follows[k], len(context) - len(follows[k]["prompt_ids"])
            end = next((j for j in range(start, len(r["tool_mask"])) if r["tool_mask"][j] == 0), len(r["tool_mask"]))
            out.append(r["completion_ids"][start:end])
        return out, None

    rewards = {(r["group"], tuple(r["completion_ids"])): r["reward"] for r in rows}

    def recorded(prompts, completions, completion_ids, group, **kwargs):
        return [rewards[(g, tuple(ids))] for g, ids in zip(group, completion_ids)]

    dataset = datasets.Dataset.from_list([{"prompt": p["prompt"], "images": [image], "group": g}
                                          for g, p in enumerate(prompts)])
    dataset = dataset.cast_column("images", datasets.Sequence(datasets.Image()))
    config = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, per_device_train_batch_size=8,
                        num_generations=4, max_completion_length=128, beta=0.0, loss_type="dapo", optim="sgd",
                        learning_rate=1.0, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
                        max_steps=1, logging_steps=1, save_strategy="no", report_to=[], seed=32,
                        shuffle_dataset=False, disable_tqdm=True, max_tool_calling_iterations=2)
    if environment is None:
        tooling = {"tools": [calculator]}
    else:  # the same class, imported from the file hftrain read it from
        spec = importlib.util.spec_from_file_location("calculator_env", environment)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        tooling = {"environment_factory": module.Calculator}
    trainer = GRPOTrainer(model=starting_model(folder), reward_funcs=[recorded], args=config, train_dataset=dataset,
                          processing_class=AutoProcessor.from_pretrained(folder), **tooling)
    tokenize = trainer._tokenize_prompts

    def as_tensors(prompts):
        """TRL 1.16's tool loop splits the prompts' pixel_values (and image_grid_thw) by image
        (`split_pixel_values_by_grid`), which needs tensors, while its tokenization leaves the processor's lists of
        arrays (its single-turn generate converts them with torch.tensor(np.array(...))): converted here the same
        way, before the loop; the per-token fields stay lists, as TRL pads them."""
        ids, images, fields = tokenize(prompts)
        return ids, images, {k: v if isinstance(v, torch.Tensor) or k in ("token_type_ids", "mm_token_type_ids")
                             else torch.tensor(np.array(v)) for k, v in fields.items()}

    trainer._tokenize_prompts = as_tensors
    trainer._generate_single_turn = replayed
    trainer.train()
    assert sum(taken.values()) > 8  # the continuations after tool results were looked up too
    logged, mine = trainer.state.log_history[0], run.train_rows()[0]
    for key in ("reward", "tools/call_frequency", "tools/failure_frequency"):
        assert logged[key] == pytest.approx(mine[key], rel=1e-5), key
    assert logged["grad_norm"] == pytest.approx(mine["grad_norm"], rel=1e-4)
    final = AutoModelForImageTextToText.from_pretrained(run.output_dir / "final", dtype=torch.float32).state_dict()
    assert_weights(final, trainer.model, rtol=1e-4, atol=2e-6)
    return run, args
