"""Hugging Face configs in (issue 34, item 1): planner.hf against transformers' own config classes and
models (the `hf` extra; no downloads), the spec document's `hf_config`, `pipeplan spec --from-hf` and
POST /v1/plans with an `hf_config`.

Sizes are checked twice: against each model's published parameter count, and exactly against the
model transformers builds from the same config on the meta device (no memory, no weights)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from pipeplan.planner import hf
from pipeplan.planner.baselines import run_baseline
from pipeplan.planner.contract import error_messages
from pipeplan.planner.costmodel import layer_costs
from pipeplan.planner.documents import problem_from_document
from pipeplan.planner.spec import Spec, check_spec_size
from pipeplan.planner.validator import validate_plan
from pydantic import ValidationError
from typer.testing import CliRunner

from pipeplan.cli import app

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed: pip install -e '.[hf]'")

ROOT = Path(__file__).resolve().parent.parent
LLAMA3_8B = ROOT / "examples" / "hf" / "Llama-3-8B" / "config.json"


def _configs() -> dict[str, tuple[object, float, float | None]]:
    """name -> (transformers config with the published hyperparameters, published parameters in
    billions, published active parameters per token in billions for MoE models). DeepSeek's papers
    leave the embedding out of the active count (V2-Lite: 2.4 B), Mistral's and Qwen's count it."""
    t = transformers
    nemotron_pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    return {
        "Llama-2-7B": (t.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
                       6.74, None),
        "Llama-3-8B": (t.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192),
                       8.03, None),
        "Llama-3-70B": (t.LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                                      num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8), 70.6, None),
        "Mistral-7B": (t.MistralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                       num_attention_heads=32, num_key_value_heads=8, sliding_window=4096), 7.24, None),
        "Mixtral-8x7B": (t.MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                         num_local_experts=8, num_experts_per_tok=2), 46.7, 12.9),
        "Qwen2.5-7B": (t.Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                     num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072,
                                     sliding_window=131072, use_sliding_window=False, max_window_layers=28),
                       7.61, None),
        "Qwen2.5-0.5B": (t.Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                       num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
                         0.49, None),
        "Qwen2-57B-A14B": (t.Qwen2MoeConfig(vocab_size=151936, hidden_size=3584, intermediate_size=18944,
                                            moe_intermediate_size=2560, shared_expert_intermediate_size=20480,
                                            num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                            num_experts=64, num_experts_per_tok=8), 57.4, 14.2),
        "Qwen3-8B": (t.Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=128), 8.2, None),
        "Qwen3-30B-A3B": (t.Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                           moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                                           num_key_value_heads=4, head_dim=128, num_experts=128,
                                           num_experts_per_tok=8), 30.5, 3.3),
        "Gemma-2-9B": (t.Gemma2Config(vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                                      num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                                      sliding_window=4096), 9.24, None),
        "Gemma-3-27B": (t.Gemma3Config(text_config=dict(
            vocab_size=262208, hidden_size=5376, intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
            num_key_value_heads=16, head_dim=128, sliding_window=1024)), 27.0, None),  # language model of 27.4
        "DeepSeek-V2-Lite": (t.DeepseekV2Config(
            vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
            num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
            num_experts_per_tok=6, first_k_dense_replace=1), 15.7, 2.4),
        "DeepSeek-V3": (t.DeepseekV3Config(
            vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
            num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
            kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
            n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3, num_nextn_predict_layers=1),
            671.0, 37.0),
        "Phi-3-mini": (t.Phi3Config(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                                    num_attention_heads=32, num_key_value_heads=32, sliding_window=2047), 3.82, None),
        "OLMo-2-7B": (t.Olmo2Config(vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                    num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
                      7.30, None),
        "Nemotron-H-8B": (t.NemotronHConfig(
            hybrid_override_pattern=nemotron_pattern, hidden_size=4096, intermediate_size=21504,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, mamba_num_heads=128, mamba_head_dim=64,
            ssm_state_size=128, n_groups=8, vocab_size=131072, max_position_embeddings=8192), 8.0, None),
    }


CONFIGS = _configs()


def spec_of(config: dict, **model) -> Spec:
    return Spec.model_validate({"hf_config": config, "model": model, "hardware": "H100-80GB",
                                "training": {"devices": 1, "microbatches": 1}})


def counts(spec: Spec) -> tuple[float, float]:
    """(parameters, parameters each token passes through) of the model without its MTP heads; a tied
    output head is the embedding, counted once."""
    costs = [c for c in layer_costs(spec) if c.type != "mtp_head"]
    total = sum(c.params for c in costs) - (costs[0].params if spec.model.tie_embeddings else 0.0)
    m = spec.model
    routed = sum(c.expert_params for c in costs)
    return total, total - routed + (routed * m.top_k / m.experts if m.experts else 0.0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_mapped_size_is_the_published_size(name):
    config, published, active = CONFIGS[name]
    total, per_token = counts(spec_of(config.to_dict()))
    tolerance = 0.03 if name == "Nemotron-H-8B" else 0.01  # its card says "8B"; n_groups: the next test
    assert total / 1e9 == pytest.approx(published, rel=tolerance)
    if active is not None:
        if name.startswith("DeepSeek"):
            per_token -= config.vocab_size * config.hidden_size
        assert per_token / 1e9 == pytest.approx(active, rel=0.03)


def test_mapped_layers_and_sizes_are_the_model_transformers_builds():
    """The model transformers builds from each config (meta device): the same parameters (Nemotron-H:
    exactly what the note says is missing), the same MoE layers in the same places."""
    torch = pytest.importorskip("torch", reason="the torch extra is not installed")
    small = {
        "qwen2-moe sparse step 2 and an MLP-only layer": transformers.Qwen2MoeConfig(
            vocab_size=1000, hidden_size=256, intermediate_size=384, moe_intermediate_size=128,
            shared_expert_intermediate_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
            num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3]),
        "deepseek-v2 first dense layers": transformers.DeepseekV2Config(
            vocab_size=1000, hidden_size=256, intermediate_size=384, moe_intermediate_size=128, num_hidden_layers=5,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=32,
            qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
            first_k_dense_replace=2),
    }
    cases = {name: c for name, (c, _, _) in CONFIGS.items()
             if name in ("Mixtral-8x7B", "Qwen3-30B-A3B", "Gemma-3-27B", "DeepSeek-V3", "Nemotron-H-8B", "Phi-3-mini")}
    for name, config in {**cases, **small}.items():
        with torch.device("meta"):  # Gemma 3: its language model (the vision tower is not planned)
            model = transformers.AutoModelForCausalLM.from_config(getattr(config, "text_config", config))
        built = sum(p.numel() for p in model.parameters())
        mapped = hf.model_fields(config.to_dict())
        spec = spec_of(config.to_dict())
        total, _ = counts(spec)
        if name == "Nemotron-H-8B":  # 7 more B/C groups of 2 x 128 state channels, from hidden 4096
            missing = (8 - 1) * 2 * 128 * 4096
            assert f"{missing:,} in-projection parameters per Mamba layer are not counted" in mapped.notes[0]
            total += missing * spec.model.pattern.count("M")
        assert total == pytest.approx(built, rel=3e-3), name  # biases, q/k norms and gates are not counted
        ours = [g.type for g in spec.model.layer_groups() if g.type not in ("embedding", "lm_head", "mtp_head")]
        theirs = [type(getattr(layer, "mlp", getattr(layer, "mixer", None))).__name__ for layer in model.model.layers]
        theirs = ["moe" if t.endswith(("MoE", "Moe", "MoeBlock")) else t for t in theirs]
        assert [t == "moe" for t in ours] == [t == "moe" for t in theirs], name


def test_raw_config_files_map_as_transformers_reads_them():
    """A config.json as the Hub holds it (older key names, defaults left out) maps as the config
    transformers loads from it: the example file, and Nemotron-H's hybrid_override_pattern /
    attention_head_dim against transformers 5's layers_block_type / head_dim."""
    raw = json.loads(LLAMA3_8B.read_text())
    loaded = transformers.AutoConfig.from_pretrained(LLAMA3_8B.parent).to_dict()
    assert hf.model_fields(loaded).fields["name"] == "Llama-3-8B"  # _name_or_path: the folder
    assert hf.model_fields(raw).fields == {**hf.model_fields(loaded).fields, "name": "LlamaForCausalLM"}
    nemotron = {"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "hidden_size": 1024,
                "num_hidden_layers": 6, "hybrid_override_pattern": "M-M*-M", "attention_head_dim": 128,
                "num_attention_heads": 16, "num_key_value_heads": 2, "intermediate_size": 2048, "vocab_size": 5000,
                "mamba_num_heads": 32, "mamba_head_dim": 64, "ssm_state_size": 64, "n_groups": 1, "expand": 2}
    via = transformers.NemotronHConfig(**nemotron).to_dict()
    assert "layers_block_type" in via and "hybrid_override_pattern" not in via
    assert hf.model_fields(nemotron).fields == hf.model_fields(via).fields
    for name, (config, _, _) in CONFIGS.items():  # keys left at transformers' defaults
        assert hf.model_fields(config.to_diff_dict()).fields == hf.model_fields(config.to_dict()).fields, name


def test_families_follow_transformers():
    """Every family is a transformers config class with our tie default; every architecture name is a
    transformers model class of that family."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for model_type, (tied, _) in hf.FAMILIES.items():
        cls = CONFIG_MAPPING[model_type]
        default = cls(text_config={}) if model_type == "gemma3" else cls()
        assert getattr(default, "tie_word_embeddings", tied) == tied, model_type
    for arch, model_type in hf.ARCHITECTURES.items():
        assert getattr(transformers, arch).config_class.model_type == model_type, arch


def test_examples_are_the_mapped_configs():
    """The hand-written example specs are what the configs give: same problems, same keys."""
    llama = json.loads(LLAMA3_8B.read_text())
    for example, config, name in (("llama3_8b_8xh100.json", llama, None), ("llama3_8b_8xh100_loop.json", llama, None),
                                  ("deepseek_v3_1024xh100.json", CONFIGS["DeepSeek-V3"][0].to_dict(), "DeepSeek-V3")):
        doc = json.loads((ROOT / "examples" / "specs" / example).read_text())
        doc["partition"] = "balanced" if doc["partition"] == "auto" else doc["partition"]  # no search here
        mapped = {**doc, "hf_config": config, "model": {"name": name or doc["model"]["name"],
                                                         "seq_len": doc["model"]["seq_len"]}}
        assert problem_from_document(mapped).key() == problem_from_document(doc).key(), example


@pytest.mark.parametrize("name,layout", [
    ("Llama-3-8B", {"gpus": 8}),
    ("Mixtral-8x7B", {"gpus": 64, "pp": 8, "ep": 8}),
    ("Qwen3-30B-A3B", {"gpus": 32, "pp": 4, "ep": 8}),
    ("Gemma-3-27B", {"gpus": 16, "tp": 2}),
    ("DeepSeek-V3", {"gpus": 1024, "tp": 2, "pp": 16, "ep": 64, "etp": 1}),
    ("Nemotron-H-8B", {"gpus": 8}),
])
def test_the_mapped_spec_plans(name, layout):
    doc, _ = hf.spec_document(CONFIGS[name][0].to_dict(), microbatches=16, precision="bf16", **layout)
    problem = problem_from_document(doc)
    plan = run_baseline(problem, "1f1b")
    assert validate_plan(problem, plan) == [] and plan.makespan_ms > 0
    assert problem.num_devices == doc["training"]["devices"]


def test_sliding_windows_follow_the_family_rules():
    t = transformers
    sizes = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=12, num_attention_heads=4,
                 num_key_value_heads=2)
    fields = {
        "mistral": hf.model_fields(t.MistralConfig(sliding_window=4096, **sizes).to_dict()).fields,
        "gemma2": hf.model_fields(t.Gemma2Config(sliding_window=4096, head_dim=64, **sizes).to_dict()).fields,
        "gemma3": hf.model_fields(t.Gemma3TextConfig(sliding_window=512, head_dim=64, **sizes).to_dict()).fields,
    }
    assert (fields["mistral"]["sliding_window"], fields["mistral"].get("full_attention_every")) == (4096, None)
    assert (fields["gemma2"]["sliding_window"], fields["gemma2"]["full_attention_every"]) == (4096, 2)
    assert (fields["gemma3"]["sliding_window"], fields["gemma3"]["full_attention_every"]) == (512, 6)
    old_gemma3 = {**t.Gemma3TextConfig(sliding_window=512, head_dim=64, **sizes).to_dict(), "sliding_window_pattern": 4}
    del old_gemma3["layer_types"]  # a config written before transformers had layer_types
    assert hf.model_fields(old_gemma3).fields["full_attention_every"] == 4
    qwen = hf.model_fields(t.Qwen2Config(use_sliding_window=True, sliding_window=1024, max_window_layers=8,
                                         **sizes).to_dict())
    assert "sliding_window" not in qwen.fields and "cannot express" in qwen.notes[0]
    assert "sliding_window" not in hf.model_fields(t.Qwen2Config(sliding_window=1024, **sizes).to_dict()).fields


@pytest.mark.parametrize("change,field", [
    ({"num_hidden_layers": None}, "hf_config.num_hidden_layers: missing"),
    ({"hidden_size": "4096"}, "hf_config.hidden_size: expected a whole number"),
    ({"num_key_value_heads": 5}, "hf_config.num_key_value_heads: 5 does not divide"),
    ({"model_type": "falcon"}, "hf_config.model_type: 'falcon' is not supported"),
    ({"model_type": None, "architectures": ["FalconForCausalLM"]}, "hf_config.architectures: 'FalconForCausalLM'"),
    ({"model_type": None, "architectures": None}, "hf_config.model_type: missing"),
    ({"layer_types": ["full_attention"]}, "hf_config.layer_types: 1 entries for num_hidden_layers (32)"),
    ({"tie_word_embeddings": "no"}, "hf_config.tie_word_embeddings: expected true or false"),
])
def test_errors_name_the_key(change, field):
    config = {k: v for k, v in {**json.loads(LLAMA3_8B.read_text()), **change}.items() if v is not None}
    with pytest.raises(ValidationError) as err:
        spec_of(config)
    assert error_messages(err.value)[0].startswith(field), error_messages(err.value)


def test_unsupported_shapes_are_refused_with_the_reason():
    moe_hybrid = {**CONFIGS["Nemotron-H-8B"][0].to_dict(), "layers_block_type": ["mamba", "moe", "attention"]}
    for config, expected in (({"model_type": "gemma3", "text_config": {"num_hidden_layers": 2}},
                              "hf_config.text_config.hidden_size: missing"),
                             (moe_hybrid, "hf_config.layers_block_type: MoE-only blocks (E) cannot be costed"),
                             ([1, 2], "hf_config: expected a JSON object (a config.json), got list")):
        with pytest.raises(ValidationError) as err:
            spec_of(config)  # type: ignore[arg-type]
        assert error_messages(err.value)[0].startswith(expected), error_messages(err.value)
    # model fields beside hf_config override what was mapped, and are checked as model fields
    assert spec_of(json.loads(LLAMA3_8B.read_text()), seq_len=8192).model.seq_len == 8192
    with pytest.raises(ValidationError) as err:
        spec_of(json.loads(LLAMA3_8B.read_text()), seq_len=0)
    assert error_messages(err.value)[0].startswith("model.seq_len")


def test_size_limits_see_the_config_before_anything_is_built():
    huge = {**json.loads(LLAMA3_8B.read_text()), "num_hidden_layers": 10**9}
    with pytest.raises(ValueError, match=r"hf_config.num_hidden_layers: 1000000000 layers exceed the limit"):
        check_spec_size({"hf_config": huge, "training": {"devices": 2, "microbatches": 2}})
    assert hf.block_count({"model_type": "llama", "num_hidden_layers": "x"}) == 0  # validation names it


# -- the command ------------------------------------------------------------------------------------------
runner = CliRunner()


def test_spec_command_writes_the_example_spec(tmp_path):
    out = tmp_path / "spec.json"
    result = runner.invoke(app, ["spec", "--from-hf", str(LLAMA3_8B.parent), "--devices", "8", "--microbatches",
                                 "32", "--seq-len", "8192", "--placement", "loop", "--chunks", "2", "--recompute",
                                 "--memory-budget-gib", "40", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "Llama-3-8B (llama), 32 blocks, 8.03 B parameters, seq_len 8192" in result.stderr
    example = json.loads((ROOT / "examples" / "specs" / "llama3_8b_8xh100_loop.json").read_text())
    assert problem_from_document(json.loads(out.read_text())).key() == problem_from_document(example).key()
    result = runner.invoke(app, ["spec", "--from-hf", str(LLAMA3_8B.parent), "--devices", "8",
                                 "--microbatches", "32", "--backward-frees", "at_w"])  # torch's split B
    assert result.exit_code == 0 and json.loads(result.stdout)["training"]["backward_frees"] == "at_w"


def test_spec_command_lays_out_the_gpus(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIGS["Mixtral-8x7B"][0].to_dict()))
    result = runner.invoke(app, ["spec", "--from-hf", str(config), "--devices", "64", "--tp", "2", "--pp", "4",
                                 "--ep", "8", "--microbatches", "16", "--precision", "fp8"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["training"]["devices"] == 4 and doc["precision"] == "fp8"
    assert doc["parallel"] == {"tp": 2, "cp": 1, "ep": 8, "gpus": 64}
    assert "(tp 2 x cp 1 x pp 4 x dp 8, ep 8)" in result.stderr
    assert "parallel" not in json.loads(runner.invoke(app, ["spec", "--from-hf", str(config), "--devices", "8",
                                                            "--microbatches", "8"]).stdout)
    for args, message in ((["--devices", "12", "--tp", "8"], "--devices: 12 is not a multiple of tp x cp = 8"),
                          (["--devices", "24", "--tp", "3"], "parallel.tp: 3 does not divide model.heads (32)"),
                          (["--devices", "8", "--hardware", "B300"], "hardware: unknown preset 'B300'")):
        result = runner.invoke(app, ["spec", "--from-hf", str(config), "--microbatches", "8", *args])
        assert result.exit_code == 2 and message in result.stderr, result.output
    config.write_text(json.dumps({"model_type": "mistral", "num_hidden_layers": 10**9, "sliding_window": 8}))
    result = runner.invoke(app, ["spec", "--from-hf", str(config), "--devices", "2", "--microbatches", "2"])
    assert result.exit_code == 2 and "hf_config.num_hidden_layers: 1000000000 layers exceed" in result.stderr
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    result = runner.invoke(app, ["spec", "--from-hf", str(config), "--devices", "2", "--microbatches", "2"])
    assert result.exit_code == 2 and "hf_config.num_hidden_layers: missing" in result.stderr


# -- the API ----------------------------------------------------------------------------------------------
def test_post_plans_takes_an_hf_config(tmp_path):
    pytest.importorskip("fastapi", reason="the server extra is not installed")
    from fastapi.testclient import TestClient
    from pipeplan.service import create_app

    from pipeplan.settings import Settings

    config = {**json.loads(LLAMA3_8B.read_text()), "num_hidden_layers": 4}
    spec = {"hf_config": config, "model": {"seq_len": 1024}, "hardware": "H100-80GB",
            "training": {"devices": 2, "microbatches": 4}}
    app_ = create_app(Settings(data_dir=tmp_path / "data", embedded_workers=0, default_time_budget_s=1.0))
    with TestClient(app_, raise_server_exceptions=False) as client:
        r = client.post("/v1/plans", json={"spec": spec, "time_budget_s": 1})
        assert r.status_code in (200, 201), r.text
        assert r.json()["problem_key"] == problem_from_document(spec).key()
        bad = client.post("/v1/plans", json={"spec": {**spec, "hf_config": {**config, "num_hidden_layers": None}}})
        assert bad.status_code == 422 and "spec.hf_config.num_hidden_layers: missing" in bad.json()["message"]
        huge = client.post("/v1/plans", json={"spec": {**spec, "hf_config": {**config, "num_hidden_layers": 10**6}}})
        assert huge.status_code == 422 and "hf_config.num_hidden_layers" in huge.json()["message"]
        schema = client.get("/openapi.json").json()["components"]["schemas"]["Spec"]
        assert "hf_config" in schema["properties"] and {"required": ["hf_config"]} in schema["anyOf"]
    assert math.isfinite(r.json()["plan"]["makespan_ms"])
