"""Published measured training runs on H100 with pipeline parallelism, as data: what bench/published.py
predicts and the calibration fits on.

Each run is one configuration exactly as its source lists it (GPUs, TP/PP/CP/VP/EP, micro and global
batch, sequence, precision, measured tokens/s per GPU) plus the framework settings its recipe states
(tensor-parallel communication overlap, expert all-to-all overlap, gradient dtype, optimizer,
recomputation), each cited. Where a container lists the same configuration again, the newest one is
kept; configurations that differ in global batch are different pipelines (more microbatches) and
stay. Nothing here is tuned: a run's settings come from its recipe, never from its error.

Left out: Megatron-Bridge 25.11's gpt-oss-120b H100 row (GBS 512, MBS 4, PP 4, GA 2): its GA
contradicts its own MBS, PP and GPU count (512 / (4 x 16) = 8), and the 25.11 recipe (tag v0.2.0)
sets MBS 1 -- the row cannot be reconstructed. Rows without pipeline parallelism are out of scope.
A row whose table contradicts its recipe stays in RUNS with `left_out` saying how: the bench prints
its prediction apart and counts it in no summary (qwen3-30b-a3b-vp24, below).

Sources (`SOURCES`): NVIDIA Megatron-Bridge's performance summary archive (containers 25.09-26.06),
NVIDIA NeMo's 24.07 performance summary (its last version in the NeMo repository), torchtitan's
December 2024 H100 benchmark notes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SOURCES = {
    "mbridge": "NVIDIA Megatron-Bridge, docs/performance-summary-archive.md (github.com/NVIDIA-NeMo/"
               "Megatron-Bridge, commit 4ab94dfa, 2026-08-11), DGX-H100 rows; recipes: scripts/performance at"
               " tags v0.1.0rc4, v0.2.0, v0.3.0, v0.4.0 (containers 25.09, 25.11, 26.02, 26.04)",
    "nemo2407": "NVIDIA NeMo, docs/source/performance/performance_summary.md at commit 8e3d65dc (2024-09-09,"
                " its last version; container NeMo 24.07, DGX-H100, FP8); recipes: NeMo-Framework-Launcher"
                " launcher_scripts/conf/training",
    "torchtitan": "pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md, Tables 5 and 6 (torch"
                  " 1963fc8, torchao eab345c, torchtitan 9dec370; H100 96 GB HBM2e at 500 W, Grand Teton)",
}

# Architectures (Hugging Face config.json of each model, or the source's model config).
LLAMA3_70B = {"name": "Llama-3-70B", "layers": 80, "hidden": 8192, "ffn": 28672, "heads": 64, "kv_heads": 8,
              "vocab": 128256}
LLAMA31_405B = {"name": "Llama-3.1-405B", "layers": 126, "hidden": 16384, "ffn": 53248, "heads": 128,
                "kv_heads": 8, "vocab": 128256}
LLAMA2_13B = {"name": "Llama-2-13B", "layers": 40, "hidden": 5120, "ffn": 13824, "heads": 40, "kv_heads": 40,
              "vocab": 32000}
LLAMA2_70B = {"name": "Llama-2-70B", "layers": 80, "hidden": 8192, "ffn": 28672, "heads": 64, "kv_heads": 8,
              "vocab": 32000}
# GPT-3 175B (Brown et al. 2020, Table 2.1): MHA, GeLU MLP of 4h, 50257-token vocabulary.
GPT3_175B = {"name": "GPT-3-175B", "layers": 96, "hidden": 12288, "ffn": 49152, "heads": 96, "vocab": 50257,
             "gated_mlp": False}
# Nemotron (NeMo's Nemotron3Config22B / Nemotron4Config340B; launcher nemotron_340b.yaml): squared-ReLU
# MLP of 4h (not gated), 256k vocabulary; 22B is MHA, 340B has 8 query groups.
NEMOTRON_22B = {"name": "Nemotron-3-22B", "layers": 40, "hidden": 6144, "ffn": 24576, "heads": 48,
                "vocab": 256000, "gated_mlp": False}
NEMOTRON4_340B = {"name": "Nemotron-4-340B", "layers": 96, "hidden": 18432, "ffn": 73728, "heads": 96,
                  "kv_heads": 8, "vocab": 256000, "gated_mlp": False}
# gpt-oss-120b (openai/gpt-oss-120b config.json): 128 experts top-4 of 2880, head_dim 64, 8 KV heads,
# attention alternating a 128-token sliding window and full (full on every second layer).
GPT_OSS_120B = {"name": "gpt-oss-120b", "layers": 36, "hidden": 2880, "ffn": 2880, "heads": 64, "kv_heads": 8,
                "head_dim": 64, "vocab": 201088, "experts": 128, "top_k": 4, "moe_ffn": 2880,
                "sliding_window": 128, "full_attention_every": 2}
# Qwen3 MoE (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B config.json): 128 experts top-8, head_dim 128.
QWEN3_30B_A3B = {"name": "Qwen3-30B-A3B", "layers": 48, "hidden": 2048, "ffn": 6144, "heads": 32, "kv_heads": 4,
                 "head_dim": 128, "vocab": 151936, "experts": 128, "top_k": 8, "moe_ffn": 768}
QWEN3_235B_A22B = {"name": "Qwen3-235B-A22B", "layers": 94, "hidden": 4096, "ffn": 12288, "heads": 64,
                   "kv_heads": 4, "head_dim": 128, "vocab": 151936, "experts": 128, "top_k": 8, "moe_ffn": 1536}
# DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json): MLA, 3 dense layers then 58 MoE layers of 256
# routed experts top-8 + 1 shared, one MTP module (the H100 recipe's layout "Et|(tt|)*30mL" has it).
DEEPSEEK_V3 = {"name": "DeepSeek-V3", "layers": 61, "hidden": 7168, "ffn": 18432, "heads": 128, "vocab": 129280,
               "experts": 256, "top_k": 8, "moe_ffn": 2048, "shared_experts": 1, "first_dense_layers": 3,
               "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
               "v_head_dim": 128, "mtp_heads": 1}

# The H100 of torchtitan's runs: 96 GB HBM2e at 2.4 TB/s and a 500 W power limit, whose peak lies
# "between SXM and NVL" (the source's own words); its clock factor against the H100 SXM's peaks is
# the one figure fitted for it (bench/published.py --fit), its efficiencies are the H100's.
# Its attention kernels (PyTorch SDPA's flash attention, ring attention under CP) get their own fitted
# efficiency: the runs up to 256k tokens are attention-bound.
GRAND_TETON = {"clock": 0.752, "attention_efficiency": 0.230}
H100_96GB_500W = {"preset": "H100-80GB", "name": "H100-96GB-500W", "hbm_gib": 95.0, "hbm_gbps": 2400,
                  "peak_tflops": 989 * GRAND_TETON["clock"], "fp8_tflops": 1979 * GRAND_TETON["clock"],
                  "attention_efficiency": GRAND_TETON["attention_efficiency"]}

# Framework settings, from the recipes (keys of the spec's `parallel`, plus training.full_recompute).
# Megatron-Bridge dense recipes: TP communication overlap (userbuffers), gradients reduced in bf16
# (grad_reduce_in_fp32 False), distributed optimizer with overlapped gradient reduce / param gather.
MB_DENSE = {"tp_overlap": 1.0, "grad_dtype": "bf16"}
# Megatron-Bridge Qwen3 / DeepSeek-V3 H100 recipes: tp_comm_overlap False, moe_a2a_overlap True
# (overlap_moe_expert_parallel_comm with delay_wgrad_compute); every MoE row is dropless with forced
# load balancing and runs without CUDA graphs. Dispatchers: alltoall (Qwen3-235B, Qwen3-30B 25.11),
# DeepEP (Qwen3-30B 26.02, DeepSeek-V3 25.09). Recompute: none (Qwen3), selective mla_up_proj + mlp (DeepSeek-V3, not
# modelled).
MB_MOE_OVERLAP = {"tp_overlap": 0.0, "ep_overlap": 1.0, "grad_dtype": "bf16"}
# GPT-OSS H100 (v0.4.0): no TP, alltoall dispatcher without all-to-all overlap, selective recompute of
# layernorm + moe_act (not modelled).
MB_MOE = {"grad_dtype": "bf16"}
# NeMo 24.07 launcher: ub_tp_comm_overlap True, mcore distributed optimizer, grad_sync_dtype bf16.
NEMO = {"tp_overlap": 1.0, "grad_dtype": "bf16"}
# torchtitan: FSDP2 (fp32 reduce), async TP, full activation checkpointing.
TITAN = {"optimizer": "fsdp", "grad_dtype": "fp32", "tp_overlap": 1.0, "full_recompute": True}


@dataclass(frozen=True)
class Run:
    """One published measurement: a configuration and its measured tokens/s per GPU."""

    id: str
    source: str
    where: str  # table / container / row, inside the source
    model: dict[str, Any]
    seq: int
    precision: str
    gpus: int
    tp: int
    pp: int
    mbs: int
    gbs: int
    measured: float  # tokens/s per GPU
    vp: int = 1
    cp: int = 1
    ep: int = 1
    settings: dict[str, Any] = field(default_factory=dict)
    hardware: str | dict[str, Any] = "H100-80GB"
    layers_per_stage: list[int] | None = None  # the framework's split when "uniform" is not it
    calibrates: str = ""  # the fitted figure (FIGURES) this run sets ("" = a check)
    family: str = "dense"  # dense | long-context | moe
    left_out: str = ""  # why the row cannot be reconstructed ("" = it can)

    @property
    def role(self) -> str:
        """What the row is for: the figure it calibrates, a check, or left out."""
        return self.calibrates or ("left out" if self.left_out else "check")

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.cp * self.pp)

    @property
    def microbatches(self) -> int:
        return self.gbs // (self.mbs * self.dp)

    @property
    def schedule(self) -> str:
        return "interleaved-1f1b" if self.vp > 1 else "1f1b"

    @property
    def layout(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"] + [f"{k}{v}" for k, v in
                                                     (("VP", self.vp), ("CP", self.cp), ("EP", self.ep)) if v > 1]
        return " ".join(parts)

    def spec(self, hardware: dict[str, Any] | None = None, cluster: dict[str, Any] | None = None) -> dict[str, Any]:
        """The run as a pipeplan spec (optionally with hardware / cluster overrides, for the fit)."""
        settings = dict(self.settings)
        full_recompute = settings.pop("full_recompute", False)
        hw = self.hardware if isinstance(self.hardware, dict) else {"preset": self.hardware}
        return {
            "format": "pipeplan.spec/v1",
            "model": {**self.model, "seq_len": self.seq, "micro_batch_size": self.mbs},
            "hardware": {**hw, **(hardware or {})},
            "cluster": {"preset": "DGX-H100", **(cluster or {})},
            "precision": self.precision,
            "parallel": {"tp": self.tp, "cp": self.cp, "ep": self.ep, "etp": 1 if self.ep > 1 else None,
                         "gpus": self.gpus, **settings},
            "training": {"devices": self.pp, "chunks": self.vp, "microbatches": self.microbatches,
                         "split_backward": True, "full_recompute": full_recompute,
                         "memory_budget_gib": 1e6},  # no limit: the bench compares the peak with the HBM
            "partition": self.layers_per_stage or "uniform",
        }


def megatron_split(blocks: int, stages: int) -> list[int] | None:
    """Layers per stage (embedding and head counted as layers) when Megatron must count them to split
    evenly (account_for_embedding/loss_in_pipeline_split); None when the blocks split evenly."""
    if blocks % stages == 0:
        return None
    assert (blocks + 2) % stages == 0, (blocks, stages)
    return [(blocks + 2) // stages] * stages


RUNS: list[Run] = [
    # ---- Megatron-Bridge (NeMo containers 25.09-26.06), DGX-H100 -----------------------------------
    Run("llama3-70b-gbs256", "mbridge", "26.04.01, LLAMA3_70B", LLAMA3_70B, 8192, "fp8", 64, 4, 8, 1, 256, 1664,
        vp=5, settings=MB_DENSE, calibrates="matmul_efficiency"),
    Run("llama3-70b-gbs128", "mbridge", "25.11, DGX-H100 table", LLAMA3_70B, 8192, "fp8", 64, 4, 8, 1, 128, 1602,
        vp=5, settings=MB_DENSE),
    Run("llama3.1-405b-gbs1536", "mbridge", "26.06, LLAMA3.1_405B", LLAMA31_405B, 8192, "fp8", 1024, 8, 8, 1,
        1536, 326, vp=8, cp=2, settings=MB_DENSE, layers_per_stage=megatron_split(126, 64)),
    Run("llama3.1-405b-gbs512", "mbridge", "25.11, DGX-H100 table", LLAMA31_405B, 8192, "fp8", 1024, 8, 8, 1, 512,
        292, vp=8, cp=2, settings=MB_DENSE, layers_per_stage=megatron_split(126, 64)),
    Run("gpt-oss-120b-gbs1280", "mbridge", "26.04.01, GPT OSS 120B", GPT_OSS_120B, 4096, "bf16", 64, 1, 4, 1, 1280,
        5824, ep=8, settings=MB_MOE, family="moe"),
    Run("qwen3-30b-a3b-vp12", "mbridge", "26.02.01, Qwen3_30B_a3B", QWEN3_30B_A3B, 4096, "fp8", 16, 1, 2, 1, 1024,
        9058, vp=12, ep=8, settings=MB_MOE_OVERLAP, calibrates="moe_host_ms", family="moe"),
    # The 25.11 table says MBS 2, VP 24 (GA 32); every 25.11-era recipe (tags v0.2.0-v0.2.2) sets PP 2,
    # VP 12 and the default MBS 1 for this model on H100. Per token it ran as slowly as the 26.02 row at
    # the recipe's layout (5,113 tokens/s/GPU, PP 2 VP 12 EP 8 MBS 1), which 26.02.01 ran at 9,058.
    Run("qwen3-30b-a3b-vp24", "mbridge", "25.11, DGX-H100 table", QWEN3_30B_A3B, 4096, "fp8", 16, 1, 2, 2, 512,
        5275, vp=24, ep=8, settings=MB_MOE_OVERLAP, family="moe",
        left_out="table (MBS 2, VP 24) contradicts its recipe (tag v0.2.0: MBS 1, VP 12)"),
    Run("qwen3-235b-a22b-gbs8192", "mbridge", "26.04.01, Qwen3_235B_a22B", QWEN3_235B_A22B, 4096, "fp8", 256, 2, 8,
        1, 8192, 1712, vp=4, ep=32, settings=MB_MOE_OVERLAP, layers_per_stage=megatron_split(94, 32),
        calibrates="bus_efficiency", family="moe"),
    Run("qwen3-235b-a22b-gbs2048", "mbridge", "25.11, DGX-H100 table", QWEN3_235B_A22B, 4096, "fp8", 256, 2, 8, 1,
        2048, 1575, vp=4, ep=32, settings=MB_MOE_OVERLAP, layers_per_stage=megatron_split(94, 32), family="moe"),
    Run("deepseek-v3", "mbridge", "25.09, DGX-H100 table (dropless)", DEEPSEEK_V3, 4096, "fp8", 1024, 2, 8, 1, 8192,
        1297, vp=4, ep=64, settings={**MB_MOE_OVERLAP, "overlap_grad_reduce": False}, layers_per_stage=[2] * 32,
        family="moe"),
    # ---- NeMo 24.07, DGX-H100, FP8 -------------------------------------------------------------------
    Run("gpt3-175b-128gpu", "nemo2407", "Pretraining, GPT3-175B, 128 GPUs", GPT3_175B, 2048, "fp8", 128, 4, 8, 1,
        256, 716, vp=6, settings=NEMO),
    Run("gpt3-175b-512gpu", "nemo2407", "Pretraining, GPT3-175B, 512 GPUs", GPT3_175B, 2048, "fp8", 512, 4, 8, 2,
        2048, 825, vp=6, settings=NEMO),
    Run("llama2-13b", "nemo2407", "Pretraining, LLAMA2-13B", LLAMA2_13B, 4096, "fp8", 16, 1, 4, 1, 128, 8715,
        vp=10, settings=NEMO),
    Run("llama2-70b", "nemo2407", "Pretraining, LLAMA2-70B", LLAMA2_70B, 4096, "fp8", 64, 4, 4, 1, 128, 1728,
        vp=20, settings=NEMO),
    Run("nemotron-22b", "nemo2407", "Pretraining, Nemotron-22B", NEMOTRON_22B, 4096, "fp8", 64, 2, 4, 2, 256, 4312,
        vp=10, settings=NEMO),
    Run("nemotron4-340b", "nemo2407", "Pretraining, Nemotron-340B", NEMOTRON4_340B, 4096, "fp8", 128, 8, 8, 1, 32,
        326, vp=12, settings=NEMO),
    Run("llama3-70b-cp2", "nemo2407", "Pretraining, LLAMA3-70B", LLAMA3_70B, 8192, "fp8", 64, 4, 4, 1, 128, 1524,
        vp=5, cp=2, settings=NEMO),
    # ---- torchtitan, Llama 3.1 405B on 512 H100 (FSDP 8 x TP 8 x PP 8; n_microbatches = PP = 8) ------
    Run("titan-405b-1f1b", "torchtitan", "Table 5, 1F1B", LLAMA31_405B, 8192, "fp8", 512, 8, 8, 4, 256, 100,
        settings=TITAN, hardware=H100_96GB_500W, layers_per_stage=[16] * 8,
        calibrates="clock"),
    Run("titan-405b-interleaved", "torchtitan", "Table 5, Interleaved 1F1B", LLAMA31_405B, 8192, "fp8", 512, 8, 8,
        4, 256, 128, vp=2, settings=TITAN, hardware=H100_96GB_500W, layers_per_stage=[8] * 16),
    Run("titan-405b-32k", "torchtitan", "Table 6, FSDP 8, CP 1", LLAMA31_405B, 32768, "fp8", 512, 8, 8, 1, 64, 76,
        settings=TITAN, hardware=H100_96GB_500W, layers_per_stage=[16] * 8, family="long-context"),
    Run("titan-405b-64k-cp2", "torchtitan", "Table 6, FSDP 4, CP 2", LLAMA31_405B, 65536, "fp8", 512, 8, 8, 1, 32,
        47, cp=2, settings=TITAN, hardware=H100_96GB_500W, layers_per_stage=[16] * 8, family="long-context"),
    Run("titan-405b-128k-cp4", "torchtitan", "Table 6, FSDP 2, CP 4", LLAMA31_405B, 131072, "fp8", 512, 8, 8, 1, 16,
        31, cp=4, settings=TITAN, hardware=H100_96GB_500W, layers_per_stage=[16] * 8, family="long-context",
        calibrates="attention_efficiency"),
    Run("titan-405b-256k-cp8", "torchtitan", "Table 6, FSDP 1, CP 8", LLAMA31_405B, 262144, "fp8", 512, 8, 8, 1, 8,
        16, cp=8, settings=TITAN, hardware=H100_96GB_500W, layers_per_stage=[16] * 8, family="long-context"),
]

# The fitted figures, where each lives, and why its run: one run each, chosen by what the figure
# means (not by the checks' errors).
FIGURES = {
    "matmul_efficiency": "H100's achieved fraction of its FP8 and of its 16-bit peak (planner/spec.py"
                         " H100_EFFICIENCY: fp8_efficiency = bf16_efficiency); the newest dense FP8 run",
    "bus_efficiency": "DGX-H100 links (CLUSTER_EFFICIENCY); the newest MoE run whose all-to-alls cross nodes",
    "clock": "torchtitan's 500 W H100 against the SXM peaks (GRAND_TETON); its 1F1B run",
    "attention_efficiency": "torchtitan's attention kernels (GRAND_TETON); its middle long-context run",
    "moe_host_ms": "the host's time to issue one MoE layer pass (planner/spec.py H100_HOST); the newest run of"
                   " the smallest MoE layers (hidden 2048, experts of 768), where the host shows most",
}

# The published pair that differs only in the schedule (torchtitan Table 5).
SCHEDULE_PAIR = ("titan-405b-1f1b", "titan-405b-interleaved")


def find(run_id: str) -> Run:
    for run in RUNS:
        if run.id == run_id:
            return run
    raise KeyError(f"no run {run_id!r}; runs: {', '.join(r.id for r in RUNS)}")
