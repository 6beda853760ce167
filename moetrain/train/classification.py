"""Classification loss and metrics: the training cross-entropy with label smoothing, confusion
matrices, accuracy, macro-F1 and per-class F1.

Exact over a split spread across data-parallel ranks: each rank counts its confusion matrix and its
loss sum over the examples it holds, the counts and sums are all-reduced (summed), and the metrics
are computed once from the totals. Averaging per-rank accuracies would weight ranks, not examples.

Shapes: B examples, C classes. Confusion matrices are [C, C], rows = true class, columns = predicted.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from moetrain.data.classify_data import PreparedLabelled
from moetrain.data.labelled import INTEGER_LABEL as _INTEGER
from moetrain.train.metrics import read_class_names
from moetrain.utils.files import atomic_write_text

log = logging.getLogger("moetrain")

CLASSES_FILE = "classes.json"


def classification_loss(logits_BC: torch.Tensor, labels_B: torch.Tensor, *, label_smoothing: float = 0.0
                        ) -> torch.Tensor:
    """Mean cross-entropy over the batch, in fp32 whatever the compute dtype (0-dim)."""
    return F.cross_entropy(logits_BC.float(), labels_B, label_smoothing=label_smoothing)


def confusion_matrix(preds_B: torch.Tensor, labels_B: torch.Tensor, *, num_classes: int,
                     valid_B: torch.Tensor | None = None) -> torch.Tensor:
    """Counts [C, C] int64 of (true, predicted) pairs over the rows where ``valid_B`` is True."""
    if valid_B is not None:
        preds_B, labels_B = preds_B[valid_B], labels_B[valid_B]
    flat = labels_B.long() * num_classes + preds_B.long()
    return torch.bincount(flat, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def f1_per_class(confusion_CC: torch.Tensor) -> list[float | None]:
    """F1 = 2 TP / (2 TP + FP + FN) of each class; None for a class that is neither in the split nor
    ever predicted (its F1 is undefined)."""
    c = confusion_CC.double()
    tp = c.diagonal()
    denom = c.sum(dim=0) + c.sum(dim=1)  # (TP + FP) + (TP + FN)
    return [None if d == 0 else float(2 * t / d) for t, d in zip(tp.tolist(), denom.tolist(), strict=True)]


def metrics_from_confusion(confusion_CC: torch.Tensor, *, prefix: str) -> dict:
    """accuracy, macro_f1 (the mean F1 over the classes whose F1 is defined, as scikit-learn's
    ``f1_score(average="macro")`` with its default labels), per_class_f1, the confusion matrix and
    the example count, each key prefixed with ``prefix`` + "_"."""
    counts = confusion_CC.long()
    total = int(counts.sum())
    per_class = f1_per_class(counts)
    defined = [f for f in per_class if f is not None]
    return {f"{prefix}_accuracy": float(counts.diagonal().sum()) / max(total, 1),
            f"{prefix}_macro_f1": sum(defined) / max(len(defined), 1),
            f"{prefix}_per_class_f1": per_class,
            f"{prefix}_confusion": counts.tolist(),
            f"{prefix}_examples": total}


def describe_classes(data: PreparedLabelled, *, num_classes: int, run_dir: Path | None) -> None:
    """Check ``model.num_classes`` against the data and log the splits and the example lengths; with
    ``run_dir`` (rank 0) write ``RUN/classes.json`` (``write_classes``)."""
    classes = data.classes
    if num_classes != len(classes):
        raise ValueError(f"model.num_classes ({num_classes}) must equal the number of classes in the train split "
                         f"({len(classes)}: {_listing(classes)})")
    stats, sizes = data.length_stats, {k: len(v) for k, v in data.splits.items()}
    log.info("%d classes; %d train / %d val / %d test examples; tokens per example p50 %.0f p90 %.0f p99 %.0f max %d, "
             "%.2f%% cut at data.seq_len=%d", len(classes), sizes["train"], sizes["val"], sizes["test"],
             stats["tokens_p50"], stats["tokens_p90"], stats["tokens_p99"], stats["tokens_max"],
             100 * stats["truncated_fraction"], stats["seq_len"])
    if run_dir is not None:
        write_classes(data, run_dir)


def write_classes(data: PreparedLabelled, run_dir: Path) -> None:
    """``RUN/classes.json``: the class names in class-id order (the report, eval and generate name the
    classes with them; ``check_run_classes`` holds later data to them), the split sizes and the length
    distribution."""
    summary = {"classes": data.classes, "examples": {k: len(v) for k, v in data.splits.items()},
               "length_stats": data.length_stats}
    atomic_write_text(Path(run_dir) / CLASSES_FILE, json.dumps(summary, indent=1, ensure_ascii=False) + "\n")


def check_run_classes(classes: list[str], run_dir: str | Path, *, num_classes: int | None = None) -> None:
    """Refuse data whose classes (class id = index) are not those the run was trained with
    (``RUN/classes.json``): its head's row i is class i of that file, so other names, another order or
    another count would score (or train) every example against the wrong row. A run without the file
    (written before it existed) is checked on the class count ``num_classes`` only, with a warning."""
    path = Path(run_dir) / CLASSES_FILE
    run_classes = read_class_names(run_dir)
    if run_classes is None:
        if num_classes is not None and num_classes != len(classes):
            raise ValueError(f"the run's model has {num_classes} classes (model.num_classes), the data "
                             f"{len(classes)}: {_listing(classes)}")
        log.warning("%s is missing or unreadable: the data's classes (%s) cannot be checked against those the run "
                    "was trained with", path, _listing(classes))
        return
    if classes == run_classes:
        return
    first = next((i for i, (a, b) in enumerate(zip(classes, run_classes, strict=False)) if a != b),
                 min(len(classes), len(run_classes)))
    if sorted(classes) != sorted(run_classes):
        why = (f"{len(classes)} classes in the data, {len(run_classes)} in the run" if len(classes) != len(run_classes)
               else "other class names")
        hint = " Use the data the run was trained with (data.path, data.corpus, classify.label_field)."
    elif all(_INTEGER.fullmatch(c) for c in classes):
        why, hint = "the same classes in another order", (
            " Integer labels are now sorted numerically (\"2\" before \"10\"): a run made before that has its "
            "head's rows in text order and cannot be continued or evaluated with this version.")
    else:
        why, hint = "the same classes in another order", ""
    raise ValueError(f"the data's classes differ from those the run was trained with ({path}): {why}; from class "
                     f"id {first} the data has {_listing(classes[first:])}, the run {_listing(run_classes[first:])}."
                     + hint)


def _listing(names: list[str], limit: int = 12) -> str:
    return "[" + ", ".join(map(repr, names[:limit])) + (", ...]" if len(names) > limit else "]")
