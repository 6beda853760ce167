"""The user's job made CPU-sized for ``moetrain verify``: fewer layers and smaller widths, vocabulary
and sequences, with every setting that changes the math of a step kept as it is.

Kept: experts and top_k, the router (type, groups, bias updates, capacity factor and drop policy,
shared experts and their gate), the aux-loss types and coefficients, dense and MoE blocks (two MoE
blocks and a dense one where the job has dense blocks: ``_blocks``), the attention kind (MLA stays
MLA, GQA keeps its ratio, its key/value heads a multiple of every layout's tp), dtype, dispatch
dtype, gradient and dispatch compression, the optimizer, LoRA targets, activation checkpointing.

Changed, and printed by ``moetrain verify``: widths and layer count, the vocabulary (the byte
tokenizer on the shipped Shakespeare corpus, so that no user data is needed), sequence length and
batch, an init_from export (cut to the new shapes: ``init_export``), and the warmup (one step, so
that the few steps verified move the weights by a full learning rate and a layout bug shows in
them). Settings random per rank by design are set to 0 and named with the reason
(``RANDOM_PER_RANK``): no layout can reproduce another's draws.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from moetrain.config.convert import config_from_dict, config_to_dict
from moetrain.config.job import JobConfig
from moetrain.verify.init_export import PLACEHOLDER

GLOBAL_BATCH = 8
"""Sequences per step of the shrunk job (every layout's dp divides it)."""

GRAD_ACCUM = 2
"""Micro-batches per step: every layout runs 8 / 2 = 4 sequences per micro-batch summed over its dp
ranks, the same micro-batches a single process runs (the aux loss of a micro-batch depends on
which sequences it holds), and a pipeline of 2 stages has its 2 micro-batches."""

RANDOM_PER_RANK = {
    "moe.router_noise_std": "each rank draws its own router noise, so no layout reproduces another's routing",
    "moe.router_jitter": "each rank draws its own multiplicative jitter of the router input",
    "model.dropout": "each rank draws its own dropout masks",
    "classify.token_dropout": "each rank draws its own dropped tokens",
}
"""Fields whose randomness differs by rank by design: set to 0 for the comparison, with the reason."""


@dataclass(frozen=True)
class Change:
    field: str
    old: object
    new: object
    why: str

    def line(self) -> str:
        return f"{self.field}: {self.old!r} -> {self.new!r} ({self.why})"


def _small(value: int | None, cap: int) -> int | None:
    return None if value is None else min(value, cap)


def _blocks(cfg: JobConfig, steps: list[int]) -> list[bool]:
    """The shrunk model's blocks, True for an MoE block: the job's blocks in order with each run of
    dense blocks cut to one, until two MoE blocks and (when the job has any) a dense block are in;
    then the job's following blocks (MoE blocks past its last) up to a multiple of every layout's
    pipeline stages (``steps``: pp * pp_virtual_stages each)."""
    m = cfg.model
    kinds = [m.is_moe_layer(i) for i in range(m.num_layers)]
    rest: Iterator[bool] = iter([])
    if not m.is_moe:
        want = 2
        out: list[bool] = []
    else:
        has_dense = not all(kinds)
        out = []
        for i, moe in enumerate(kinds):
            if sum(out) >= 2 and (not has_dense or not all(out)):
                rest = iter(kinds[i:])
                break
            if (moe and sum(out) < 2) or (not moe and (not out or out[-1])):
                out.append(moe)
        want = len(out)
    step = 1
    for n in steps:
        step = step * n // _gcd(step, n)
    target = -(-max(want, 1) // step) * step
    if not m.is_moe:
        return [False] * target
    while len(out) < target:
        out.append(next(rest, True))
    return out


def _layer_plan(cfg: JobConfig, steps: list[int]) -> list[tuple[str, object, str]]:
    """num_layers, moe_every, moe_layer_offset and dense_layers of the shrunk model (``_blocks``):
    the job's moe_every and leading dense blocks where they describe it, else MoE blocks from the
    first one with the other dense blocks named in dense_layers."""
    m = cfg.model
    blocks = _blocks(cfg, steps)
    why = "depth: two MoE blocks (and a dense one where the job has dense blocks), a multiple of every layout's " \
          "pp * pp_virtual_stages"
    if not m.is_moe:
        return [("model.num_layers", len(blocks), why), ("model.dense_layers", (), why)]
    lead = blocks.index(True)
    every = m.moe_every
    if blocks != [i >= lead and (i - lead) % every == 0 for i in range(len(blocks))]:
        every = 1
    dense = tuple(i for i, moe in enumerate(blocks) if not moe and i >= lead and (i - lead) % every == 0)
    return [("model.num_layers", len(blocks), why), ("model.moe_every", every, why),
            ("model.moe_layer_offset", lead, why), ("model.dense_layers", dense, why)]


def _heads(model: dict, tp: int) -> tuple[int, int | None, str]:
    """Query and key/value heads of the shrunk model: about 4 query heads (at most 8), the key/value heads a
    multiple of ``tp`` (the largest tensor-parallel degree of the layouts: each tp rank holds whole
    key/value heads) and the job's grouped-query ratio kept; the reason, as printed."""
    heads, kv = model["num_heads"], model["num_kv_heads"]
    if kv is None or heads % kv:
        new = -(-min(heads, 4) // tp) * tp
        return new, None if kv is None else max(tp, new * kv // heads // tp * tp), f"width, a multiple of tp ({tp})"
    ratio = heads // kv
    new_kv = max(1, min(kv, 4 // ratio))
    new_kv = -(-new_kv // tp) * tp
    # At most 8 query heads (8 values each at the shrunk width of 64): a multi-query job's ratio
    # (e.g. 64) would keep every query head, of size 1.
    kept = min(ratio, max(1, 8 // new_kv))
    why = (f"keeps the grouped-query ratio ({ratio})" if kept == ratio
           else f"a grouped-query ratio of {kept} (the job's {ratio} would keep {ratio * new_kv} query heads)")
    return new_kv * kept, new_kv, f"width; {why} with key/value heads a multiple of the layouts' largest tp ({tp})"


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def shrink_job(cfg: JobConfig, *, pps: list[int], cpu: bool, tps: Sequence[int] = ()) -> tuple[JobConfig, list[Change]]:
    """``cfg`` made CPU-sized (module docstring); returns the new config and what changed. ``pps``:
    the pipeline degrees of the layouts to verify (the layer count is a multiple of each), ``tps``
    their tensor-parallel degrees (the heads and key/value heads are multiples of the largest).
    ``cpu``: no accelerator here, so the job runs on the CPU."""
    raw = config_to_dict(cfg)
    m, moe, data = raw["model"], raw["moe"], raw["data"]
    heads, new_kv, heads_why = _heads(m, max([1, *tps]))
    virtual = raw["parallel"]["pp_virtual_stages"]
    steps = [pp * virtual if pp > 1 else 1 for pp in pps]
    width = min(m["dim"], 64)
    # Without an explicit head_dim the model divides dim by the heads; a kept ratio of 3 gives 3 heads.
    keep = m["head_dim"] is not None or (width % heads == 0 and width // heads >= 8) or m["attention"] == "mla"
    head_dim = _small(m["head_dim"], 16) if keep else 16
    seq = min(data["seq_len"], 32)
    etp = raw["parallel"]["etp"]
    plan: list[tuple[str, object, str]] = [
        ("model.preset", None, "the preset's sizes are replaced below"),
        ("model.dim", width, "width"),
        ("model.num_heads", heads, heads_why),
        ("model.num_kv_heads", new_kv, heads_why),
        ("model.head_dim", head_dim, "width" if m["head_dim"] is not None else f"width: dim {width} is not a "
         f"multiple of {heads} heads"),
        *_layer_plan(cfg, steps),
        ("model.dense_hidden_dim", _small(m["dense_hidden_dim"], 128), "width"),
        ("model.max_seq_len", max(seq, 32), "sequence"),
        ("model.vocab_size", None, "the byte tokenizer's 256"),
        ("moe.expert_hidden_dim", max(etp, min(moe["expert_hidden_dim"], 32) // etp * etp), "width"),
        ("moe.shared_hidden_dim", _small(moe["shared_hidden_dim"], 32), "width"),
        ("data.corpus", "shakespeare", "the shipped corpus: no user data needed"),
        ("data.path", None, "the shipped corpus"),
        ("data.sources", None, "the shipped corpus"),
        ("data.tokenizer", "bpe" if data["document_mask"] else "bytes",
         "vocabulary (bpe where data.document_mask needs an end-of-text id)"),
        ("data.vocab_size", 512 if data["document_mask"] else data["vocab_size"], "vocabulary"),
        ("data.seq_len", seq, "sequence"),
        ("train.global_batch_size", GLOBAL_BATCH, "batch"),
        ("train.grad_accum", None, "derived per layout"),
        ("train.micro_batch_size", GLOBAL_BATCH // GRAD_ACCUM, "derived per layout"),
        ("train.eval_every", 0, "verify compares training steps"),
        ("train.compile", False, "compile time would dominate a few CPU steps"),
        ("optim.warmup_steps", min(raw["optim"]["warmup_steps"], 1),
         "a full learning rate from step 1, so the few steps move the weights"),
        ("log.every", 1, "a record per step"),
        ("log.tensorboard", False, "only metrics.jsonl is read"),
        ("log.progress_bar", False, "quiet runs"),
        ("log.report", False, "only metrics.jsonl and the checkpoints are read"),
        ("log.wandb", None, "no tracker for throwaway runs"),
        ("log.mlflow", None, "no tracker for throwaway runs"),
    ]
    if m["attention"] == "mla":  # the MLA widths act (and may be set) only with MLA attention
        plan += [("model.q_lora_rank", _small(m["q_lora_rank"], 32), "MLA width"),
                 ("model.kv_lora_rank", min(m["kv_lora_rank"], 32), "MLA width"),
                 ("model.qk_nope_head_dim", min(m["qk_nope_head_dim"], 16), "MLA width"),
                 ("model.qk_rope_head_dim", min(m["qk_rope_head_dim"], 8), "MLA width"),
                 ("model.v_head_dim", min(m["v_head_dim"], 16), "MLA width")]
    if cpu:
        plan += [("train.device", "cpu", "no accelerator here"), ("parallel.backend", "auto", "gloo on the CPU")]
    if cfg.checkpoint.init_from is not None:
        plan.append(("checkpoint.init_from", PLACEHOLDER, "the export cut to the shrunk shapes (leading rows and "
                     "channels, every expert, the first blocks of each kind), loaded at every layout"))
    plan += [(name, 0.0, f"random per rank by design: {why}") for name, why in RANDOM_PER_RANK.items()]
    changes = []
    for name, new, why in plan:
        section, field = name.split(".")
        old = raw[section][field]
        if isinstance(old, list):
            old = tuple(old)
        if old != new:
            raw[section][field] = list(new) if isinstance(new, tuple) else new
            changes.append(Change(name, old, new, why))
    return config_from_dict(raw), changes


def unshrunk_job(cfg: JobConfig) -> tuple[JobConfig, list[Change]]:
    """``--shrink none``: the job as it is, only its per-rank random settings set to 0 and its
    logging made per step (the comparison reads every step's record)."""
    raw = config_to_dict(cfg)
    changes = []
    plan: list[tuple[str, object, str]] = [("log.every", 1, "a record per step"),
                                           ("train.eval_every", 0, "verify compares training steps"),
                                           ("log.report", False, "only metrics.jsonl and the checkpoints are read")]
    plan += [(name, 0.0, f"random per rank by design: {why}") for name, why in RANDOM_PER_RANK.items()]
    for name, new, why in plan:
        section, field = name.split(".")
        if raw[section][field] != new:
            changes.append(Change(name, raw[section][field], new, why))
            raw[section][field] = new
    return config_from_dict(raw), changes
