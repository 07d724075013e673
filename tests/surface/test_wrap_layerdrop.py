"""remat.wrap on a Hugging Face model with LayerDrop (Wav2Vec2, whose encoder skips
each layer with probability ``layerdrop`` while training), built from a config with
random weights, against plain PyTorch (Note [Skipped stages], remat/runtime/skips.py)."""

import copy

import torch

import remat
from remat.measure import measuring
from remat.solver.solve import minimum_budget
from test_wrap import needs_transformers, transformers


def wav2vec2(layers=6, layerdrop=0.3):
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_feat_extract_layers=2, vocab_size=16,
        layerdrop=layerdrop, do_stable_layer_norm=True, num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2, mask_time_prob=0.0)   # (SpecAugment draws from numpy)
    torch.manual_seed(0)
    return transformers.Wav2Vec2ForCTC(config).train()


def _train(model, steps, each=lambda: None):
    """Train ``steps`` steps (seeded: the same layers dropped in each run), calling
    ``each()`` after each; return the losses and gradients, and the layers each step
    skipped."""
    x = torch.randn(2, 1600, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(1, 16, (2, 12), generator=torch.Generator().manual_seed(2))
    layers = model.wav2vec2.encoder.layers
    seen = []
    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: seen.append(i)) for i, layer in enumerate(layers)]
    record, skipped = [], []
    for step in range(steps):
        seen.clear()
        torch.manual_seed(step)
        model.zero_grad()
        loss = model(x, labels=labels).loss
        loss.backward()
        record.append(loss.detach())
        record.extend(p.grad.clone() for p in model.parameters() if p.grad is not None)
        skipped.append(sorted(set(range(len(layers))) - set(seen)))
        each()
    for h in hooks:
        h.remove()
    return record, skipped


@needs_transformers
def test_wav2vec2_layerdrop_is_exact_and_measured_until_every_layer_ran(monkeypatch):
    """Wav2Vec2 with LayerDrop 0.3 at a budget that recomputes: every step is plain
    PyTorch's, bitwise, and once a call has run every layer, calls that skip inner
    layers measure nothing: they run that record's plan without them. (A call that
    skips the first layer has another key, measured once; one that stops short may
    be measured, Note [Chain keys].) Before, 13 of the 16 calls measured; now 4."""
    base = wav2vec2()
    want, skipped = _train(copy.deepcopy(base), 16)
    probe = copy.deepcopy(base)
    probe.config.layerdrop = 0.0
    remat.wrap(probe, probe.wav2vec2.encoder.layers, budget=2**40)
    _train(probe, 1)
    budget = int(1.5 * minimum_budget(remat.explain().costs))
    remat.clear_cache()
    model = copy.deepcopy(base)
    remat.wrap(model, model.wav2vec2.encoder.layers, budget=budget)
    made, init = [0], measuring.Measurer.__init__
    monkeypatch.setattr(measuring.Measurer, "__init__", lambda self, *a, **k: (made.append(0), init(self, *a, **k))[1])
    measured = []
    got, skipped_got = _train(model, 16, lambda: measured.append(len(made)))
    assert skipped_got == skipped
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    measured = [b > a for a, b in zip([1] + measured, measured)]
    full = skipped.index([])
    inner = [(skip, again) for skip, again in zip(skipped[full + 1:], measured[full + 1:])
             if 0 not in skip and 5 not in skip]
    assert sum(bool(skip) for skip, _ in inner) >= 3, skipped   # (the seeds skip inner layers after it)
    assert not any(again for _, again in inner), str(list(zip(skipped, measured)))
    assert sum(measured) <= 4, str(list(zip(skipped, measured)))
    remat.unwrap(model)
