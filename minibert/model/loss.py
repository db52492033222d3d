"""The pretraining loss: masked-LM cross entropy over the masked positions, plus the sentence-order (SOP)
loss, and the counts behind the accuracies the log prints.

    lm_loss  = sum of CE over masked positions / number of masked positions
    sop_loss = mean CE of the binary head over the batch
    loss     = lm_loss + sop_loss            (lm_loss alone without the binary head)

Computed in fp32 whatever dtype the model runs in."""
import torch
import torch.nn.functional as F


def label_is_max(logits, labels, ignore_index=-1):
    """bool [n]: the label's logit equals the row's largest, i.e. the model's prediction (the argmax) is
    the label; a tie for the maximum counts as right. False where the label is ignore_index. logits [n, C],
    labels [n]. Every path counts the same way: the fused kernel compares the same two numbers, and the
    vocab-parallel loss compares the label's logit with the maximum it all-reduces anyway."""
    target = logits.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)  # [n]; ignored rows read column 0
    return (labels != ignore_index) & (target == logits.max(dim=-1).values)


def lm_cross_entropy(logits, labels, with_correct=False):
    """Per-position CE in fp32 (bf16/fp16 logits lose too much precision in the log-softmax): logits
    [n, vocab], labels [n] (-1: not a masked position) -> [n]. Tensor parallelism swaps in a vocab-parallel
    cross entropy that takes logits [n, vocab / TP].

    with_correct=True: -> (loss [n], correct bool [n]), correct = label_is_max(logits, labels), what the
    masked-LM accuracy counts."""
    logits = logits.float()
    loss = F.cross_entropy(logits, labels, ignore_index=-1, reduction="none")
    return (loss, label_is_max(logits, labels)) if with_correct else loss


def pretraining_loss(output, labels, loss_mask, is_random, sparse=False, cross_entropy=lm_cross_entropy,
                     positions=None, counts=False):
    """-> (loss, lm_loss, sop_loss or None), all fp32 scalars whatever dtype the model ran in.

    lm_loss  = sum_i ce_i * loss_mask_i / max(sum_i loss_mask_i, 1)   (0, not NaN, when nothing is masked)
    sop_loss = mean_b CE(binary_logits_b, is_random_b)
    labels [b, s] (-1 where not selected), loss_mask [b, s], is_random [b]. With sparse=True the model was
    called with lm_mask = (loss_mask != 0), so lm_logits holds those positions' rows in row-major order.
    positions: int64 [rows], the flat positions (b * s + j) the rows of lm_logits belong to (packed or
    sparse runs). cross_entropy(logits [n, vocab], labels [n]) -> [n]: the model's lm_cross_entropy.

    counts=True adds a fourth item, what the accuracies are made of: int64 device scalars
        "lm correct"  masked positions (loss_mask != 0) whose label is the argmax (label_is_max)
        "lm masked"   masked positions
        "sop correct", "sop samples"   the same for the SOP head (only with it)
    cross_entropy must then take with_correct=True (every loss in minibert does)."""
    logits = output.lm_logits
    loss_mask = loss_mask.float()
    if positions is not None:
        labels, loss_mask = labels.reshape(-1)[positions], loss_mask.reshape(-1)[positions]
    elif sparse:
        selected = loss_mask != 0  # [b, s]
        labels, loss_mask = labels[selected], loss_mask[selected]  # [n]
        if logits.shape[0] != labels.shape[0]:
            raise ValueError(f"sparse loss: {logits.shape[0]} LM rows for {labels.shape[0]} masked positions;"
                             " call the model with lm_mask=(loss_mask != 0)")
    logits, labels, loss_mask = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), loss_mask.reshape(-1)
    if counts:
        ce, correct = cross_entropy(logits, labels, with_correct=True)  # [b*s, vocab] -> [b*s], [b*s]
    else:
        ce = cross_entropy(logits, labels)
    lm_loss = (ce * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)
    sop_loss = None
    if output.binary_logits is not None:
        sop_logits, sop_labels = output.binary_logits.float(), is_random.reshape(-1).long()
        sop_loss = F.cross_entropy(sop_logits, sop_labels)
    loss = lm_loss if sop_loss is None else lm_loss + sop_loss
    if not counts:
        return loss, lm_loss, sop_loss
    masked = loss_mask != 0
    accuracy_counts = {"lm correct": (correct & masked).sum(), "lm masked": masked.sum()}
    if sop_loss is not None:
        accuracy_counts["sop correct"] = label_is_max(sop_logits, sop_labels).sum()
        accuracy_counts["sop samples"] = torch.full((), sop_labels.numel(), dtype=torch.int64,
                                                    device=sop_labels.device)  # a fill: no host-to-device copy
    return loss, lm_loss, sop_loss, accuracy_counts
