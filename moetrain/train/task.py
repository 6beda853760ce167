"""What differs between the two tasks a run can train: language modelling (``model.head = "lm"``) over a
token stream, and classification (``model.head = "classifier"``) over labelled examples. Both go
through the same trainer, layouts and checkpoints; here are their data and loaders."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from moetrain.config import JobConfig
from moetrain.config.loader import save_config
from moetrain.config.model import ModelConfig
from moetrain.data import prepare_data
from moetrain.data.classify_data import prepare_labelled, prepare_labelled_lm
from moetrain.data.registry import CORPORA
from moetrain.data.tokenizer import save_tokenizer
from moetrain.distributed import runtime
from moetrain.models.lora import apply_lora
from moetrain.models.transformer import Transformer
from moetrain.train.classification import CLASSES_FILE, check_run_classes, write_classes


def is_classifier(cfg: JobConfig) -> bool:
    return cfg.model.head == "classifier"


def build_task_data(cfg: JobConfig, *, is_main: bool):
    """The prepared data of ``cfg``'s task: labelled splits (``PreparedLabelled``) for a classifier, token
    streams (``PreparedData``) for a language model (on a labelled corpus: its train split's texts, see
    ``prepare_labelled_lm``). Rank 0 fetches and tokenises (once, then cached);
    the others wait and read the cache."""
    corpus = CORPORA.get(cfg.data.corpus)
    # A language model on a labelled corpus pretrains on its train split's texts alone, tokenised as the
    # classifier of the same data and classify sections will be (the pretrain-then-classify route).
    pretrain = not is_classifier(cfg) and corpus is not None and corpus.is_labelled

    def prepare(download: bool):
        if is_classifier(cfg):
            return prepare_labelled(cfg.data, cfg.classify, download=download)
        if pretrain:
            return prepare_labelled_lm(cfg.data, cfg.classify, download=download)
        return prepare_data(cfg.data, download=download)

    data = prepare(True) if is_main else None
    runtime.barrier()
    return data if is_main else prepare(False)


def build_loaders(cfg: JobConfig, data, *, grad_accum: int, dp_rank: int, dp_size: int):
    """(train loader, validation loader) of this rank. The train loader's position counts optimizer
    steps of the global batch, so a checkpoint resumes at another data-parallel size on the same
    batches (the accumulation adapts). A classifier has no validation loader: it evaluates whole
    splits (``moetrain.train.evaluate.evaluate_classifier``)."""
    t = cfg.train
    args = {"global_batch_size": t.global_batch_size, "micro_steps": grad_accum, "dp_rank": dp_rank,
            "dp_size": dp_size, "seed": t.seed}
    if is_classifier(cfg):
        c = cfg.classify
        return data.train_loader(**args, balanced=c.balanced_sampling, token_dropout=c.token_dropout), None
    val = data.val_loader(global_batch_size=t.micro_batch_size * dp_size, dp_rank=dp_rank, dp_size=dp_size)
    return data.train_loader(**args), val


def build_model(cfg: JobConfig, data) -> tuple[ModelConfig, Transformer]:
    """The resolved model config and the full single-device model of ``cfg`` for ``data`` (the
    vocabulary from its tokenizer, the document separator from its end-of-text id), LoRA adapters
    included: what training and `moetrain eval` both build before ``parallelize``. Every rank builds it
    from the same seed, so the global weights are the same for every layout."""
    model_config = cfg.model.with_vocab_size(data.vocab_size)
    if cfg.data.document_mask:  # attention within each packed document (the data's eos id)
        model_config = dataclasses.replace(model_config, document_separator=data.document_separator)
    model = Transformer(model_config, moe=cfg.moe if model_config.is_moe else None, seed=cfg.train.seed)
    apply_lora(model, cfg.finetune, seed=cfg.train.seed)  # adapters + frozen base; no-op at lora_rank 0
    return model_config, model


def write_run_record(cfg: JobConfig, data, run_dir: Path, *, resumed: bool, is_main: bool) -> None:
    """The run folder's record of the job: its config.yaml, the tokenizer (generate and export decode
    without the corpus) and a classifier's classes.json. Written once the run has started or resumed,
    so that a relaunch the checkpoint refuses leaves the folder as it was. A classifier resumed on
    data whose classes differ from its classes.json is refused (the head's row i is its class i)."""
    if is_classifier(cfg) and resumed:
        check_run_classes(data.classes, run_dir)
    start = cfg.checkpoint.init_from
    if is_classifier(cfg) and not resumed and start and not cfg.checkpoint.init_from_new_head \
            and (Path(start) / CLASSES_FILE).is_file():  # a classifier's export, its head kept
        check_run_classes(data.classes, start)
    if not is_main:
        return
    save_config(cfg, run_dir / "config.yaml")
    save_tokenizer(data.tokenizer, run_dir)
    if is_classifier(cfg):
        write_classes(data, run_dir)
