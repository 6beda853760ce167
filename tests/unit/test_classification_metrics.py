"""Classification metrics against values worked out by hand, and the label-smoothed loss against its
definition."""

from __future__ import annotations

import math

import pytest
import torch

from moetrain.train.classification import (
    classification_loss,
    confusion_matrix,
    f1_per_class,
    metrics_from_confusion,
)


def test_confusion_matrix_counts_valid_rows_only():
    labels = torch.tensor([0, 0, 1, 2, 2, 2, 1])
    preds = torch.tensor([0, 1, 1, 2, 0, 2, 2])
    valid = torch.tensor([True, True, True, True, True, True, False])
    expected = torch.tensor([[1, 1, 0],
                             [0, 1, 0],
                             [1, 0, 2]])
    assert torch.equal(confusion_matrix(preds, labels, num_classes=3, valid_B=valid), expected)


def test_metrics_by_hand():
    # rows = true, columns = predicted
    confusion = torch.tensor([[5, 1, 0],
                              [2, 3, 1],
                              [0, 0, 4]])
    # class 0: TP 5, FP 2, FN 1 -> F1 = 10 / 13
    # class 1: TP 3, FP 1, FN 3 -> F1 = 6 / 10
    # class 2: TP 4, FP 1, FN 0 -> F1 = 8 / 9
    f1 = [10 / 13, 6 / 10, 8 / 9]
    m = metrics_from_confusion(confusion, prefix="test")
    assert m["test_accuracy"] == pytest.approx(12 / 16)
    assert m["test_per_class_f1"] == pytest.approx(f1)
    assert m["test_macro_f1"] == pytest.approx(sum(f1) / 3)
    assert m["test_examples"] == 16 and m["test_confusion"] == confusion.tolist()


def test_f1_of_a_class_absent_and_never_predicted_is_undefined():
    confusion = torch.tensor([[3, 1, 0],
                              [0, 2, 0],
                              [0, 0, 0]])
    assert f1_per_class(confusion)[2] is None
    # macro over the two defined classes: (6/7 + 4/5) / 2, as scikit-learn's default labels give
    assert metrics_from_confusion(confusion, prefix="val")["val_macro_f1"] == pytest.approx((6 / 7 + 4 / 5) / 2)
    # a class that is predicted but never true has F1 0 and counts
    confusion = torch.tensor([[3, 1], [0, 0]])
    assert f1_per_class(confusion) == pytest.approx([6 / 7, 0.0])


def test_summed_confusion_of_shards_equals_the_whole():
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (101,), generator=gen)
    preds = torch.randint(0, 4, (101,), generator=gen)
    whole = confusion_matrix(preds, labels, num_classes=4)
    parts = sum(confusion_matrix(preds[i::3], labels[i::3], num_classes=4) for i in range(3))
    assert torch.equal(whole, parts)
    acc = metrics_from_confusion(whole, prefix="x")["x_accuracy"]
    assert acc == pytest.approx((preds == labels).float().mean().item())


def test_label_smoothing_loss_by_definition():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]])
    labels = torch.tensor([0, 2])
    logp = torch.log_softmax(logits, dim=-1)
    s = 0.1
    by_hand = -((1 - s) * logp[torch.arange(2), labels] + s / 3 * logp.sum(dim=-1)).mean()
    assert classification_loss(logits, labels, label_smoothing=s).item() == pytest.approx(by_hand.item(), rel=1e-6)
    plain = -logp[torch.arange(2), labels].mean()
    assert classification_loss(logits.bfloat16(), labels).dtype == torch.float32
    assert classification_loss(logits, labels).item() == pytest.approx(plain.item(), rel=1e-6)
    assert math.isfinite(classification_loss(logits, labels, label_smoothing=0.5).item())
