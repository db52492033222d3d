"""GPU check of the attention backends inside the whole model (bf16, BERT-large-shaped layers).

For each backend: loss, outputs at real positions and parameter gradients against the local (plain
PyTorch) backend, plus the forward+backward time of one micro-batch. Each model has the levers the
trainer turns on by default (minibert.fast.levers.apply_levers), its loss the model's own cross entropy.
Dropout is off so every backend computes the same function. Run on a GPU: `python bench/model_check.py`."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton.testing  # noqa: E402

from minibert.config import Config  # noqa: E402
from minibert.fast.levers import apply_levers  # noqa: E402
from minibert.model.bert import BertModel  # noqa: E402
from minibert.model.loss import pretraining_loss


def batch(b, s, vocab, device, generator):
    lengths = torch.randint(s // 2, s + 1, (b,), generator=generator)
    positions = torch.arange(s)[None, :]
    padding = positions >= lengths[:, None]  # [b, s] True = padding
    tokens = torch.randint(1000, vocab, (b, s), generator=generator).masked_fill(padding, 0)
    loss_mask = (torch.rand(b, s, generator=generator) < 0.15) & ~padding
    labels = torch.where(loss_mask, tokens, torch.full_like(tokens, -1))
    is_random = torch.randint(0, 2, (b,), generator=generator)
    return [t.to(device) for t in (tokens, padding, labels, loss_mask, is_random)]


def run(layers=2, hidden=1024, heads=16, seq=512, micro=8):
    device = torch.device("cuda")
    cfg = Config(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=seq,
                 hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    reference_model = BertModel(cfg).to(device, torch.bfloat16)  # the weights every backend's model loads
    tokens, padding, labels, loss_mask, is_random = batch(micro, seq, cfg.vocab_size, device,
                                                          torch.Generator().manual_seed(0))
    real = ~padding
    results, ref = [], None
    for backend in ["local", "fused", "flash"]:
        cfg.attention_backend = backend
        model = BertModel(cfg).to(device, torch.bfloat16)
        model.load_state_dict(reference_model.state_dict())
        apply_levers(model, None, cfg)  # as minibert/train.py runs the model (parameters and names kept)

        def step():
            out = model(tokens, padding_mask=padding)
            loss = pretraining_loss(out, labels, loss_mask, is_random, cross_entropy=model.lm_cross_entropy)[0]
            loss.backward()
            return out, loss
        model.zero_grad(set_to_none=True)
        out, loss = step()
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
        hidden_real = out.hidden[real].float()
        if ref is None:
            ref = (loss.item(), hidden_real, grads)
        worst = max(((g - ref[2][n]).norm() / ref[2][n].norm().clamp(min=1e-12)).item() for n, g in grads.items())
        hid = ((hidden_real - ref[1]).norm() / ref[1].norm()).item()
        ms = triton.testing.do_bench(lambda: (model.zero_grad(set_to_none=True), step()), warmup=50, rep=300)
        results.append(dict(backend=backend, loss=loss.item(), loss_diff=abs(loss.item() - ref[0]),
                            hidden_rel=hid, worst_grad_rel=worst, ms=ms))
        print(f"{backend:6s} loss {loss.item():.5f} |dloss| {abs(loss.item() - ref[0]):.2e} "
              f"hidden rel {hid:.2e} worst grad rel {worst:.2e}  fwd+bwd {ms:.2f} ms", flush=True)
    return results


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__)
    run()
