"""Hugging Face `config.json` -> the spec's model fields.

Why a module of its own: every model people train comes with a `config.json`, and the spec names the
same sizes its own way (`hidden`, `ffn`, `kv_heads`, `experts`, ...). This is the one place that knows
Hugging Face's names, per `model_type`, and every choice the translation makes. It speaks plain dicts
and sits below planner.spec, which accepts `hf_config` in a spec document in place of `model`.

Mapping decisions (docs/costmodel.md, "From a Hugging Face config.json", says the same for users):

* **Family**: `model_type`, else the first of `architectures` (e.g. `LlamaForCausalLM`). Gemma 3's
  multimodal config (`gemma3`) is read through its `text_config`: the vision tower is not planned.
* **Required sizes**: `hidden_size`, `num_hidden_layers` (Nemotron-H: its layer pattern),
  `num_attention_heads`, `intermediate_size` (MLP layers) and `vocab_size`; a missing one is named.
* **Defaults transformers applies** when a key is absent: `num_key_value_heads` = heads;
  `tie_word_embeddings` = the family's default (Gemma: tied; the others: not); MoE layer spacing 1.
* **head_dim** is taken when the config gives one that differs from hidden / heads (Gemma, Qwen3,
  Mistral NeMo), else the spec derives it. MLA models (DeepSeek) use their MLA widths instead: there
  `head_dim` is the RoPE width.
* **MLP**: gated (SwiGLU / GeGLU, three matrices) in every family but Nemotron-H (squared ReLU, two).
* **Sliding windows**: which layers are local comes from `layer_types` when the config has it, else
  the family's rule in transformers (Mistral, Mixtral, Phi-3: every layer when `sliding_window` is
  set; Qwen: layers from `max_window_layers` on, only with `use_sliding_window`; Gemma 2: every other
  layer from the first; Gemma 3: all but every `sliding_window_pattern`-th). The spec expresses "all
  local" or "every n-th global"; another arrangement is costed as global attention everywhere (a
  note says so) -- it changes only the calibrated estimate's attention time, never memory.
* **MoE layers** are the ones transformers builds: Mixtral every layer; Qwen-MoE layer i when
  (i + 1) % `decoder_sparse_step` == 0 and i is not in `mlp_only_layers`; DeepSeek i >=
  `first_k_dense_replace` (and i % `moe_layer_freq` == 0 when the config has it, as DeepSeek's own
  code reads it). Written as `first_dense_layers` / `moe_every` when regular, else as a D/E pattern.
* **Shared experts**: DeepSeek's `n_shared_experts` of the routed size; Qwen2-MoE's one shared expert
  of `shared_expert_intermediate_size` becomes a count of routed-size experts (exact when a multiple,
  rounded with a note otherwise: the spec has one expert size).
* **MTP**: `num_nextn_predict_layers` -> `mtp_heads` (DeepSeek-V3 trained with one).
* **Training choices a config does not hold**: `seq_len` 4096, capped at `max_position_embeddings`
  (what the model can take, not what it trains on); `micro_batch_size` 1; `dtype` bf16 (the config's
  `torch_dtype` is how the checkpoint is stored); `dropout` when a dropout probability is > 0;
  `causal` unless `use_bidirectional_attention`. A spec document's `model` fields beside `hf_config`
  override any of these.
* **Nemotron-H**: `hybrid_override_pattern` (or transformers 5's `layers_block_type`) is the spec's
  pattern, character for character (M Mamba-2, * attention, - MLP); Mamba-2 state, expansion and head
  width are mapped; the spec's Mamba block has one B/C group, so `n_groups` > 1 adds parameters it
  does not count (a note gives how many). MoE-only blocks (E, Nemotron 3) are refused: the spec's MoE
  block carries an attention they do not have.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_SEQ_LEN = 4096

# model_type -> (transformers' default for tie_word_embeddings, gated MLP)
FAMILIES: dict[str, tuple[bool, bool]] = {
    "llama": (False, True), "mistral": (False, True), "mixtral": (False, True),
    "qwen2": (False, True), "qwen2_moe": (False, True), "qwen3": (False, True), "qwen3_moe": (False, True),
    "gemma": (True, True), "gemma2": (True, True), "gemma3": (True, True), "gemma3_text": (True, True),
    "deepseek_v2": (False, True), "deepseek_v3": (False, True),
    "phi3": (False, True), "olmo2": (False, True), "nemotron_h": (False, False),
}
ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2", "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe", "GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text", "Gemma3ForConditionalGeneration": "gemma3",
    "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
    "Phi3ForCausalLM": "phi3", "Olmo2ForCausalLM": "olmo2", "NemotronHForCausalLM": "nemotron_h",
}
# Nemotron-H's block names (transformers 5's layers_block_type, older names too) -> pattern characters
NEMOTRON_BLOCKS = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*",
                   "mlp": "-", "moe": "E"}
# The order a written spec lists the model's fields in (sizes first, then MoE, MLA, attention, Mamba)
ORDER = ("name", "layers", "pattern", "hidden", "ffn", "heads", "kv_heads", "head_dim", "vocab", "seq_len",
         "micro_batch_size", "dtype", "gated_mlp", "tie_embeddings", "dropout", "causal", "experts", "top_k",
         "moe_ffn", "shared_experts", "first_dense_layers", "moe_every", "mtp_heads", "q_lora_rank",
         "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "sliding_window",
         "full_attention_every", "mamba_d_state", "mamba_expand", "mamba_head_dim")
_MISSING = object()


class HfConfigError(ValueError):
    """A config.json that cannot be mapped; `path` names the key inside `hf_config`."""

    def __init__(self, path: tuple[str, ...], reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"hf_config.{'.'.join(path)}: {reason}" if path else f"hf_config: {reason}")


@dataclass
class HfModel:
    """The spec's `model` fields for a config, and what the mapping approximated (for the user)."""

    fields: dict[str, Any]
    notes: list[str] = field(default_factory=list)


@dataclass
class _Config:
    """Reads keys of one config dict, naming them (with their parent, e.g. text_config) on error."""

    raw: dict[str, Any]
    prefix: tuple[str, ...] = ()

    def error(self, key: str, reason: str) -> HfConfigError:
        return HfConfigError((*self.prefix, key), reason)

    def int(self, key: str, default: Any = _MISSING, minimum: int = 1, aliases: tuple[str, ...] = ()) -> Any:
        """A whole number >= minimum; a null value counts as absent (transformers does so too)."""
        for name in (key, *aliases):
            value = self.raw.get(name)
            if value is None:
                continue
            if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
                value = int(value)
            if isinstance(value, bool) or not isinstance(value, int):
                raise self.error(name, f"expected a whole number, got {value!r:.40}")
            if value < minimum:
                raise self.error(name, f"must be >= {minimum}, got {value}")
            return value
        if default is _MISSING:
            raise self.error(key, "missing" + (f" (nor {', '.join(aliases)})" if aliases else "")
                             + "; the cost model needs it")
        return default

    def number(self, key: str, default: float = 0.0) -> float:
        value = self.raw.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise self.error(key, f"expected a number, got {value!r:.40}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"expected true or false, got {value!r:.40}")
        return value

    def ints(self, key: str, minimum: int = 0) -> list[int]:
        value = self.raw.get(key)
        if value is None:
            return []
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) or v < minimum
                                              for v in value):
            raise self.error(key, f"expected a list of whole numbers >= {minimum}")
        return value

    def strings(self, key: str) -> list[str] | None:
        value = self.raw.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(key, "expected a list of strings")
        return value


def model_type_of(config: Any) -> str:
    """The supported family a config belongs to; HfConfigError naming the key otherwise."""
    if not isinstance(config, dict):
        raise HfConfigError((), f"expected a JSON object (a config.json), got {type(config).__name__}")
    model_type = config.get("model_type")
    if model_type is None:
        archs = config.get("architectures")
        if not (isinstance(archs, list) and archs and isinstance(archs[0], str)):
            raise HfConfigError(("model_type",), "missing, and no architectures to tell the model by")
        if archs[0] not in ARCHITECTURES:
            raise HfConfigError(("architectures",), f"{archs[0]!r:.60} is not supported (no model_type"
                                f" given); supported: {', '.join(ARCHITECTURES)}")
        return ARCHITECTURES[archs[0]]
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise HfConfigError(("model_type",), f"{model_type!r:.60} is not supported; supported:"
                            f" {', '.join(FAMILIES)}")
    return model_type


def block_count(config: Any) -> int:
    """Blocks a config asks for (layers, or the hybrid pattern's length, plus MTP layers), read
    without building anything, for the size limits checked before a spec is validated; 0 when the
    config is too broken to tell (its validation then names the field)."""
    try:
        model_type = model_type_of(config)
    except HfConfigError:
        return 0
    if model_type == "gemma3" and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    sizes = [config.get(k) for k in ("num_hidden_layers", "num_nextn_predict_layers")]
    n = sum(v for v in sizes if isinstance(v, int) and not isinstance(v, bool) and v > 0)
    for key in ("hybrid_override_pattern", "layers_block_type"):
        if isinstance(config.get(key), str | list):
            n = max(n, len(config[key]))
    return n


def model_fields(config: Any) -> HfModel:
    """The spec's `model` fields for a Hugging Face config dict (HfConfigError names the key)."""
    model_type = model_type_of(config)
    c = _Config(config)
    notes: list[str] = []
    if model_type == "gemma3":
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise HfConfigError(("text_config",), "missing: Gemma 3's language model is described there")
        c = _Config(text, ("text_config",))
        notes.append("gemma3: the language model (text_config) is planned; the vision tower is not")
    tie_default, gated = FAMILIES[model_type]
    if model_type == "nemotron_h":
        blocks = _nemotron_pattern(c)
        layers = len(blocks)
    else:
        blocks, layers = None, c.int("num_hidden_layers")
    hidden, heads = c.int("hidden_size"), c.int("num_attention_heads")
    out: dict[str, Any] = {
        "name": _name(config, model_type),
        "hidden": hidden, "heads": heads, "vocab": c.int("vocab_size"),
        "seq_len": min(DEFAULT_SEQ_LEN, c.int("max_position_embeddings", DEFAULT_SEQ_LEN)),
        "micro_batch_size": 1, "dtype": "bf16", "gated_mlp": gated,
        "tie_embeddings": c.flag("tie_word_embeddings", tie_default),
        "dropout": any(c.number(k) > 0 for k in ("attention_dropout", "hidden_dropout", "resid_pdrop",
                                                   "embd_pdrop", "dropout")),
        "causal": not c.flag("use_bidirectional_attention", False),
    }
    mla = model_type.startswith("deepseek")
    if mla:
        out.update(_mla(c))
    else:
        out["kv_heads"] = c.int("num_key_value_heads", heads)
        if heads % out["kv_heads"]:
            raise c.error("num_key_value_heads", f"{out['kv_heads']} does not divide num_attention_heads ({heads})")
        head_dim = c.int("head_dim", None, aliases=("attention_head_dim",))
        if head_dim is not None and head_dim * heads != hidden:  # else the spec's own default
            out["head_dim"] = head_dim
        elif head_dim is None and hidden % heads:
            raise c.error("head_dim", f"missing, and num_attention_heads ({heads}) does not divide hidden_size"
                          f" ({hidden})")
    if model_type == "nemotron_h":
        out["ffn"] = c.int("intermediate_size", None if "-" not in blocks else _MISSING)
        out.update(_nemotron(c, blocks, hidden, notes))
    else:
        out["ffn"] = c.int("intermediate_size")
        out.update(_moe(c, model_type, layers, notes))
        out.update(_sliding(c, model_type, layers, notes))
    out["mtp_heads"] = c.int("num_nextn_predict_layers", 0, minimum=0) or None
    if isinstance(config.get("quantization_config"), dict):
        notes.append("quantization_config: the checkpoint is stored quantized; training precision is the"
                     " spec's own (precision: bf16 or fp8)")
    ordered = sorted(out, key=lambda k: ORDER.index(k) if k in ORDER else len(ORDER))
    return HfModel(fields={k: out[k] for k in ordered if out[k] is not None}, notes=notes)


def _name(config: dict[str, Any], model_type: str) -> str:
    path = config.get("_name_or_path")
    if isinstance(path, str) and path.strip("/"):
        return path.rstrip("/").rsplit("/", 1)[-1][:100]
    archs = config.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0][:100]
    return model_type


def _mla(c: _Config) -> dict[str, Any]:
    """DeepSeek's multi-head latent attention: the spec takes Hugging Face's names as they are."""
    return {"kv_lora_rank": c.int("kv_lora_rank"), "q_lora_rank": c.int("q_lora_rank", None),
            "qk_nope_head_dim": c.int("qk_nope_head_dim"), "qk_rope_head_dim": c.int("qk_rope_head_dim", 64, 0),
            "v_head_dim": c.int("v_head_dim")}


def _moe(c: _Config, model_type: str, layers: int, notes: list[str]) -> dict[str, Any]:
    """Experts, top-k, expert size, shared experts and which layers are MoE, as transformers builds them."""
    if model_type == "mixtral":  # every layer; the experts are the MLP (intermediate_size)
        return {"layers": layers, "experts": c.int("num_local_experts", aliases=("num_experts",)),
                "top_k": c.int("num_experts_per_tok"), "moe_ffn": c.int("intermediate_size")}
    if model_type in ("qwen2_moe", "qwen3_moe"):
        experts = c.int("num_experts", 0, minimum=0, aliases=("num_local_experts",))
        step = c.int("decoder_sparse_step", 1)
        dense = set(c.ints("mlp_only_layers"))
        is_moe: Callable[[int], bool] = lambda i: (i + 1) % step == 0 and i not in dense  # noqa: E731
    elif model_type.startswith("deepseek"):
        experts = c.int("n_routed_experts", 0, minimum=0)
        first, freq = c.int("first_k_dense_replace", 0, minimum=0), c.int("moe_layer_freq", 1)
        is_moe = lambda i: i >= first and i % freq == 0  # noqa: E731
    else:
        return {"layers": layers}
    where = [i for i in range(layers) if is_moe(i)] if experts else []
    if not where:
        return {"layers": layers}
    out: dict[str, Any] = {"experts": experts, "top_k": c.int("num_experts_per_tok"),
                           "moe_ffn": c.int("moe_intermediate_size")}
    if out["top_k"] > experts:
        raise c.error("num_experts_per_tok", f"{out['top_k']} exceeds the experts ({experts})")
    if model_type.startswith("deepseek"):
        out["shared_experts"] = c.int("n_shared_experts", 0, minimum=0)
    elif model_type == "qwen2_moe":
        out["shared_experts"] = _shared(c, "shared_expert_intermediate_size", out["moe_ffn"], notes)
    first = where[0]
    every = where[1] - first if len(where) > 1 else layers - first
    if where == list(range(first, layers, every)):
        out.update(layers=layers, first_dense_layers=first, moe_every=every)
    else:
        out["pattern"] = "".join("E" if is_moe(i) else "D" for i in range(layers))
    return out


def _shared(c: _Config, key: str, moe_ffn: int, notes: list[str]) -> int:
    """A shared expert of `key` inner size, as a number of routed-size experts."""
    size = c.int(key, 0, minimum=0)
    if not size:
        return 0
    n = max(1, round(size / moe_ffn))
    if n * moe_ffn != size:
        notes.append(f"{key}: a shared expert of {size} inner size is costed as {n} x {moe_ffn}"
                     f" ({n * moe_ffn / size - 1:+.1%}): the spec has one expert size")
    return n


def _local_layers(c: _Config, model_type: str, layers: int) -> list[bool]:
    """Which layers attend through the sliding window (transformers' rule for the family)."""
    kinds = c.strings("layer_types")
    if kinds is not None:
        if len(kinds) != layers:
            raise c.error("layer_types", f"{len(kinds)} entries for num_hidden_layers ({layers})")
        return [k == "sliding_attention" for k in kinds]
    if model_type in ("mistral", "mixtral", "phi3"):
        return [True] * layers
    if model_type.startswith("qwen"):
        start = c.int("max_window_layers", 0, minimum=0)
        return [c.flag("use_sliding_window", False) and i >= start for i in range(layers)]
    if model_type == "gemma2":
        return [i % 2 == 0 for i in range(layers)]
    if model_type.startswith("gemma3"):
        every = c.int("sliding_window_pattern", 6, aliases=("_sliding_window_pattern",))
        return [(i + 1) % every != 0 for i in range(layers)]
    return [False] * layers


def _sliding(c: _Config, model_type: str, layers: int, notes: list[str]) -> dict[str, Any]:
    window = c.int("sliding_window", None, minimum=0)  # Qwen2-MoE's default is 0: none
    local = _local_layers(c, model_type, layers)
    if not window or not any(local):
        return {}
    if all(local):
        return {"sliding_window": window}
    every = local.index(False) + 1
    if local == [(i + 1) % every != 0 for i in range(layers)]:
        return {"sliding_window": window, "full_attention_every": every}
    notes.append(f"sliding_window: {sum(local)} of {layers} layers attend to {window} tokens in an"
                 " arrangement the spec cannot express (all local, or every n-th global); costed as"
                 " global attention in every layer (attention time over-, never under-estimated)")
    return {}


def _nemotron_pattern(c: _Config) -> str:
    """The layer pattern, from the string or from transformers 5's list of block names."""
    key = "hybrid_override_pattern"
    pattern = c.raw.get(key)
    if pattern is not None:
        if not isinstance(pattern, str) or not pattern or set(pattern) - set("M*-E"):
            raise c.error(key, "expected a string of M (Mamba), * (attention), - (MLP) and E (MoE)")
    else:
        key = "layers_block_type"
        blocks = c.strings(key)
        if not blocks:
            raise c.error("hybrid_override_pattern", "missing (nor layers_block_type): Nemotron-H's layers")
        unknown = sorted(set(blocks) - set(NEMOTRON_BLOCKS))
        if unknown:
            raise c.error(key, f"unknown block types {unknown}; known: {', '.join(NEMOTRON_BLOCKS)}")
        pattern = "".join(NEMOTRON_BLOCKS[b] for b in blocks)
    if "E" in pattern:
        raise c.error(key, "MoE-only blocks (E) cannot be costed yet: the spec's MoE block is attention plus"
                      " experts, so each would count an attention it does not have (Nemotron-H without MoE"
                      " -- 8B, 47B, 56B -- maps exactly)")
    return pattern


def _nemotron(c: _Config, pattern: str, hidden: int, notes: list[str]) -> dict[str, Any]:
    """Nemotron-H: the pattern as is and the Mamba-2 sizes."""
    out: dict[str, Any] = {"pattern": pattern}
    if "M" in pattern:
        heads = c.int("mamba_num_heads")
        head_dim = c.int("mamba_head_dim")
        inner = heads * head_dim
        expand = max(1, round(inner / hidden))
        if expand * hidden != inner:
            notes.append(f"mamba_num_heads x mamba_head_dim = {inner} inner channels; the spec's Mamba block"
                         f" has expand x hidden = {expand * hidden}")
        out.update(mamba_d_state=c.int("ssm_state_size"), mamba_expand=expand, mamba_head_dim=head_dim)
        groups = c.int("n_groups", 1, aliases=("mamba_n_groups",))
        if groups > 1:
            extra = (groups - 1) * 2 * out["mamba_d_state"] * hidden
            notes.append(f"n_groups: {groups} B/C groups per Mamba layer; the spec's block has one, so"
                         f" {extra:,} in-projection parameters per Mamba layer are not counted")
    return out


def spec_document(config: Any, *, gpus: int, microbatches: int, hardware: str | dict = "H100-80GB",
                  tp: int = 1, cp: int = 1, ep: int = 1, etp: int | None = None, pp: int | None = None,
                  precision: str | None = None, cluster: str | None = None, model: dict | None = None,
                  training: dict | None = None, partition: str | list[int] = "balanced",
                  ) -> tuple[dict, list[str]]:
    """A whole spec document for a config on `gpus` GPUs, and the mapping's notes.

    The pipeline takes the GPUs tensor and context parallelism leave (pp = gpus / (tp x cp), so data
    parallelism is 1) unless `pp` is given, when data parallelism takes the rest. A layout with one GPU
    per stage (pp = gpus) writes no `parallel` block: the spec then means what one without the whole
    job always meant. `model` and `training` fields override the mapped and default ones. Raises
    ValueError naming the argument when the GPUs do not split; the spec's own validation checks the
    rest (heads over tp, experts over ep, ...)."""
    mapped = model_fields(config)
    for name, value in (("gpus", gpus), ("tp", tp), ("cp", cp), ("ep", ep), ("pp", pp or 1)):
        if value < 1:
            raise ValueError(f"{name}: must be >= 1, got {value}")
    if pp is None:
        if gpus % (tp * cp):
            raise ValueError(f"gpus: {gpus} is not a multiple of tp x cp = {tp * cp}")
        pp = gpus // (tp * cp)
    elif gpus % (tp * cp * pp):
        raise ValueError(f"gpus: {gpus} is not a multiple of tp x cp x pp = {tp * cp * pp}")
    doc: dict[str, Any] = {
        "format": "pipeplan.spec/v1",
        "model": {**mapped.fields, **(model or {})},
        "hardware": hardware,
        "training": {"devices": pp, "microbatches": microbatches, **(training or {})},
        "partition": partition,
    }
    if pp != gpus or ep > 1 or etp is not None:
        doc["parallel"] = {"tp": tp, "cp": cp, "ep": ep, "gpus": gpus, **({"etp": etp} if etp else {})}
    if precision is not None:
        doc["precision"] = precision
    if cluster is not None:
        doc["cluster"] = cluster
    return doc, mapped.notes


__all__ = ["ARCHITECTURES", "FAMILIES", "HfConfigError", "HfModel", "block_count", "model_fields",
           "model_type_of", "spec_document"]
