"""The placement plan (tasks/cluster/plan.py) and `rstar2 plan`: where actors land, the memory
arithmetic on hand-checked numbers, the resource descriptions, and each refusal's one line; and
how the runtime tells a SIGTERM that surfaced through Ray's calls from a fault. No Ray cluster.

Run: .venv/bin/python -m pytest tests/test_plan.py -q
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flows.cli import main
from tasks.cluster.memory import (
    GIB,
    ModelShape,
    activation_memory,
    count_parameters,
    layer_elements,
    model_shape,
    trainer_memory,
    trainer_peak,
)
from tasks.cluster.plan import Node, PlanError, build_plan, format_plan, parse_resources, resources_from_ray_nodes
from tasks.cluster.throughput import update_seconds
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


# A bf16 model of 2**30 parameters and 28,672 more (norms): its model states are round counts of
# GiB to 4 digits. Embeddings 2 x 32768 x 4096 = 2**28; a layer's attention 4096 x 128 x 128 = 2**26,
# its MLP 3 x 4096 x 16384 = 3 x 2**26.
ROUND = {"hidden_size": 4096, "num_hidden_layers": 3, "num_attention_heads": 32, "num_key_value_heads": 32,
         "head_dim": 128, "intermediate_size": 16384, "vocab_size": 32768}  # fmt: skip
SHORT = {"rl.optim.micro_batch_size": 1, "sft.optim.micro_batch_size": 1}  # 1024-token micro-batches


def gpu(**fields) -> dict:
    """Overrides for the ROUND model, not readable (model.shape), short micro-batches."""
    return {"model.path": "/nonexistent", "model.shape": ROUND, "model.dtype": "bfloat16", **SHORT, **fields}


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
    cfg = load_config(CONFIGS / "tiny.yaml", {"model.path": str(tmp_path), "model.shape": ROUND})
    shape = model_shape(cfg)
    assert (shape.params, shape.heads) == (count_parameters(QWEN3_14B), 40)  # config.json wins


def test_the_tiny_model_is_counted_from_its_fields():
    shape = model_shape(load_config(CONFIGS / "tiny.yaml"))
    assert 2e6 < shape.params < 3e6 and shape.heads == 3


def test_mixed_precision_adam_partitioned_by_zero_stage():
    # 16-bit weights 2, gradients 2 + their fp32 copy 4, optimizer 12 (master weights, m, v).
    assert trainer_memory(GIB, "bfloat16", 0, 4) == {"weights": 2, "grads": 6, "optimizer": 12}
    assert trainer_memory(GIB, "bfloat16", 1, 4) == {"weights": 2, "grads": 3, "optimizer": 3}
    assert trainer_memory(GIB, "bfloat16", 2, 4) == {"weights": 2, "grads": 1.5, "optimizer": 3}
    assert trainer_memory(GIB, "bfloat16", 3, 4) == {"weights": 0.5, "grads": 1.5, "optimizer": 3}
    assert trainer_memory(GIB, "float32", 0, 1) == {"weights": 4, "grads": 4, "optimizer": 8}
    assert trainer_memory(GIB, "float32", 2, 1) == {"weights": 4, "grads": 4, "optimizer": 12}


@pytest.mark.parametrize("ranks", [8, 64])
def test_model_states_agree_with_deepspeeds_own_estimators(ranks):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    shape = ModelShape(QWEN3_14B, "test")
    nodes = {"num_gpus_per_node": 8, "num_nodes": ranks // 8, "cpu_offload": False}
    _, zero2 = estimate_zero2_model_states_mem_needs(shape.params, **nodes)
    # DeepSpeed truncates to whole bytes (<= 2 B of ~1e10: 2e-10); float64 adds a few u
    assert sum(trainer_memory(shape.params, "bfloat16", 2, ranks).values()) == pytest.approx(zero2 / GIB, rel=1e-6)
    _, zero3, largest = estimate_zero3_model_states_mem_needs(shape.params, shape.largest_layer, **nodes)
    assert largest == 4 * shape.largest_layer  # the embedding, 151936 x 5120, gathered in 16 bits with its gradient
    ours = sum(trainer_memory(shape.params, "bfloat16", 3, ranks).values()) + largest / GIB
    # DeepSpeed's ZeRO-3 count leaves out the rank's share of the 16-bit weights (2 bytes each); whole bytes again.
    assert ours == pytest.approx(zero3 / GIB + 2 * shape.params / ranks / GIB, rel=1e-6)


def test_activations_by_hand_and_with_gradient_checkpointing():
    tiny = ModelShape({"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                       "head_dim": 4, "intermediate_size": 16, "vocab_size": 10}, "test")  # fmt: skip
    # Per token and layer: 4 x 8 norms + 9 x 8 queries + 6 x 4 keys and values + 4 x 16 MLP = 192.
    assert layer_elements(tiny) == 192
    full = activation_memory(tiny, 1000, "float32", checkpointing=False, device="cpu")
    assert full["activations"] * GIB == pytest.approx(1.25 * 192 * 4 * 1000 * 2)
    assert full["logits"] * GIB == pytest.approx(4.4 * 4 * 10 * 1000)  # fp32 log-softmax copies
    kept = activation_memory(tiny, 1000, "float32", checkpointing=True, device="cpu")
    # Each layer's 6 kept hidden-wide tensors, and one layer's whole activations while recomputed.
    assert kept["activations"] * GIB == pytest.approx(2 * 6 * 8 * 4 * 1000 + 1.25 * 192 * 4 * 1000)
    bf16 = activation_memory(tiny, 1000, "bfloat16", checkpointing=False, device="cpu")
    assert bf16["activations"] == pytest.approx(full["activations"] / 2) and bf16["logits"] > full["logits"]
    # On a GPU: 0.85 of the count, one kept width per checkpointed layer, 16 bytes per logit element;
    # in chunks, the logits of one chunk's positions.
    gpu = activation_memory(tiny, 1000, "bfloat16", checkpointing=True, chunk_tokens=64)
    assert gpu["activations"] * GIB == pytest.approx(2 * 1 * 8 * 2 * 1000 + 0.85 * 192 * 2 * 1000)
    assert gpu["logits"] * GIB == pytest.approx(16 * 10 * 64)


# Peaks of real RL steps on one H200 (torch 2.11+cu130, DeepSpeed 0.19.8, bf16, ZeRO-2 on one rank,
# three steps each in a fresh process; torch.cuda.max_memory_allocated over what was allocated
# before the trainer): random Qwen3-shaped models, 151,936-token vocabulary, untied embeddings.
QWEN3_06B = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936}  # fmt: skip
QWEN3_17B = QWEN3_06B | {"hidden_size": 2048, "intermediate_size": 6144}
H200_PEAKS = [  # shape, micro-batch tokens, gradient checkpointing, measured GiB
    (QWEN3_06B, 8192, False, 43.8),
    (QWEN3_06B, 8192, True, 28.9),
    (QWEN3_06B, 2 * 8192, True, 48.0),
    (QWEN3_17B, 16384, True, 65.7),
    (QWEN3_17B, 8192, False, 69.3),
    (QWEN3_06B, 256, False, 15.6),  # model states alone
    (QWEN3_17B, 256, False, 41.8),
    (QWEN3_06B | {"num_hidden_layers": 2}, 16384, False, 44.0),  # logits alone
    (QWEN3_06B | {"num_hidden_layers": 2}, 32768, False, 83.4),
]


@pytest.mark.parametrize("hf, tokens, checkpointing, measured", H200_PEAKS)
def test_the_gpu_plan_is_within_15_percent_of_measured_h200_peaks(hf, tokens, checkpointing, measured):
    peak = trainer_peak(ModelShape(hf, "test"), "bfloat16", 2, 1, tokens, checkpointing)
    assert 0.85 <= sum(peak.values()) / measured <= 1.15, peak
    # The step binds where the update holds little; logits of 4096 positions at a time bind less.
    assert ("step buffers" in peak) == (tokens == 256)
    chunked = trainer_peak(ModelShape(hf, "test"), "bfloat16", 2, 1, tokens, checkpointing, chunk_tokens=4096)
    assert chunked.get("logits", 0) <= peak.get("logits", 0) * 4096 / tokens + 1e-9


def test_split_plan_memory_per_gpu_by_hand():
    p = plan("1x8x80", **split(**{"trainer.zero_stage": 2, "engines.kv_cache_gib": 10}))
    # A rank: 2 GiB bf16 weights, 2/4 gradients, 12/4 optimizer; then its optimizer step's 4/4 fp32
    # gradients and 2/4 buffers, which hold more than the activations and logits of its 1024-token
    # micro-batch. An engine's GPU: 2/2 weights + 10 KV + its pass.
    trainer, engine = p.loads["trainer"], p.loads["engine"]
    assert {k: round(v, 3) for k, v in trainer.items() if k in ("weights", "grads", "optimizer")} == {
        "weights": 2, "grads": 0.5, "optimizer": 3,
    }  # fmt: skip
    assert (round(trainer["fp32 grads"], 3), round(trainer["step buffers"], 3)) == (1, 0.5)
    assert "activations" not in trainer
    update = activation_memory(ModelShape(ROUND, ""), 1024, "bfloat16", False)
    assert sum(update.values()) < 1.5
    assert round(engine["engine weights"], 3) == 1 and engine["kv cache"] == 10 and "engine activations" in engine
    assert [(a.role, a.index, a.node, a.gpu_ids) for a in p.actors if a.role != "sandbox"] == [
        ("trainer", 0, 0, (0,)), ("trainer", 1, 0, (1,)), ("trainer", 2, 0, (2,)), ("trainer", 3, 0, (3,)),
        ("engine", 0, 0, (4, 5)), ("engine", 1, 0, (6, 7)),
    ]  # fmt: skip
    text = format_plan(p)
    assert "trainer 0-3" in text and "engine 0-1" in text and "activations" in text and "1024 tokens" in text


def test_an_engine_is_held_to_the_share_of_its_gpu_vllm_may_take():
    # TP-2 engines of a 14.8B model: 13.8 GiB of weights each + 64 KV fill 77.8 of 80 GiB, beyond
    # the 68 that gpu_memory_utilization 0.85 leaves vLLM.
    fields = split(ranks=8, **{"model.shape": QWEN3_14B, "engines.kv_cache_gib": 64, "trainer.zero_stage": 3})
    message = refusal("2x8x80", **fields)
    assert (
        message.startswith("engines.kv_cache_gib: an engine needs ~") and "over the 68.0 GiB vLLM may take" in message
    )


def test_activations_and_logits_that_do_not_fit_name_their_lever():
    long = gpu(**{"rl.optim.micro_batch_size": 128, "trainer.ranks": 8, "trainer.gpus": 1, "trainer.zero_stage": 3,
                  "engines.count": 8, "engines.gpus": 1, "engines.kv_cache_gib": 1})  # fmt: skip
    message = refusal("1x8x80", **long)
    assert message.startswith("trainer.logit_chunk_tokens: a trainer+engine GPU needs ~")
    assert "logits" in message and message.endswith("GiB")
    chunked = {**long, "trainer.logit_chunk_tokens": 4096}
    assert refusal("1x8x80", **chunked).startswith("trainer.gradient_checkpointing: a trainer+engine GPU needs ~")
    plan("1x8x80", **chunked, **{"trainer.gradient_checkpointing": True})  # fits with both


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
    fields = {"engines.kv_cache_gib": 30}  # within the engine's share of an 80 GiB GPU, not beside the trainer
    paper = refusal("8x8x80+2x0:cpus=128,cpu_node=4", "qwen3-14b-paper.yaml", **fields)
    assert paper.startswith("engines.kv_cache_gib: a trainer+engine GPU needs ~")
    # 20 GiB of bf16 parameters unsharded (ZeRO-0) is 400 GiB of states a rank; ZeRO-3 is the lever.
    big = split(ranks=4, **{"model.shape": {**ROUND, "num_hidden_layers": 79}, "trainer.zero_stage": 0})
    assert refusal("1x8x80", **big).startswith("trainer.zero_stage: a trainer GPU needs ~4")


def test_an_unreadable_model_without_its_shape_is_refused():
    message = refusal("1x8x80", **gpu(**{"model.shape": None}))
    assert message.startswith("model.shape: /nonexistent/config.json is not readable")


# ---------------------------------------------------------------- the shipped configs and the CLI


@pytest.mark.parametrize(
    "config, spec",
    [("tiny.yaml", "1x0:cpus=2"), ("qwen3-4b-8gpu.yaml", "1x8x80"), ("qwen3-14b-paper.yaml", PAPER_CLUSTER)],
)
def test_shipped_configs_fit_their_clusters(config, spec, capsys):
    main(["plan", "--config", str(CONFIGS / config), "--resources", spec, "--gpu-class", "h200"])
    out = capsys.readouterr().out
    assert out.startswith("plan  ") and "trainer 0" in out and "sandbox 0" in out
    assert ("update time per RL step: at most" in out) == (config != "tiny.yaml")  # GPUs only


def test_update_time_by_hand_from_the_measured_rate():
    cfg = load_config(CONFIGS / "qwen3-4b-8gpu.yaml")
    # The longest stage: 128 problems x G kept rollouts of 8192 response tokens + the 1312-token
    # prompt that 13312 - 12000 (evaluation's budget) leaves; 8N FLOPs a token with checkpointing.
    tokens = 128 * cfg.rl.group_size * (8192 + 1312)
    params = model_shape(cfg).params
    seconds, counted, rate = update_seconds(cfg, params, "h200")
    assert counted == tokens and rate.tflops == 263
    assert seconds == pytest.approx(tokens * 8 * params / (8 * 263e12))
    unmeasured = build_plan(cfg, parse_resources("1x8x80"), gpu_class="mi300x")
    assert any(note.startswith("update time per RL step: give --gpu-class") for note in unmeasured.notes)


def test_cli_refusal_is_one_line_on_stderr_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--config", str(CONFIGS / "qwen3-14b-paper.yaml"), "--resources", "8x8x80"])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    # Memory is checked before placement: the first thing to change is the KV cache, not CPU nodes.
    assert captured.err.startswith("engines.kv_cache_gib: an engine needs ~94.9 GiB, over the 68.0 GiB vLLM may take")


def test_cli_plans_this_machine_without_starting_ray_or_torch(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code = (
        "import sys; from flows.cli import main; "
        "main(['plan', '--set', 'cluster.num_cpus=2']); print(sorted({'ray', 'torch', 'prefect'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "this machine" in out and out.strip().endswith("[]")


def test_an_interrupt_is_found_behind_the_system_error_that_ray_s_compiled_code_raises_for_it():
    """A signal handler's exception inside a compiled call comes out as a SystemError caused by it
    (CPython's "returned a result with an exception set"): the runtime re-raises the interrupt, so
    a SIGTERM is not retried as a fault. A plain fault stands for none."""
    import signal

    from prefect.exceptions import TerminationSignal

    from tasks.cluster.connect import _sigterm_handler_kept, interrupt_behind

    def compiled_call():
        try:
            raise TerminationSignal(signal.SIGTERM)
        except TerminationSignal as exc:
            raise SystemError("<cyfunction CoreWorker.wait> returned a result with an exception set") from exc

    with pytest.raises(SystemError) as raised:
        compiled_call()
    assert isinstance(interrupt_behind(raised.value), TerminationSignal)
    assert interrupt_behind(KeyError("fault")) is None and interrupt_behind(RuntimeError("x")) is None
    ours = signal.getsignal(signal.SIGTERM)
    with _sigterm_handler_kept():
        signal.signal(signal.SIGTERM, lambda *_: None)  # what ray.init does
    assert signal.getsignal(signal.SIGTERM) is ours
