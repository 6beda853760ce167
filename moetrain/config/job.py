"""The whole job: one dataclass per concern, composed, with the checks that span sections."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from moetrain.config.base import require
from moetrain.config.checkpoint import CheckpointConfig
from moetrain.config.classify import ClassifyConfig
from moetrain.config.data import DataConfig
from moetrain.config.dp import DataParallelConfig, check_grad_compression
from moetrain.config.finetune import FinetuneConfig
from moetrain.config.log import LogConfig
from moetrain.config.model import ModelConfig, tensor_parallel_errors
from moetrain.config.moe import MoEConfig
from moetrain.config.optim import OptimConfig, check_muon
from moetrain.config.parallel import ParallelConfig, check_rebalancing
from moetrain.config.pipeline import check_microbatches, check_pipeline_model, check_pipeline_reduction
from moetrain.config.train import TrainConfig
from moetrain.config.zero import ZeroConfig, check_bucket_sizes, check_offload


def check_sequence_split(seq_len: int, *, tp: int) -> None:
    """Sequence parallelism splits every sequence evenly over the tp ranks."""
    require(seq_len % tp == 0, "data.seq_len", seq_len,
            f"must be a multiple of parallel.tp ({tp}): sequence parallelism splits every sequence evenly "
            "over the tp ranks")


def check_mtp_split(mtp_depth: int, seq_len: int, *, tp: int) -> None:
    """Each multi-token depth k pads its last k positions; every tp rank must keep a scored one."""
    require(tp == 1 or mtp_depth < seq_len // tp, "model.mtp_depth", mtp_depth,
            f"must be < data.seq_len / parallel.tp ({seq_len // tp}): depth k pads its last "
            "k positions, which must leave every tp rank a scored one")


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """Transformer backbone (sizes, positions, head, which blocks are MoE)."""

    moe: MoEConfig = field(default_factory=MoEConfig)
    """The MoE FFN of the MoE blocks (unused when model.moe_every is 0)."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel degrees (dp, ep, zero_stage, ...)."""

    zero: ZeroConfig = field(default_factory=ZeroConfig)
    """ZeRO/FSDP offload and bucket settings."""

    dp: DataParallelConfig = field(default_factory=DataParallelConfig)
    """Data-parallel gradient reduction (compression)."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""

    train: TrainConfig = field(default_factory=TrainConfig)
    """Steps, batch, precision, device, activation checkpointing."""

    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    """Parameter-efficient fine-tuning: LoRA adapters on chosen projections, base weights frozen."""

    data: DataConfig = field(default_factory=DataConfig)
    """Corpus, tokenizer and loader."""

    classify: ClassifyConfig = field(default_factory=ClassifyConfig)
    """Text classification (model.head = "classifier"): labelled-data fields, the classifier's tokenizer,
    class-balanced sampling, token dropout, label smoothing. Not read by a language model."""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint folder, cadence, retention and resume."""

    log: LogConfig = field(default_factory=LogConfig)
    """Run folder and metric sinks."""

    def __post_init__(self) -> None:
        m, par = self.model, self.parallel
        # How parallel.ep splits the world and the experts is ParallelDims's rule (it knows the world).
        require(m.is_moe or par.ep == 1, "parallel.ep", par.ep, "must be 1 for a dense model (model.moe_every = 0)")
        require(m.is_moe or par.etp == 1, "parallel.etp", par.etp, "must be 1 for a dense model (model.moe_every = 0)")
        require(par.etp == 1 or self.moe.capacity_factor is None, "moe.capacity_factor", self.moe.capacity_factor,
                f"must be null with parallel.etp ({par.etp}) > 1: expert tensor parallelism is dropless")
        require(not m.is_moe or self.moe.expert_hidden_dim % par.etp == 0, "moe.expert_hidden_dim",
                self.moe.expert_hidden_dim, f"must be a multiple of parallel.etp ({par.etp}): each rank holds "
                "1/etp of every expert's hidden dim")
        require(self.data.seq_len <= m.max_seq_len, "data.seq_len", self.data.seq_len,
                f"must be <= model.max_seq_len ({m.max_seq_len})")
        if m.head == "classifier" and self.data.tokenizer != DataConfig.tokenizer:
            warnings.warn(f"data.tokenizer ({self.data.tokenizer!r}) is ignored by a classifier: it tokenises with "
                          f"classify.tokenizer ({self.classify.tokenizer!r})", stacklevel=2)
        # A classifier's vocabulary comes from classify.tokenizer, checked when the model is built.
        # A Hugging Face tokenizer.json brings its own vocabulary: checked against the model when it is built.
        if m.vocab_size is not None and m.head != "classifier" and not self.data.tokenizer.endswith(".json"):
            if self.data.tokenizer == "bytes":
                tok_vocab, source = 256, 'data.tokenizer="bytes"'
            else:
                tok_vocab, source = self.data.vocab_size, "data.vocab_size"
            require(m.vocab_size >= tok_vocab, "model.vocab_size", m.vocab_size,
                    f"must be >= the tokenizer vocabulary ({tok_vocab}, from {source})")
        check_sequence_split(self.data.seq_len, tp=par.tp)
        require(m.mtp_depth < self.data.seq_len, "model.mtp_depth", m.mtp_depth,
                f"must be < data.seq_len ({self.data.seq_len}): depth k scores the tokens k + 1 places ahead")
        check_mtp_split(m.mtp_depth, self.data.seq_len, tp=par.tp)
        if tp_errors := tensor_parallel_errors(m, par.tp, moe=self.moe):
            raise ValueError("; ".join(tp_errors))
        if par.dp != -1:
            self.train.grad_accum_steps(par.dp)
        check_offload(par.zero_stage, offload_optimizer=self.zero.offload_optimizer == "cpu",
                      offload_param=self.zero.offload_param == "cpu", pp=par.pp)
        check_bucket_sizes(self.zero.reduce_bucket_size, self.zero.allgather_bucket_size, zero_stage=par.zero_stage,
                           tp=par.tp, pp=par.pp)
        check_grad_compression(self.dp.grad_compression, zero_stage=par.zero_stage, tp=par.tp)
        check_muon(self.optim.name, tp=par.tp, etp=par.etp, grad_compression=self.dp.grad_compression,
                   zero_stage=par.zero_stage, offload_optimizer=self.zero.offload_optimizer,
                   offload_param=self.zero.offload_param)
        placed = [("log.routing_trace", "full")] if self.log.routing_trace == "full" else []
        if m.is_moe and self.moe.routing_replay is not None:
            placed.append(("moe.routing_replay", self.moe.routing_replay))
        if m.is_moe and self.moe.force_skew != "none":
            placed.append(("moe.force_skew", self.moe.force_skew))
        require(not (m.is_moe and self.moe.is_expert_choice and self.log.routing_trace == "full"),
                "log.routing_trace", self.log.routing_trace,
                'must be "counts" or "off" with moe.router "expert_choice" (experts pick tokens: no top-k per token)')
        for field_, value in placed:
            require(par.pp == 1 and m.head == "lm", field_, value,
                    f"needs parallel.pp = 1 and model.head = 'lm' (got pp={par.pp}, head={m.head!r}): token ids are "
                    "placed by the sequences of the global batch each rank's micro-batches hold")
        check_rebalancing(par, num_experts=self.moe.num_experts, rebalance_every=self.moe.rebalance_every,
                          is_moe=m.is_moe, expert_choice=self.moe.is_expert_choice,
                          grad_compression=self.dp.grad_compression)
        check_pipeline_model(m, pp=par.pp, virtual_stages=par.pp_virtual_stages)
        check_pipeline_reduction(pp=par.pp, grad_compression=self.dp.grad_compression)
        if m.head == "classifier":
            require(self.data.sources is None, "data.sources", "(set)",
                    'needs model.head = "lm": a classifier reads one labelled corpus (data.corpus)')
            require(not self.data.document_mask, "data.document_mask", self.data.document_mask,
                    'needs model.head = "lm": a classifier\'s examples are not packed')
        self._check_lora()
        # "auto" on a machine without CUDA resolves to cpu: refused when the processes start.
        require(par.backend != "nccl" or self.train.device != "cpu", "parallel.backend", par.backend,
                'needs train.device "cuda" or "auto" (train.device is "cpu"): NCCL runs on GPUs only; use "gloo" '
                'or "auto"')
        # The compiled blocks' graphs return DTensor outputs that alias each other, which aot_autograd
        # refuses at the first step (torch 2.x: "ANY output aliasing ... if there are any subclass outputs").
        require(not self.train.compile or par.tp == 1, "parallel.tp", par.tp,
                "must be 1 with train.compile: true: torch.compile cannot compile the tensor-parallel blocks "
                "(their DTensor outputs alias each other, which aot_autograd does not support)")
        ckpt = self.train.activation_checkpointing
        require(ckpt != "moe" or m.is_moe, "train.activation_checkpointing", ckpt,
                'cannot be "moe" for a dense model (model.moe_every = 0)')

    def _check_lora(self) -> None:
        par = self.parallel
        require(not self.finetune.enabled or par.tp == 1, "parallel.tp", par.tp,
                "must be 1 with LoRA (finetune.lora_rank > 0): the adapters are not split by tensor parallelism")
        lora_experts = self.finetune.lora_rank > 0 and "experts" in self.finetune.lora_targets
        require(not lora_experts or par.etp == 1, "parallel.etp", par.etp,
                "must be 1 with LoRA on the routed experts (finetune.lora_targets): the adapters are not split by etp")
        require(not lora_experts or self.moe.expert_lr_scale_max == 1.0, "moe.expert_lr_scale_max",
                self.moe.expert_lr_scale_max, "must be 1.0 with LoRA on the routed experts (finetune.lora_targets): "
                "the per-expert learning rate scales the expert weights, which LoRA freezes")
        only_experts = self.finetune.lora_targets == ("experts",) and self.model.head != "classifier"
        require(not (self.finetune.enabled and only_experts and par.ep > 1) or self.dp.grad_compression == "none",
                "dp.grad_compression", self.dp.grad_compression,
                f'must be "none" with LoRA on the routed experts only (finetune.lora_targets) at parallel.ep '
                f"({par.ep}) > 1: no replicated gradient is left to compress (the expert adapters are ep shards, "
                "reduced uncompressed after the backward)")

    def data_parallel_size(self, world_size: int) -> int:
        """Ranks that see different data: parallel.dp, or world / (tp * pp) when dp is -1 (auto)."""
        par = self.parallel
        if par.dp != -1:
            return par.dp
        require(world_size % (par.tp * par.pp) == 0, "parallel.tp * parallel.pp", par.tp * par.pp,
                f"must divide the world size ({world_size})")
        return world_size // (par.tp * par.pp)

    def grad_accum_steps(self, world_size: int) -> int:
        """Micro-batches per optimizer step on each rank for ``world_size`` processes, checked: they
        split the global batch, and under pp they are a count the schedule accepts."""
        num_microbatches = self.train.grad_accum_steps(self.data_parallel_size(world_size))
        if self.parallel.pp > 1:
            check_microbatches(self.parallel.pp_schedule, num_microbatches=num_microbatches, pp=self.parallel.pp)
        return num_microbatches
