"""The demo VLM training script's pieces: the shipped side it writes (the
folder tessera.models.demo_vlm assembles: a sigmoid projector onto the slot tokens' embeddings, float16)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from testkit.demo_vlm import TEXT_HIDDEN
from tools import demo_vlm_slots as slots
from tools import train_demo_vlm as train
from tools.demo_vlm_encoder import SlotEncoder, export_projector


def test_the_shipped_side_is_the_tower_the_exported_projector_and_the_lora(tmp_path):
    torch.manual_seed(0)
    vision = dict(image_size=128, patch_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4)  # fmt: skip
    encoder = SlotEncoder.from_config(vision).eval()
    embeddings = torch.randn(len(slots.VOCAB), TEXT_HIDDEN)
    lora = {"language_model.model.layers.0.self_attn.q_proj.lora_A": torch.randn(4, TEXT_HIDDEN),
            "language_model.model.layers.0.self_attn.q_proj.lora_B": torch.randn(TEXT_HIDDEN, 4)}  # fmt: skip
    train.save_shipped(encoder, embeddings, lora, tmp_path, sharpen=3.0)

    settings = json.loads((tmp_path / "vision_config.json").read_text())
    assert settings["projector_hidden_act"] == "sigmoid" and settings["vision_feature_select_strategy"] == "default"
    assert {k: settings["vision_config"][k] for k in vision} == vision
    tensors = load_file(tmp_path / "vision.safetensors")
    assert all(t.dtype == torch.float16 for t in tensors.values())
    tower = {k.removeprefix("vision_tower."): v for k, v in tensors.items() if k.startswith("vision_tower.")}
    expected = {k: v for k, v in encoder.tower.state_dict().items() if not k.endswith("position_ids")}
    assert tower.keys() == expected.keys()
    assert all(torch.equal(tower[k], v.half()) for k, v in expected.items())
    projector = export_projector(encoder.classifier, embeddings, 3.0)
    assert all(torch.equal(tensors[f"multi_modal_projector.{k}"], v.half()) for k, v in projector.items())
    shipped_lora = load_file(tmp_path / "lora.safetensors")
    assert all(torch.equal(shipped_lora[k], v.half()) for k, v in lora.items())


def test_each_stage_records_its_settings_device_and_minutes(tmp_path):
    import argparse
    import time

    args = argparse.Namespace(work=tmp_path, device="cpu", reader_steps=7, init_lora=tmp_path / "a.safetensors")
    train.record_stage(args, "reader-continued", time.perf_counter() - 90)
    (record,) = json.loads((tmp_path / "reader-continued.json").read_text())
    assert record["reader_steps"] == 7 and record["init_lora"] == str(tmp_path / "a.safetensors")
    assert record["device"] == f"CPU, {torch.get_num_threads()} threads" and record["minutes"] == pytest.approx(1.5)


def test_a_fresh_reader_makes_an_earlier_continued_phase_stale(tmp_path):
    import argparse
    import time

    (tmp_path / "notes.json").write_text("{}")  # not a stage: never collected
    args = argparse.Namespace(work=tmp_path, device="cpu", init_lora=None)
    for stage in ("reader", "reader-continued", "encoder", "encoder-continued"):
        train.record_stage(args, stage, time.perf_counter())
    assert list(train.stage_records(tmp_path)) == ["encoder", "encoder-continued", "reader", "reader-continued"]

    train.record_stage(args, "reader", time.perf_counter())  # a new reader run in the reused folder
    assert list(train.stage_records(tmp_path)) == ["encoder", "encoder-continued", "reader"]
    train.record_stage(args, "encoder", time.perf_counter())
    assert list(train.stage_records(tmp_path)) == ["encoder", "reader"]


def test_each_continued_phase_keeps_its_own_record(tmp_path):
    import argparse
    import time

    for steps in (60, 100):
        args = argparse.Namespace(work=tmp_path, device="cpu", reader_steps=steps, init_lora="lora.safetensors")
        train.record_stage(args, "reader-continued", time.perf_counter())
    assert [r["reader_steps"] for r in train.stage_records(tmp_path)["reader-continued"]] == [60, 100]


def test_kind_weights_parse_and_name_an_unknown_kind():
    import argparse

    assert train.kind_weights("relation=8,count=2") == {"relation": 8.0, "count": 2.0}
    with pytest.raises(argparse.ArgumentTypeError, match="unknown question kind 'colours'"):
        train.kind_weights("colours=2")
