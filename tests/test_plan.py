"""The placement plan (tasks/cluster/plan.py) and `rstar2 plan`: where actors land, the memory
arithmetic on hand-checked numbers, the resource descriptions, and each refusal's one line. No Ray.

Run: .venv/bin/python -m pytest tests/test_plan.py -q
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flows.cli import main
from tasks.cluster.plan import (
    GIB,
    Node,
    PlanError,
    build_plan,
    count_parameters,
    format_plan,
    model_shape,
    parse_resources,
    resources_from_ray_nodes,
    trainer_memory,
)
from tasks.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
PAPER_CLUSTER = "8x8x192+2x0:cpus=128,cpu_node=4"  # the paper's GPUs plus CPU nodes for the sandbox

# Qwen3-14B's config.json fields (huggingface.co/Qwen/Qwen3-14B).
QWEN3_14B = {
    "hidden_size": 5120,
    "num_hidden_layers": 40,
    "intermediate_size": 17408,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}


def plan(spec: str, config: str = "tiny.yaml", **overrides):
    """The plan of a shipped config with dotted-key overrides on the cluster `spec`."""
    return build_plan(load_config(CONFIGS / config, overrides), parse_resources(spec))


def refusal(spec: str, config: str = "tiny.yaml", **overrides) -> str:
    with pytest.raises(PlanError) as exc:
        plan(spec, config, **overrides)
    assert "\n" not in str(exc.value)
    return str(exc.value)


def gpu(**fields) -> dict:
    """Overrides for a bf16 model of exactly 2**30 parameters (not readable: parameters_b), so
    every number below is a round count of GiB."""
    return {"model.path": "/nonexistent", "model.parameters_b": GIB / 1e9, "model.dtype": "bfloat16", **fields}


def split(ranks=4, engines=2, tp=2, **fields) -> dict:
    return gpu(**{
        "cluster.placement": "split",
        "trainer.ranks": ranks, "trainer.cpus": 1, "trainer.gpus": 1,
        "engines.count": engines, "engines.cpus": 1, "engines.gpus": tp,
        "engines.tensor_parallel_size": tp,
        **fields,
    })  # fmt: skip


# ---------------------------------------------------------------- resources


def test_a_spec_describes_nodes_gpus_memory_cpus_and_custom_resources():
    nodes = parse_resources("8x8x80").nodes
    assert len(nodes) == 8 and nodes[0] == Node(cpus=64, gpus=8, gpu_memory_gib=80)
    nodes = parse_resources("1x8x80:cpus=96 + 2x0:cpus=128,cpu_node=4").nodes
    assert nodes[0] == Node(96, 8, 80) and nodes[1] == nodes[2] == Node(128, 0, None, {"cpu_node": 4})
    assert parse_resources("2x4").nodes[0].gpu_memory_gib is None  # unknown: not checked


@pytest.mark.parametrize("spec", ["8x8x", "eight", "0x8x80", "1x8x80x3", "1x8x80:cpus"])
def test_a_bad_spec_is_one_line_naming_the_flag(spec):
    with pytest.raises(PlanError, match=r"^--resources: cannot read"):
        parse_resources(spec)


def test_ray_nodes_keep_live_nodes_and_custom_resources_only():
    nodes = [
        {"Alive": True, "NodeID": "a", "Resources": {"CPU": 64.0, "GPU": 8.0, "memory": 1e12,
                                                     "object_store_memory": 1e11, "node:10.0.0.1": 1.0}},
        {"Alive": False, "NodeID": "b", "Resources": {"CPU": 64.0, "GPU": 8.0}},
        {"Alive": True, "NodeID": "c", "Resources": {"CPU": 128.0, "cpu_node": 4.0}},
    ]  # fmt: skip
    resources = resources_from_ray_nodes(nodes, gpu_memory_gib=80)
    assert resources.nodes == (Node(64, 8, 80), Node(128, 0, None, {"cpu_node": 4}))
    assert resources_from_ray_nodes(nodes).gpu_memory_gib is None  # Ray does not know it
    with pytest.raises(PlanError, match="^cluster.address: "):
        resources_from_ray_nodes(nodes[1:2])


# ---------------------------------------------------------------- sizes and memory


def test_parameters_counted_from_a_config_json(tmp_path):
    # Hand-counted: embeddings and head 151936*5120*2 = 1,555,824,640; a layer's attention
    # 5120*128*(2*40 + 2*8) = 62,914,560, MLP 3*5120*17408 = 267,386,880, norms 10,240; 40 layers
    # and a final norm of 5120.
    assert count_parameters(QWEN3_14B) == 1_555_824_640 + 40 * 330_311_680 + 5120  # 14.77B: "14.8B"
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_14B))
    cfg = load_config(CONFIGS / "tiny.yaml", {"model.path": str(tmp_path), "model.parameters_b": 1.0})
    shape = model_shape(cfg)
    assert (shape.params, shape.heads) == (count_parameters(QWEN3_14B), 40)  # config.json wins


def test_the_tiny_model_is_counted_from_its_fields():
    shape = model_shape(load_config(CONFIGS / "tiny.yaml"))
    assert 2e6 < shape.params < 3e6 and shape.heads == 3


def test_mixed_precision_adam_partitioned_by_zero_stage():
    assert trainer_memory(GIB, "bfloat16", 0, 4) == {"weights": 2, "grads": 2, "optimizer": 12}
    assert trainer_memory(GIB, "bfloat16", 1, 4) == {"weights": 2, "grads": 2, "optimizer": 3}
    assert trainer_memory(GIB, "bfloat16", 2, 4) == {"weights": 2, "grads": 0.5, "optimizer": 3}
    assert trainer_memory(GIB, "bfloat16", 3, 4) == {"weights": 0.5, "grads": 0.5, "optimizer": 3}
    assert trainer_memory(GIB, "float32", 0, 1) == {"weights": 4, "grads": 4, "optimizer": 8}


def test_split_plan_memory_per_gpu_by_hand():
    p = plan("1x8x80", **split(**{"trainer.zero_stage": 2, "engines.kv_cache_gib": 10}))
    # A rank: 2 GiB bf16 weights, 2/4 gradients, 12/4 optimizer. An engine's GPU: 2/2 + 10 KV.
    assert p.loads == {
        "trainer": {"weights": 2, "grads": 0.5, "optimizer": 3},
        "engine": {"engine weights": 1, "kv cache": 10},
    }
    assert [(a.role, a.index, a.node, a.gpu_ids) for a in p.actors if a.role != "sandbox"] == [
        ("trainer", 0, 0, (0,)), ("trainer", 1, 0, (1,)), ("trainer", 2, 0, (2,)), ("trainer", 3, 0, (3,)),
        ("engine", 0, 0, (4, 5)), ("engine", 1, 0, (6, 7)),
    ]  # fmt: skip
    text = format_plan(p)
    assert "trainer 0-3" in text and "engine 0-1" in text and "5.50" in text and "11.00" in text


# ---------------------------------------------------------------- placement


def test_colocated_packs_ranks_in_node_order_each_engine_on_its_ranks_gpu():
    p = plan("2x8x80", **gpu(**{
        "trainer.ranks": 16, "trainer.cpus": 2, "trainer.gpus": 1,
        "engines.count": 16, "engines.cpus": 2, "engines.gpus": 1,
    }))  # fmt: skip
    trainers = [a for a in p.actors if a.role == "trainer"]
    engines = [a for a in p.actors if a.role == "engine"]
    assert [(a.node, a.gpu_ids) for a in trainers] == [(i // 8, (i % 8,)) for i in range(16)]
    assert [(a.node, a.gpu_ids, a.gpus) for a in engines] == [(a.node, a.gpu_ids, 0.5) for a in trainers]
    assert list(p.loads) == ["trainer+engine"]


def test_sandbox_replicas_spread_over_the_nodes_that_offer_their_resources():
    p = plan("1x8x80+3x0:cpus=32,cpu_node=2", **gpu(**{
        "trainer.ranks": 8, "trainer.cpus": 4, "trainer.gpus": 1,
        "engines.count": 8, "engines.cpus": 4, "engines.gpus": 1,
        "sandbox.replicas": 5, "sandbox.cpus": 8, "sandbox.resources": {"cpu_node": 1},
    }))  # fmt: skip
    assert [a.node for a in p.actors if a.role == "sandbox"] == [1, 2, 3, 1, 2]


def test_a_tensor_parallel_group_never_spans_nodes():
    # 12 GPUs in all, but each 6-GPU node holds one 4-GPU engine only.
    message = refusal("2x6x80", **split(ranks=1, engines=3, tp=4, **{"trainer.gpus": 0}))
    assert message.startswith("engines.count: actor 2 finds no node with") and "4 GPU" in message


def test_cpu_only_plans_place_by_fractional_cpus():
    p = plan("1x0:cpus=2")
    assert [(a.role, a.node, a.cpus, a.gpus) for a in p.actors] == [
        ("trainer", 0, 1, 0), ("engine", 0, 0.5, 0), ("sandbox", 0, 0.5, 0),
    ]  # fmt: skip
    assert p.loads == {} and "memory per GPU not estimated" in format_plan(p)


# ---------------------------------------------------------------- refusals, one line each


def test_too_few_gpus_names_the_rank_count():
    message = refusal("8x1x80", **gpu(**{
        "trainer.ranks": 64, "trainer.gpus": 1, "engines.count": 64, "engines.gpus": 1,
    }))  # fmt: skip
    assert message.startswith("trainer.ranks: 64 ranks x 1 GPU need 64 GPUs, the cluster has 8 (8 nodes x 1")


def test_too_few_cpus_names_the_role_that_does_not_fit():
    assert refusal("1x0:cpus=1").startswith("engines.cpus: 1 engines x 0.5 CPU need 0.5 CPUs beside the 1")


def test_custom_resources_must_be_offered_and_enough():
    sandbox = {"sandbox.replicas": 3, "sandbox.cpus": 1, "sandbox.resources": {"cpu_node": 1}}
    assert refusal("1x0:cpus=8", **sandbox).startswith("sandbox.resources: asks for cpu_node, which no node")
    assert refusal("1x0:cpus=8,cpu_node=2", **sandbox).startswith("sandbox.replicas: 3 replicas x 1 cpu_node")


def test_tensor_parallel_must_divide_the_attention_heads():
    assert refusal("1x0:cpus=2", **{"engines.tensor_parallel_size": 2}).startswith(
        "engines.tensor_parallel_size: 2 does not divide the model's 3 attention heads"
    )


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"engines.count": 4}, "engines.count"),  # colocated: one engine per rank
        ({"engines.tensor_parallel_size": 2}, "engines.tensor_parallel_size"),  # colocated: TP 1
        ({"trainer.gpus": 2}, "trainer.gpus"),
        ({"sandbox.gpus": 1}, "sandbox.gpus"),
    ],
)
def test_colocated_pairs_one_rank_and_one_engine_per_gpu(fields, field):
    base = {"trainer.ranks": 8, "trainer.gpus": 1, "engines.count": 8, "engines.gpus": 1}
    assert refusal("1x8x80", **gpu(**(base | fields))).startswith(field + ": ")


def test_split_engines_hold_their_tensor_parallel_gpus():
    message = refusal("1x8x80", **split(**{"engines.gpus": 1}))
    assert message.startswith("engines.gpus: an engine holds engines.tensor_parallel_size = 2 GPUs")


def test_over_memory_names_the_biggest_lever():
    paper = refusal("8x8x80+2x0:cpus=128,cpu_node=4", "qwen3-14b-paper.yaml")
    assert paper.startswith("engines.kv_cache_gib: a trainer+engine GPU needs ~95.0 GiB")
    assert paper.endswith("at most 49.0 GiB of KV cache fits")
    # 40 GiB of bf16 weights unsharded (ZeRO-0) is 320 GiB a rank; ZeRO-3 is the lever.
    big = split(ranks=4, **{"model.parameters_b": 20 * GIB / 1e9, "trainer.zero_stage": 0})
    assert refusal("1x8x80", **big).startswith("trainer.zero_stage: a trainer GPU needs ~320.0 GiB")


def test_an_unreadable_model_without_parameters_b_is_refused():
    message = refusal("1x8x80", **gpu(**{"model.parameters_b": None}))
    assert message.startswith("model.parameters_b: /nonexistent/config.json is not readable")


# ---------------------------------------------------------------- the shipped configs and the CLI


@pytest.mark.parametrize(
    "config, spec",
    [("tiny.yaml", "1x0:cpus=2"), ("qwen3-4b-8gpu.yaml", "1x8x80"), ("qwen3-14b-paper.yaml", PAPER_CLUSTER)],
)
def test_shipped_configs_fit_their_clusters(config, spec, capsys):
    main(["plan", "--config", str(CONFIGS / config), "--resources", spec])
    out = capsys.readouterr().out
    assert out.startswith("plan  ") and "trainer 0" in out and "sandbox 0" in out


def test_cli_refusal_is_one_line_on_stderr_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--config", str(CONFIGS / "qwen3-14b-paper.yaml"), "--resources", "8x8x80"])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    # Memory is checked before placement: the first thing to change is the KV cache, not CPU nodes.
    assert captured.err.startswith("engines.kv_cache_gib: a trainer+engine GPU needs ~95.0 GiB")


def test_cli_plans_this_machine_without_starting_ray_or_torch(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code = (
        "import sys; from flows.cli import main; "
        "main(['plan', '--set', 'cluster.num_cpus=2']); print(sorted({'ray', 'torch', 'prefect'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "this machine" in out and out.strip().endswith("[]")
