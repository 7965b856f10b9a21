"""hftrain.estimate under tensor parallelism inside pipeline stages, and its 3D layout recommendation.

The per-rank counts are compared with what transformers really places on each tp rank (tests/launchers/
tp_placement.py: the real tp plan on a fake process group, after a real backward and AdamW step) summed over the
parameters that hftrain's own stage split keeps on each pipeline rank (`split_layers`, `keep_only` on a meta-device
copy of the model); the 70B layout against Llama-3-70B's published sizes written out here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from hftrain.estimate import (
    GIB,
    format_layouts,
    main,
    model_shape,
    pipeline_memory,
    search_layouts,
    usable_bytes,
)
from hftrain.parallel.pipeline import keep_only
from hftrain.stages import split_layers, stage_indices
from hftrain.versions import available, feature_problem
from tests.conftest import REPO

# transformers' own tensor-parallel load as hftrain runs it (refused by the preflight on an older transformers)
NEEDS_TP = pytest.mark.skipif(not available("tensor_parallel"), reason=str(feature_problem("tensor_parallel")))

TINY = REPO / "models" / "tiny-llama"  # hidden 64, 2 layers, 4 heads (4 key/value heads), intermediate 128, vocab 753
LLAMA_70B = REPO / "models" / "llama-3-70b-shape"  # config.json only


@pytest.fixture(scope="module")
def placed(tmp_path_factory) -> dict[str, tuple[str, list[dict[str, list[int]]]]]:
    """For the tiny Llama, a tied twin (SmolLM2-style: lm_head is embed_tokens, 2 key/value heads), a tiny Qwen3 (its
    plan keeps q_norm / k_norm whole: replicated_with_grad_allreduce) and the tiny Qwen3-MoE (3D expert weights,
    gate_up_proj packed_colwise): (its folder, per tp rank of tp 2 {name: [weight, gradient, AdamW state elements]}
    as transformers places them)."""
    tied, qwen3 = tmp_path_factory.mktemp("tied-llama"), tmp_path_factory.mktemp("qwen3")
    LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=128, vocab_size=753,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
                     ).save_pretrained(tied)
    Qwen3ForCausalLM(Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, vocab_size=753, tie_word_embeddings=False)
                     ).save_pretrained(qwen3)
    folders = {"untied": str(TINY), "tied": str(tied), "qwen3": str(qwen3), "moe": str(REPO / "models" / "tiny-moe")}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "launchers" / "tp_placement.py"), "2",
                           *folders.values()], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("[")]
    out = {kind: (folder, [p for f, _, p in sorted(lines, key=lambda x: x[1]) if f == folder])
           for kind, folder in folders.items()}
    assert [len(ranks) for _, ranks in out.values()] == [2] * len(folders), proc.stdout[-2000:]
    return out


def stage_names(folder: str, pp: int, rank: int) -> set[str]:
    """The parameter names hftrain's pipeline keeps on pipeline rank `rank` of `pp` (its own split functions)."""
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    ranges = split_layers(len(lm.model.layers), pp)
    mine = stage_indices(rank, pp, 1)
    keep_only(lm, {i for s in mine for i in ranges[s]}, first=0 in mine, last=pp - 1 in mine)
    return {name for name, _ in lm.named_parameters()}  # a tied pair once: its head on a last stage without it


@NEEDS_TP
@pytest.mark.parametrize("kind, pp", [("untied", 1), ("untied", 2), ("tied", 1), ("tied", 2), ("qwen3", 1),
                                      ("moe", 1)])
def test_tp_stage_bytes_equal_what_transformers_places_on_each_rank(placed, kind, pp):
    """pp x tp 2 (and tp 2 alone): each pipeline rank's weights (fp32 + autocast's bf16 copy), gradients and AdamW
    moments, for the fullest tp rank, equal the elements really held: the vocabulary split 377 / 376 between the tp
    ranks, the embedding's gradient whole, norms replicated. A tied pair is one shard; its gradient (the embedding's
    whole one plus the head's shard) is a shard when one process holds both (pp 1), and the first stage of a
    pipeline, holding the embedding alone, gets the whole one as in the untied model (not reproduced here: this
    backward runs the whole model). Qwen3's and Qwen3-MoE's plans: every style they use is placed as transformers
    places it (the estimate refuses a plan with a style it does not model)."""
    folder, ranks = placed[kind]
    shape = model_shape(folder)
    assert shape.tp_unmodelled == ()
    if kind == "untied":
        assert ranks[0]["model.embed_tokens.weight"] == [377 * 64, 753 * 64, 2 * 377 * 64]  # the gradient is whole
        assert ranks[1]["lm_head.weight"] == [376 * 64, 376 * 64, 2 * 376 * 64]
    elif kind == "tied":
        assert ranks[0]["model.embed_tokens.weight"] == ranks[0]["lm_head.weight"] == [377 * 64] * 2 + [2 * 377 * 64]
    stages = pipeline_memory(shape, pp, "1F1B", 4 if pp > 1 else 1, 8, 128, "bf16", tp=2)
    assert [st.rank for st in stages] == list(range(pp))
    for st in stages:
        names = stage_names(folder, pp, st.rank)
        weights, grads, moments = (max(sum(rank[n][k] for n in names) for rank in ranks) for k in range(3))
        assert (st.params, st.weights, st.optimizer) == (weights, 6 * weights, 4 * moments)
        if not (kind == "tied" and pp > 1 and st.rank == 0):
            assert st.grads == 4 * grads
    # activations of one tp rank by hand: norms whole (2 x (input and output fp32, bf16 matmul input)), q/k/v/o
    # and the four MLP tensors halved; 2 rows x 128 tokens per microbatch
    tokens, h, i = 2 * 128, 64, 128
    layer = tokens * (2 * (2 * h * 4 + h * 2) + 4 * (h // 2) * 2 + 4 * (i // 2) * 2)
    loss = tokens * (h * (2 * 4 + 2) + 12 * 753)  # final norm and the gathered (whole) logits' buffers
    if kind == "untied" and pp == 2:  # 1F1B: rank 0 holds 2 microbatches of its layer, rank 1 one and the loss
        assert [st.activations for st in stages] == [2 * layer, layer + loss]


@pytest.fixture(scope="module")
def llama_70b():
    return model_shape(str(LLAMA_70B))


@NEEDS_TP
def test_the_70b_layout_on_4_nodes_of_8_gpus_fits_and_keeps_tp_in_a_node(llama_70b):
    s = llama_70b
    assert (s.layers, s.hidden, s.heads, s.kv_heads, s.vocab) == (80, 8192, 64, 8, 128256)
    fitting, every = search_layouts(s, 4, 8, 80, 128, 1, 2048)
    best = fitting[0]
    assert best.tp <= 8 and 8 % best.tp == 0 and s.kv_heads % best.tp == 0
    assert best.dp * best.tp * best.pp == 32 and best.microbatches * best.dp == 128
    assert best.peak() <= usable_bytes(80)
    assert max(st.peak() for st in pipeline_memory(s, best.pp, best.schedule or "1F1B", best.microbatches,
                                                   best.microbatches, 2048, "bf16", best.tp, best.checkpointing)) \
        <= usable_bytes(80)
    # what the tp 8 x pp 4 stages hold, from Llama-3-70B's sizes: per layer q and o 8192 x 8192, k and v 8192 x 1024,
    # three MLP matrices 8192 x 28672, all split 8 ways, and two norms of 8192 whole; the embedding and the head
    # 128256 x 8192 split 8 ways on the vocabulary; stages of 19 / 21 / 21 / 19 layers (82 units with the embedding
    # and the head, split 20 / 21 / 21 / 20)
    layer = (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672) // 8 + 2 * 8192
    vocab = 128256 * 8192 // 8
    stages = pipeline_memory(s, 4, "1F1B", 128, 128, 2048, "bf16", 8)
    assert [st.params for st in stages] == [19 * layer + vocab, 21 * layer, 21 * layer, 19 * layer + vocab + 8192]
    assert stages[0].grads == 4 * (19 * layer + 8 * vocab)  # the embedding's gradient is whole
    # the search covers tensor parallel alone, pipeline alone and both
    assert {(x.tp, x.pp) for x in every} >= {(8, 4), (4, 8), (8, 1), (1, 32)}


def test_a_cluster_too_small_says_none_fits(llama_70b):
    lines = format_layouts(llama_70b, 1, 2, 24, 128, 1, 2048, "bf16")
    none = [line for line in lines if line.startswith("none fits: ")]
    assert len(none) == 1 and "of the 20.7 GiB usable on a 24 GiB GPU" in none[0], lines
    assert lines[-1].startswith("not modelled: ")


def test_cli_prints_the_3d_recommendation_with_its_preset_and_recipe(capsys):
    """2 nodes x 2 GPUs: the recommended layout uses all 4 GPUs with tp inside a node, and its recipe fields say the
    same; the tiny model fits DDP, which the section names first (the seeds' order)."""
    main(["--model", str(TINY), "--nodes", "2", "--gpus_per_node", "2", "--gpu_memory_gib", "1.5", "--seq", "128",
          "--global_batch", "8"])
    section = capsys.readouterr().out.split("\n3D layouts ")[1]
    rec = dict(kv.split("=") for kv in section.split("\nrecommendation: ")[1].splitlines()[0].split()
               if "=" in kv)
    fields = dict(f.split(": ") for f in section.split("\nrecipe: ")[1].splitlines()[0].split(", "))
    assert int(rec["dp"]) * int(rec["tp"]) * int(rec["pp"]) == 4 and int(rec["tp"]) <= 2
    assert fields["tp_size"] == rec["tp"] and fields.get("pp_size", "1") == rec["pp"] and fields["max_length"] == "128"
    assert "preset: accelerate_configs/multi_node_3d.yaml with num_machines: 2, num_processes: 4" in section
    assert "\nreason: fits in " in section and f" of {usable_bytes(1.5) / GIB:.1f} GiB usable" in section
    assert "\nnote: DDP (the table's recommendation) fits without tensor or pipeline parallelism" in section
    assert section.rstrip().splitlines()[-1].startswith("not modelled: ")


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "6", "--pp", "2", "--tp", "3"], "--tp 3 must divide the attention heads (4) and the key/value heads"),
    (["--gpus", "3", "--pp", "3"], "--pp 3 with 1F1B needs 3 stages of at least one layer each, and"),
    (["--nodes", "2", "--gpus_per_node", "2", "--tp", "4"], "--tp 4 must divide --gpus_per_node 2"),
    (["--nodes", "2"], "--nodes and --gpus_per_node go together"),
    (["--gpus", "4", "--pp", "2", "--tp", "4"], "--pp 2 x --tp 4 must divide --gpus 4"),
])
def test_bad_layout_flags_are_one_paragraph(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(TINY), *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in " ".join(err.split()), err
    assert "Traceback" not in err and "\n\n" not in err.strip()
