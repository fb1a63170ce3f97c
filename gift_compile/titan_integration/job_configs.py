"""torchtitan config registry for gift-titan (``--module gift_compile.titan_integration.job_configs``).

Each public function returns a trainer Config; ``[launch] config = "<name>"`` picks one and the
TOML sections / ``--section.field`` flags override its fields.

- ``llama3_debug``: Llama-3 debug model (6.2M parameters, 6 blocks, vocab 2,048) on
  graph_trainer (SimpleFSDP, joint-graph trace, ``gift`` pass pipeline), SDPA attention, the
  bundled corpus and tokenizer. Runs on CPU/gloo and on GPUs.
- ``llama3_debug_standard``: the same model on torchtitan's standard trainer (FSDP2
  ``fully_shard`` per block, torchtitan's own Llama-3 definition with SDPA attention); GIFT
  reduce-scatters each block's gradients (``gift_compile.fsdp``). Per-block compile is off
  here (``[compile] enable = true`` turns it on).
- ``llama3_8b``: Llama-3.1 8B on graph_trainer (FlexAttention, C4, the model's HF tokenizer).
- ``llama3_8b_standard``: the same on the standard trainer (FSDP2, per-block compile).
"""

from __future__ import annotations

import dataclasses
from dataclasses import fields

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.validate import Validator
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.experiments.graph_trainer import llama3 as graph_llama3
from torchtitan.experiments.graph_trainer.configs import GraphTrainerCompileConfig, to_graph_trainer_config
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.trainer import Trainer

from gift_compile.titan_integration.cpu_support import cpu_disabled_graph_passes
from gift_compile.titan_integration.datasets import default_tokenizer_dir, register_datasets
from gift_compile.titan_integration.graph_pass import PIPELINE_NAME
from gift_compile.titan_integration.trainer import GiftGraphTrainer, GiftTrainer

register_datasets()


def _with_gift(config_cls, base):
    return config_cls(**{f.name: getattr(base, f.name) for f in fields(base)})


def _standard_debug_spec():
    """torchtitan's standard Llama-3 debug model (its own parallelize: fully_shard per block) with
    SDPA attention: its registry offers FlexAttention only, whose backward does not run on CPU."""
    from torchtitan.experiments.graph_trainer.common_utils import build_decoder_config_for_backend
    from torchtitan.models import llama3

    spec = llama3.model_registry("debugmodel", attn_backend="flex")
    return dataclasses.replace(spec, model=build_decoder_config_for_backend(llama3.llama3_configs["debugmodel"], "sdpa"))


def _debug_base(spec=None) -> Trainer.Config:
    spec = spec or graph_llama3.model_registry("debugmodel", attn_backend="sdpa")
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path=str(default_tokenizer_dir()),
        dump_folder="./outputs/gift_titan",
        loss=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec)),
        optimizer=default_adamw(lr=8e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0),
        training=TrainingConfig(local_batch_size=2, seq_len=256, steps=20, mixed_precision_param="float32"),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="tinyshakespeare"),
        metrics=MetricsProcessor.Config(log_freq=1),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        checkpoint=CheckpointManager.Config(enable=False, interval=10, last_save_model_only=False),
        activation_checkpoint=None,
        compile=CompileConfig(enable=False),
        validator=Validator.Config(
            enable=False, freq=100, steps=10,
            dataloader=HuggingFaceTextDataLoader.Config(dataset="text_lines_valid", infinite=False),
        ),
    )


def _graph(base: Trainer.Config) -> GiftGraphTrainer.Config:
    config = to_graph_trainer_config(base, graph_llama3.model_registry)
    config.compile = GraphTrainerCompileConfig(
        enable=True, mode="aot_fx_trace", pass_pipeline=PIPELINE_NAME, disable_passes=cpu_disabled_graph_passes()
    )
    return _with_gift(GiftGraphTrainer.Config, config)


def llama3_debug() -> GiftGraphTrainer.Config:
    """Llama-3 debug model on graph_trainer with the ``gift`` pass pipeline (CPU or GPU)."""
    return _graph(_debug_base())


def llama3_debug_standard() -> GiftTrainer.Config:
    """The same job on torchtitan's standard trainer (FSDP2 fully_shard per block)."""
    return _with_gift(GiftTrainer.Config, _debug_base(_standard_debug_spec()))


def _8b_base(spec) -> Trainer.Config:
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path="./assets/hf/Llama-3.1-8B",
        dump_folder="./outputs/llama3_8b_gift",
        loss=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec)),
        optimizer=default_adamw(lr=3e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=200),
        training=TrainingConfig(local_batch_size=1, seq_len=8192, steps=1000, mixed_precision_param="bfloat16"),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4"),
        metrics=MetricsProcessor.Config(log_freq=10, enable_tensorboard=True),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        checkpoint=CheckpointManager.Config(enable=True, interval=500, last_save_model_only=False),
        activation_checkpoint=None,
        compile=CompileConfig(enable=False),
        validator=Validator.Config(enable=False, freq=500, steps=1200),
    )


def llama3_8b() -> GiftGraphTrainer.Config:
    """Llama-3.1 8B pretraining on graph_trainer; tokenizer from ``hf_assets_path`` (download it first)."""
    return _graph(_8b_base(graph_llama3.model_registry("8B")))


def llama3_8b_standard() -> GiftTrainer.Config:
    """Llama-3.1 8B on torchtitan's standard trainer (FSDP2 fully_shard per block, per-block
    compile, FlexAttention): GIFT reduce-scatters each block's gradients."""
    from torchtitan.models import llama3

    base = _8b_base(llama3.model_registry("8B"))
    base.compile = CompileConfig(enable=True)
    return _with_gift(GiftTrainer.Config, base)


CONFIGS = ("llama3_debug", "llama3_debug_standard", "llama3_8b", "llama3_8b_standard")

__all__ = list(CONFIGS)
