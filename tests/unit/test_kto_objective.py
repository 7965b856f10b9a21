"""objective kto against plain PyTorch: the KL reference point over the step's mismatched rows, the loss, its
gradient and TRL's statistics, whatever the split into micro-batches; the plan's pairing across ranks; the
collator's KL rows; precomputed reference log-probs (every pair the run draws, equal to the live reference, kept
on resume); TRL's balance warning; the recipe and data rules."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import datasets
import pytest
import torch
from safetensors.torch import save_file

from hftrain.config import Recipe, recipe_from_dict
from hftrain.data import IGNORE_INDEX
from hftrain.data.formats import detect_format, to_canonical
from hftrain.errors import HftrainError
from hftrain.objectives.kto import KTOCollator, KTOLoss, KTOPlan, balance_warning, kl_partners, precompute_kto_reference
from hftrain.objectives.reference import (
    AdapterReference,
    FrozenReference,
    PrecomputedReference,
    ReferenceLogProbs,
    summed_log_probs,
)
from hftrain.paths import REFERENCE_FILE
from tests.unit.test_objectives import VOCAB, plain_log_probs, tiny_llama

DESIRABLE = [True, False, True, True, False, False]


def rows_dataset() -> datasets.Dataset:
    """6 rows: prompts of 3-5 tokens, completions of 2-4 tokens, labels DESIRABLE."""
    gen = torch.Generator().manual_seed(5)
    ids, labels, starts = [], [], []
    for k in range(len(DESIRABLE)):
        prompt, completion = 3 + k % 3, 2 + (k * 2) % 3
        row = torch.randint(0, VOCAB, (prompt + completion,), generator=gen).tolist()
        ids.append(row)
        labels.append([IGNORE_INDEX] * prompt + row[prompt:])
        starts.append(prompt)
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": labels, "desirable": DESIRABLE,
                                       "prompt_length": starts})


def padded(rows: list[tuple[list[int], int]]) -> dict[str, torch.Tensor]:
    """Right-padded rows whose tokens from `start` on are trained."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    for r, (ids, start) in enumerate(rows):
        input_ids[r, :len(ids)] = torch.tensor(ids)
        labels[r, start:len(ids)] = torch.tensor(ids[start:])
    return {"input_ids": input_ids, "labels": labels}


def plain_kto(policy, reference, data, beta: float, loss_type: str, w_d: float, w_u: float) -> dict:
    """KTOTrainer's loss on the 6 rows as one micro-batch, written out: row k's KL row is its prompt followed by
    row k-1's completion (row 0 takes row 5's)."""
    ids, starts = data["input_ids"], data["prompt_length"]
    rows = padded([(ids[k], starts[k]) for k in range(6)])
    kl_rows = padded([(ids[k][:starts[k]] + ids[k - 1][starts[k - 1]:], starts[k]) for k in range(6)])
    logps = plain_log_probs(policy, rows)[0]
    with torch.no_grad():
        ref = plain_log_probs(reference, rows)[0]
        kl = (plain_log_probs(policy, kl_rows)[0] - plain_log_probs(reference, kl_rows)[0]).mean().clamp(min=0)
    ratio = logps - ref
    good = torch.tensor(DESIRABLE)
    if loss_type == "kto":
        losses = torch.where(good, w_d * (1 - torch.sigmoid(beta * (ratio - kl))),
                             w_u * (1 - torch.sigmoid(beta * (kl - ratio))))
    else:
        losses = torch.where(good, w_d * (1 - torch.sigmoid(beta * ratio)), w_u * torch.sigmoid(beta * ratio))
    rewards = beta * ratio.detach()
    return {"loss": losses.mean(), "kl": kl if loss_type == "kto" else torch.zeros(()),
            "rewards/chosen": rewards[good].mean(), "rewards/rejected": rewards[~good].mean(),
            "rewards/margins": rewards[good].mean() - rewards[~good].mean(),
            "logps/chosen": logps.detach()[good].mean(), "logps/rejected": logps.detach()[~good].mean()}


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_loss_gradient_and_statistics_equal_the_formula_over_micro_batches(loss_type):
    """The 6 rows as micro-batches of 1, 2 and 3 rows (one step: `prepare_step` sees them all) give the loss,
    gradient, kl and TRL-named statistics of the formula applied to the 6 rows at once; evaluation over the whole
    set (its own reference point) gives the same eval metrics."""
    beta, w_d, w_u = 0.5, 1.0, 1.3
    recipe = Recipe(objective="kto", loss_type=loss_type, beta=beta, desirable_weight=w_d, undesirable_weight=w_u)
    policy, reference = tiny_llama(0), tiny_llama(1)
    data = rows_dataset()
    expected = plain_kto(policy, reference, data, beta, loss_type, w_d, w_u)
    expected["loss"].backward()
    grads = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad()
    module = KTOLoss(policy, recipe, FrozenReference(ReferenceLogProbs(reference, False), torch.device("cpu")))
    collator = KTOCollator(data, 0, 64)
    plan = KTOPlan(6, 1, 1, 6, 0, shuffle=False)  # the step's 6 rows, each with its partner over the step
    items = list(plan.micro_batches(0, 0))
    batches = [{k: v for k, v in collator(group).items() if k != "num_examples"}
               for group in (items[0], items[1] + items[2], items[3] + items[4] + items[5])]
    module.train()
    module.prepare_step(module, batches, lambda t: t)
    loss = sum(module(**b) for b in batches) / 6
    loss.backward()
    torch.testing.assert_close(loss, expected["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(module.kl, expected["kl"].float(), rtol=1e-5, atol=1e-6)
    assert loss_type == "apo_zero_unpaired" or float(expected["kl"]) > 0  # the reference point is active
    for a, p in zip(grads, policy.parameters()):
        torch.testing.assert_close(p.grad, a, rtol=1e-4, atol=1e-6)
    stats = module.pop_stats()
    for name in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        torch.testing.assert_close(stats[name].float() / 6, expected[name].float(), rtol=1e-5, atol=1e-6, msg=name)
    module.eval()  # evaluation: plain rows, rotated over the whole set as the 6 rows are here
    eval_batch = {k: v for k, v in collator(list(range(6))).items() if k != "num_examples"}
    if loss_type == "kto":
        module.set_kl(module.kl_sums(module, [eval_batch], lambda t: t))
    with torch.no_grad():
        loss_sum = module(**eval_batch)
    metrics = module.eval_metrics(float(loss_sum), 6, {k: float(v) for k, v in module.pop_stats().items()})
    assert metrics["eval_loss"] == pytest.approx(float(expected["loss"].detach()), rel=1e-5)
    for name in ("kl", "rewards/margins", "logps/rejected"):
        assert metrics[f"eval_{name}"] == pytest.approx(float(expected[name]), rel=1e-5, abs=1e-7), name


def test_the_plan_pairs_each_row_with_its_predecessor_in_the_step_across_ranks_and_micro_batches():
    """2 ranks x 2 micro-batches x 2 rows: every (row, partner) of the step is TRL's pairing of the step's rows in
    the one-piece order, so the KL rows are those of one process with the whole step in one micro-batch."""
    split = KTOPlan(16, 2, 2, 2, 7, shuffle=True)
    whole = KTOPlan(16, 8, 1, 1, 7, shuffle=True)
    for step in range(2):
        pieces = [pair for rank in (0, 1) for pair in
                  [p for batch in list(split.micro_batches(0, rank))[2 * step:2 * step + 2] for p in batch]]
        (one,) = list(whole.micro_batches(0, 0))[step:step + 1]
        assert sorted(pieces) == sorted(one)
        rows = [row for row, _ in one]
        assert [partner for _, partner in one] == rows[-1:] + rows[:-1] == kl_partners(rows)


def test_the_collator_builds_each_kl_row_from_its_prompt_and_the_partners_completion():
    data = rows_dataset()
    batch = KTOCollator(data, 0, 7)([(2, 5), (0, 1)])
    for r, (row, partner) in enumerate([(2, 5), (0, 1)]):
        start, other = data[row]["prompt_length"], data[partner]["prompt_length"]
        ids = (data[row]["input_ids"][:start] + data[partner]["input_ids"][other:])[:7]  # cut to max_length
        assert batch["kl_input_ids"][r, :len(ids)].tolist() == ids
        assert batch["kl_labels"][r].tolist() == [IGNORE_INDEX] * start + ids[start:] + [IGNORE_INDEX] * (
            batch["kl_labels"].shape[1] - len(ids))
    assert batch["desirable"].tolist() == [DESIRABLE[2], DESIRABLE[0]]


def test_balance_warning_follows_trls_recommended_range():
    """TRL's rule (the KTO paper's Eq. 8): 300 desirable and 100 undesirable at weights 1, 1 are outside both
    ranges, desirable_weight [0.33, 0.44] or undesirable_weight [2.26, 3.0]; either weight inside silences it."""
    said = balance_warning(Recipe(objective="kto"), 300, 100)
    assert "desirable_weight in [0.33, 0.44] OR undesirable_weight in [2.26, 3.0]" in said
    assert balance_warning(Recipe(objective="kto", desirable_weight=0.4), 300, 100) is None
    assert balance_warning(Recipe(objective="kto", undesirable_weight=2.5), 300, 100) is None
    assert balance_warning(Recipe(objective="kto"), 200, 200) is None


def test_unpaired_data_is_detected_for_kto_only_and_its_label_must_be_a_bool():
    columns = ["prompt", "completion", "label"]
    assert detect_format(columns, "auto", "text", "messages", "d", "kto") == "unpaired"
    assert detect_format(columns, "auto", "text", "messages", "d", "sft") == "prompt_completion"
    with pytest.raises(HftrainError, match="label must be true .* or false .*, got 'yes'"):
        to_canonical({"prompt": "a", "completion": "b", "label": "yes"}, "unpaired", "text", "messages", "row 3")


def test_kto_recipe_rules():
    recipe = recipe_from_dict({"objective": "kto"}, for_training=False)
    assert recipe.loss_type == "kto"  # KTOConfig's default
    with pytest.raises(HftrainError) as err:
        recipe_from_dict({"objective": "kto", "loss_type": "sigmoid", "desirable_weight": 0,
                          "precompute_ref_log_probs": True, "packing": True}, for_training=False)
    said = " ".join(str(err.value).split())
    for part in ("loss_type=sigmoid is not a kto loss", "desirable_weight must be > 0",
                 "packing with objective=kto is refused"):
        assert part in said, part
    assert "precompute_ref_log_probs" not in said  # kto precomputes (below)
    with pytest.raises(HftrainError, match="loss_type=kto is a kto loss, but objective=dpo"):
        recipe_from_dict({"objective": "dpo", "loss_type": "kto"}, for_training=False)


def test_preference_pairs_are_unpaired_as_trls_unpair_preference_dataset():
    """kto on preference pairs: the rows TRL's KTOTrainer trains on (`trl.data_utils.unpair_preference_dataset`:
    per map batch, the chosen completions labelled true, then the rejected ones labelled false)."""
    from trl.data_utils import unpair_preference_dataset

    from hftrain.data.tokenize import unpair
    from tests.conftest import REPO

    raw = datasets.load_dataset("json", data_files=str(REPO / "data" / "preference.jsonl"), split="train")
    raw = raw.select(range(6))
    ours, theirs = unpair(raw, "pairs"), unpair_preference_dataset(raw)
    assert ours.to_list() == theirs.to_list() and sum(ours["label"]) == 6 and len(ours) == 12


def test_run_pairs_are_every_pair_the_runs_steps_draw_whatever_the_layout():
    """7 steps of 4 rows over 10 shuffled rows (3 steps per epoch, so 3 epochs, the last cut after one step): the
    pairs of every rank's micro-batches of every step the loop runs, for 2 ranks x 1 or 1 rank x 2 micro-batches."""
    for world, accum in ((2, 1), (1, 2)):
        plan = KTOPlan(10, 2, world, accum, 3, shuffle=True)
        drawn = set()
        for step in range(7):
            epoch, at = divmod(step, plan.steps_per_epoch)
            for rank in range(world):
                for batch in list(plan.micro_batches(epoch, rank))[at * accum:(at + 1) * accum]:
                    drawn.update(batch)
        assert plan.run_pairs(7) == sorted(drawn)
        assert len(drawn) > 10  # the epochs' shuffles pair rows differently
    assert KTOPlan(10, 2, 2, 1, 3, shuffle=True).run_pairs(7) == KTOPlan(10, 4, 1, 1, 3, shuffle=True).run_pairs(7)


def precompute_run(recipe: Recipe, module: KTOLoss, data, plan: KTOPlan, total_steps: int, resume_from=None):
    """What `precompute_kto_reference` reads of a run: one process, its training and eval sets (the same rows)."""
    device = torch.device("cpu")
    return SimpleNamespace(
        recipe=recipe, token_loss=module, model=module, parts=SimpleNamespace(loss=module),
        data=SimpleNamespace(train_set=data, collator=KTOCollator(data, 0, 64), eval_set=data,
                             eval_collator=KTOCollator(data, 0, 64), plan=plan, total_steps=total_steps),
        resume_from=resume_from, dp=SimpleNamespace(world=1, rank=0, sum=lambda t: t),
        backend=SimpleNamespace(release=lambda model: None),  # one process: nothing gathered
        accelerator=SimpleNamespace(device=device, num_processes=1, is_main_process=True,
                                    reduce=lambda t, reduction: t))


@pytest.mark.parametrize("method", ["full", "lora"])
def test_precomputed_reference_equals_the_live_one(method, tmp_path, monkeypatch):
    """precompute_ref_log_probs: every row's and every drawn mismatched row's reference log-prob is plain PyTorch's
    on the starting model (under LoRA: the base with the adapters disabled, here non-zero from the start), and 2
    steps of 6 rows in 3 micro-batches with them give the losses, kl, statistics and weights of the live reference
    (a frozen copy / the adapters disabled); another run reads them from the cross-run cache, a resume from its
    checkpoint, and a resume drawing other pairs is refused."""
    monkeypatch.setattr("hftrain.objectives.reference.REFERENCE_CACHE", tmp_path / "cache")
    data = rows_dataset()
    plan = KTOPlan(6, 2, 1, 3, 11, shuffle=True)  # one step per epoch, each epoch its own order
    recipe = Recipe(objective="kto", loss_type="kto", beta=0.5, undesirable_weight=1.3,
                    model_name_or_path=str(tmp_path), per_device_eval_batch_size=4)
    if method == "full":
        live_lm = tiny_llama(1)
        live = KTOLoss(live_lm, recipe, FrozenReference(ReferenceLogProbs(copy.deepcopy(live_lm), False),
                                                        torch.device("cpu")))
        start = copy.deepcopy(live_lm)
        plain_reference = lambda batch: plain_log_probs(start, batch)[0]  # noqa: E731
    else:
        from peft import LoraConfig, get_peft_model

        live_lm = get_peft_model(tiny_llama(1), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                           init_lora_weights=False))
        live = KTOLoss(live_lm, recipe, AdapterReference(live_lm, summed_log_probs(False)))
        start = copy.deepcopy(live_lm)

        def plain_reference(batch):
            with start.disable_adapter():
                return plain_log_probs(start, batch)[0]
    pre_lm = copy.deepcopy(live_lm)
    pre_recipe = Recipe(**{**recipe.__dict__, "precompute_ref_log_probs": True})
    pre = KTOLoss(pre_lm, pre_recipe, PrecomputedReference())
    run = precompute_run(pre_recipe, pre, data, plan, 2)
    values = precompute_kto_reference(run)
    ids, starts = data["input_ids"], data["prompt_length"]
    with torch.no_grad():
        rows = plain_reference(padded([(ids[k], starts[k]) for k in range(6)]))
        pairs = [tuple(pair) for pair in values["train_kl_pairs"].tolist()]
        assert pairs == plan.run_pairs(2) and len(pairs) > 6
        kl_rows = plain_reference(padded([(ids[r][:starts[r]] + ids[p][starts[p]:], starts[r]) for r, p in pairs]))
        eval_kl = plain_reference(padded([(ids[k][:starts[k]] + ids[k - 1][starts[k - 1]:], starts[k])
                                          for k in range(6)]))
    for name, expected in (("train", rows), ("eval", rows), ("train_kl", kl_rows), ("eval_kl", eval_kl)):
        torch.testing.assert_close(values[name], expected, rtol=1e-5, atol=1e-5, msg=name)
    assert f"of 12 rows and {len(pairs) + 6} mismatched (KL) rows (one pass" in pre.reference.describe()
    cached = precompute_run(pre_recipe, KTOLoss(pre_lm, pre_recipe, PrecomputedReference()), data, plan, 2)
    assert all(torch.equal(v, values[k]) for k, v in precompute_kto_reference(cached).items())
    assert "read from the cache" in cached.token_loss.reference.describe()  # another run on the same data and model

    kls = []
    optimizers = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=8.0) for m in (live, pre)]
    for epoch in range(2):
        results = []
        for module, collator, optimizer in ((live, KTOCollator(data, 0, 64), optimizers[0]),
                                            (pre, run.data.collator, optimizers[1])):
            batches = [{k: v for k, v in collator(items).items() if k != "num_examples"}
                       for items in plan.micro_batches(epoch, 0)]
            assert ("ref_logps" in batches[0]) == (module is pre)
            module.train()
            module.prepare_step(module, batches, lambda t: t)
            loss = sum(module(**b) for b in batches) / 6
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            results.append((loss.detach(), module.kl.clone(), module.pop_stats()))
        (live_loss, live_kl, live_stats), (pre_loss, pre_kl, pre_stats) = results
        torch.testing.assert_close(pre_loss, live_loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pre_kl, live_kl, rtol=1e-5, atol=1e-6)
        for name, value in live_stats.items():
            torch.testing.assert_close(pre_stats[name], value, rtol=1e-5, atol=1e-6, msg=name)
        kls.append(float(live_kl))
    assert max(kls) > 0  # the reference point was active
    for a, b in zip(live.parameters(), pre.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)

    checkpoint = tmp_path / "checkpoint-1"  # what every checkpoint saves: the values, read back on resume
    checkpoint.mkdir()
    save_file(values, str(checkpoint / REFERENCE_FILE))
    resumed = precompute_run(pre_recipe, KTOLoss(pre_lm, pre_recipe, PrecomputedReference()), data, plan, 2,
                             checkpoint)
    again = precompute_kto_reference(resumed)
    assert f"saved in {checkpoint}" in resumed.token_loss.reference.describe()
    assert all(torch.equal(again[k], v) for k, v in values.items())
    longer = precompute_run(pre_recipe, KTOLoss(pre_lm, pre_recipe, PrecomputedReference()), data, plan, 3,
                            checkpoint)  # a third epoch draws pairs the saved run never computed
    with pytest.raises(HftrainError, match=r"no reference log-probs for \d+ of the \d+ mismatched \(KL\) rows "
                                           "this run's train steps draw"):
        precompute_kto_reference(longer)
