"""The Trainer integration against the real transformers.Trainer on a tiny, locally built model."""

from __future__ import annotations

import pytest
import torch

from _checks import assert_same_tree, assert_tensor_identical

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def test_export_hf_callback_writes_loadable_weights_on_each_save(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from ckptkit.training.hf_trainer import ExportHFCallback

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16)
    model = LlamaForCausalLM(config)
    data = [{"input_ids": torch.randint(0, 64, (8,)), "labels": torch.randint(0, 64, (8,))} for _ in range(8)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, save_steps=1, per_device_train_batch_size=4,
                             report_to=[], use_cpu=True, logging_strategy="no", save_strategy="steps")
    Trainer(model=model, args=args, train_dataset=data, callbacks=[ExportHFCallback()]).train()

    for step in (1, 2):
        assert (tmp_path / f"checkpoint-{step}" / "hf" / "model.safetensors").is_file()
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "checkpoint-2" / "hf")
    assert_same_tree(loaded.state_dict(), model.state_dict())
    tokens = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        assert_tensor_identical(loaded(tokens).logits, model(tokens).logits, "logits")
