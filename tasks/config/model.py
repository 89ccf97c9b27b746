"""The `model:` section of a run config: a real model directory, or the tiny model the run
builds and pre-trains from scratch (the embedded default)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tasks.config.roles import _Strict


class PretrainLayouts(_Strict):
    """Shares of the documents after the copy drills, by layout (tasks/data/pretrain.py). A real
    base model has seen a program in prose, inside function calls and in chat transcripts; one
    that saw a single layout writes the program only there."""

    plain: float = Field(1.0, ge=0.0)  # `question\nprogram`, RL kinds
    tool_call: float = Field(0.0, ge=0.0)  # `question\n<tool_call>{... program ...}</tool_call>`, RL kinds
    # the question as a user turn, the call as the assistant's (no system prompt, output or answer), RL kinds
    user_turn: float = Field(0.0, ge=0.0)
    chat: float = Field(0.0, ge=0.0)  # whole rollout-format transcripts of tool tasks, never RL kinds
    # the user turn, a first call of an RL problem's program without the guard its numbers need, the
    # error, and the guarded call: the code repair a real base model has read (no output or answer)
    fix: float = Field(0.0, ge=0.0)

    @model_validator(mode="after")
    def _some_layout(self) -> PretrainLayouts:
        if self.plain + self.tool_call + self.user_turn + self.chat + self.fix <= 0:
            raise ValueError("at least one layout needs a share above 0")
        return self


class TinyModelConfig(_Strict):
    """A Qwen-family causal LM trained from scratch when no real model path is given."""

    # qwen3: the paper's base family (norms on queries and keys); qwen2: biases on q, k, v instead
    architecture: Literal["qwen2", "qwen3"] = "qwen3"
    vocab_size: int = Field(2048, ge=1)
    hidden_size: int = Field(256, ge=1)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    intermediate_size: int = Field(512, ge=1)
    max_position_embeddings: int = Field(2048, ge=1)
    # Language-model pre-training (generated from seeds disjoint from the curated splits): a
    # real base model arrives able to copy numbers, read them and write Python; the tiny one
    # learns it here, first on copy drills until the copy mechanism has formed (greedy copies of
    # fresh drills exact `pretrain_copy_until` of the time, checked every 25 steps; at most
    # `pretrain_copy_steps`), then `pretrain_steps` on problem statements and their programs.
    pretrain_copy_steps: int = Field(0, ge=0)
    pretrain_copy_until: float = Field(0.9, gt=0.0, le=1.0)
    pretrain_steps: int = Field(0, ge=0)
    pretrain_layouts: PretrainLayouts = PretrainLayouts()
    # The share of documents whose program omits the guard its larger inputs need (the digit
    # limit's lift, tasks/data/problems.py): the first program a real base model often writes.
    pretrain_unguarded_share: float = Field(0.0, ge=0.0, le=1.0)
    pretrain_batch_size: int = Field(32, ge=1)
    pretrain_seq_len: int = Field(256, ge=2)
    pretrain_lr: float = Field(3e-4, gt=0)


class ModelShapeConfig(_Strict):
    """A decoder's shapes under their Hugging Face config.json names (Llama/Qwen style)."""

    hidden_size: int = Field(ge=1)
    num_hidden_layers: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int | None = Field(None, ge=1)  # None: as many as attention heads
    head_dim: int | None = Field(None, ge=1)  # None: hidden_size / num_attention_heads
    intermediate_size: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    tie_word_embeddings: bool = False


class ModelConfig(_Strict):
    path: str | None = None  # a Hugging Face model directory; None builds the tiny model
    tiny: TinyModelConfig = TinyModelConfig()
    dtype: Literal["float32", "bfloat16"] = "float32"
    # The model's config.json fields, for `rstar2 plan` where model.path is not readable (planning
    # away from the cluster): its memory needs the shapes, not only a parameter count. The model's
    # config.json wins where it is readable.
    shape: ModelShapeConfig | None = None
