"""Full-size configurations benchmarked metadata-only (DeepSeek-V3 671B, 128-1024 ranks) and the
published figures they are compared with."""
from __future__ import annotations

from dataclasses import dataclass, field

from ...core.layout import Layout

DEFAULT_OUT = "benchmarks"
NODE = 8    # GPUs per node for the pictures' aggregation

PUBLISHED = {
    "nemo_rl": [("NeMo RL refit, DeepSeek-V3 BF16, H100 (PP16xEP16 -> TP32xDP8)", "2.39-2.83 s"),
                ("NeMo RL broadcast baseline, same setup", "14.2-15.5 s"),
                ("NeMo RL on GB200", "1.93-2.59 s")],
    "nccl_m2n": [("nccl_m2n Reshard, DeepSeek-V3 on 256 GB200, hierarchical", "1.447 s"),
                 ("nccl_m2n Reshard, same, direct P2P", "3.838 s")],
}


# ----------------------------------------------------------------------------------- configurations

@dataclass
class FullSizeConfig:
    """One configuration: a model and two layout strings (:mod:`mcore_reshard.tools.layout_strings`),
    so that ``mcore-reshard plan`` plans the same (:meth:`cli_args`)."""
    name: str
    title: str
    src: str                    # description
    dst: str
    colocated: bool
    topology: str               # cost-model preset
    model_name: str             # a ``mcore-reshard plan --model`` preset, or "small" (:func:`small_config`)
    src_layout: str             # layout strings, bfloat16
    dst_layout: str
    note: str = ""
    tags: list = field(default_factory=list)

    def model(self):
        """The model's :class:`~mcore_reshard.targets.ModelConfig`."""
        if self.model_name == "small":
            return small_config()
        from ..cli import model_preset
        return model_preset(self.model_name)

    def build(self, cfg=None) -> tuple[Layout, Layout]:
        """(source, destination) layouts of ``cfg`` (default: :meth:`model`), destination after the
        source's ranks unless colocated."""
        from ..layout_strings import build, parse
        cfg = self.model() if cfg is None else cfg
        src, dst = parse(self.src_layout), parse(self.dst_layout)
        return (build(src, cfg, 0, "bfloat16"),
                build(dst, cfg, 0 if self.colocated else src.world(), "bfloat16"))

    def cli_args(self, config_path: str | None = None) -> list[str]:
        """``mcore-reshard`` arguments planning this configuration (``config_path``: a config.json of
        :meth:`model`, for a model that is no preset)."""
        model = ["--config", config_path] if config_path else ["--model", self.model_name]
        return (["plan", *model, "--src", self.src_layout, "--dst", self.dst_layout, "--dtype", "bfloat16"]
                + (["--colocated"] if self.colocated else []))


def replicate(layout: Layout, copies: int, stride: int) -> Layout:
    """``copies`` instances of ``layout``, instance i on ranks shifted by ``i * stride``."""
    from ..layout_strings import replicate as rep
    return rep(layout, copies, stride)


def kimi_k2_1t():
    """A Kimi-K2-like model: DeepSeek-V3's architecture at 1 T parameters (384 experts of 2048, 61
    layers, the first dense, 64 heads, vocabulary 163840; ``moonshotai/Kimi-K2-Instruct``'s config.json)."""
    from ...targets import dsv3_671b
    return dsv3_671b().with_(n_routed_experts=384, num_attention_heads=64, num_key_value_heads=64,
                             first_k_dense_replace=1, vocab_size=163840, num_nextn_predict_layers=0)


CONFIGS = {c.name: c for c in [
    FullSizeConfig("nccl_m2n", "nccl_m2n's DeepSeek-V3 setup, 128 -> 128 ranks (disaggregated)",
                   "Megatron tp=1 pp=4 ep=16 etp=1 dp=32 (edp=2), stages 16/15/15/15 layers, ranks 0-127",
                   "vLLM tp=8 dp=16 enable_expert_parallel (ep=128, 2 experts/rank), ranks 128-255",
                   False, "gb200_nvl72", "dsv3-671b", "tp=1,pp=4,ep=16,etp=1,dp=32,first=16,last=15", "vllm:tp=8,dp=16,ep",
                   note="nccl_m2n's published run uses 256 GB200 (128 training + 128 inference)"),
    FullSizeConfig("nemo_rl_ep", "NeMo RL's DeepSeek-V3 setup with vLLM expert parallelism, 256 -> 256 ranks",
                   "Megatron tp=1 pp=16 ep=16 etp=1 dp=16 (edp=1), stages 3/4x14/2 layers, ranks 0-255",
                   "vLLM tp=32 dp=8 enable_expert_parallel (ep=256, 1 expert/rank), ranks 256-511",
                   False, "dgx_h100", "dsv3-671b", "tp=1,pp=16,ep=16,etp=1,dp=16,first=3,last=2", "vllm:tp=32,dp=8,ep"),
    FullSizeConfig("nemo_rl", "NeMo RL's DeepSeek-V3 setup as published (vLLM TP32 x DP8, no EP), 256 -> 256 ranks",
                   "Megatron tp=1 pp=16 ep=16 etp=1 dp=16 (edp=1), stages 3/4x14/2 layers, ranks 0-255",
                   "vLLM tp=32 dp=8, no expert parallelism: every expert TP-sharded 256 ways (I/256 = 8 rows), "
                   "ranks 256-511", False, "dgx_h100", "dsv3-671b", "tp=1,pp=16,ep=16,etp=1,dp=16,first=3,last=2",
                   "vllm:tp=32,dp=8",
                   note="NeMo RL's grpo_dapomath17k_dsv3_megatron.yaml: vLLM tensor_parallel_size 32, no EP; "
                        "11.4M copies (every expert split 256 ways)"),
    FullSizeConfig("colocated_sglang", "Colocated: training TP2 PP8 EP32 on 512 ranks -> 64 SGLang engines on the same ranks",
                   "Megatron tp=2 pp=8 ep=32 etp=1 dp=32 (edp=2), stages 7/8x6/6 layers, ranks 0-511",
                   "64 x SGLang tp=8 dp=8 ep=8 --enable-dp-attention (one engine per 8-GPU node, ranks 8i..8i+7)",
                   True, "dgx_h100", "dsv3-671b", "tp=2,pp=8,ep=32,etp=1,dp=32,first=7,last=6",
                   "sglang:tp=8,dp=8,ep=8,dpattn,replicas=64",
                   note="in BF16 every GPU would hold 188 GB of weights (1/8 of the experts + replicated attention): "
                        "this engine shape serves DeepSeek-V3 in FP8 on larger GPUs; planned in BF16 as given"),
    FullSizeConfig("colocated_sglang_ep32", "Colocated, an SGLang shape that fits BF16 on 80 GB: training TP2 PP8 EP32 "
                   "-> 16 SGLang engines of 32 ranks on the same 512 ranks",
                   "Megatron tp=2 pp=8 ep=32 etp=1 dp=32 (edp=2), stages 7/8x6/6 layers, ranks 0-511",
                   "16 x SGLang tp=32 dp=8 ep=32 --enable-dp-attention (attention TP 4; engine k on ranks 32k..32k+31)",
                   True, "dgx_h100", "dsv3-671b", "tp=2,pp=8,ep=32,etp=1,dp=32,first=7,last=6",
                   "sglang:tp=32,dp=8,ep=32,dpattn,replicas=16",
                   note="~52 GB of BF16 weights per GPU (TP8 EP8 engines would need 188 GB per GPU)"),
    FullSizeConfig("train1024", "1024-rank training -> 4 vLLM wide-EP replicas on the same ranks",
                   "Megatron tp=2 pp=16 ep=64 etp=1 dp=32 (edp=1), stages 3/4x14/2 layers, ranks 0-1023",
                   "4 x vLLM tp=8 dp=32 enable_expert_parallel (ep=256), replica k on ranks 256k..256k+255",
                   True, "dgx_h100", "dsv3-671b", "tp=2,pp=16,ep=64,etp=1,dp=32,first=3,last=2",
                   "vllm:tp=8,dp=32,ep,replicas=4"),
    FullSizeConfig("kimi_k2", "Kimi-K2-like 1 T model (384 experts, 61 layers) on 2048 ranks, colocated: "
                   "training -> 16 vLLM replicas", "Megatron tp=2 pp=16 ep=64 etp=1 dp=64 (edp=2), stages 3/4x14/2 "
                   "layers, ranks 0-2047", "16 x vLLM tp=8 dp=16 enable_expert_parallel (ep=128, 3 experts/rank), "
                   "replica k on ranks 128k..128k+127", True, "dgx_h100", "kimi-k2-1t",
                   "tp=2,pp=16,ep=64,etp=1,dp=64,first=3,last=2", "vllm:tp=8,dp=16,ep,replicas=16",
                   note="model: bench.kimi_k2_1t() (DeepSeek-V3 architecture, Kimi-K2's sizes); planned metadata-only"),
    FullSizeConfig("small", "Smoke: DeepSeek-V3 shapes scaled down, 16 -> 16 ranks",
                   "Megatron tp=1 pp=4 ep=4 etp=1 dp=4, ranks 0-15", "vLLM tp=4 dp=4 EP, ranks 16-31",
                   False, "dgx_h100", "small", "tp=1,pp=4,ep=4,etp=1,dp=4,first=1,last=1", "vllm:tp=4,dp=4,ep"),
]}
FULL_SIZE_DEFAULT = ["nccl_m2n", "nemo_rl_ep", "train1024", "colocated_sglang", "colocated_sglang_ep32", "nemo_rl"]


def small_config():
    """DeepSeek-V3 with every width divided down (4 MTP-less layers, 16 experts)."""
    from ...targets import dsv3_671b
    return dsv3_671b().with_(hidden_size=256, num_hidden_layers=4, vocab_size=1024, num_attention_heads=8,
                             num_key_value_heads=8, intermediate_size=512, n_routed_experts=16,
                             moe_intermediate_size=64, first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=32,
                             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_nextn_predict_layers=0)

