"""remat.models: the published architectures, with every block a stage.

Big models are built on the meta device (no memory, no compute); only small
variants and small inputs run.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from remat import models

# Parameter counts of the published architectures (torchvision's model
# cards; GPT-2 small as released, head tied to the token embedding).
PARAMETERS = [
    ("resnet18", 11_689_512),
    ("resnet34", 21_797_672),
    ("resnet50", 25_557_032),
    ("resnet101", 44_549_160),
    ("resnet152", 60_192_808),
    ("vgg11", 132_863_336),
    ("vgg13", 133_047_848),
    ("vgg16", 138_357_544),
    ("vgg19", 143_667_240),
    ("vgg11_bn", 132_868_840),
    ("vgg13_bn", 133_053_736),
    ("vgg16_bn", 138_365_992),
    ("vgg19_bn", 143_678_248),
    ("densenet121", 7_978_856),
    ("densenet169", 14_149_480),
    ("densenet201", 20_013_928),
    ("gpt2", 124_439_808),
]

# Small models that run for real: (name, constructor, input).
SMALL = [
    ("resnet18", lambda **kw: models.resnet18(num_classes=10, **kw), lambda: torch.randn(2, 3, 32, 32)),
    ("resnet50", lambda **kw: models.resnet50(num_classes=10, **kw), lambda: torch.randn(2, 3, 32, 32)),
    ("densenet", lambda **kw: models.DenseNet(8, (2, 2), 16, num_classes=10, **kw),
     lambda: torch.randn(2, 3, 32, 32)),
    ("vgg_bn", lambda **kw: models.VGG(11, batch_norm=True, num_classes=10, **kw),
     lambda: torch.randn(1, 3, 32, 32)),
    ("gpt", lambda **kw: _tiny_gpt(**kw), lambda: torch.randint(0, 64, (2, 16))),
]


def _tiny_gpt(**kw):
    kw.setdefault("dropout", 0.0)
    return models.gpt2(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16, **kw)


def _count(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name,expected", PARAMETERS)
def test_parameter_count(name, expected):
    """Each constructor builds the published architecture, to the parameter."""
    with torch.device("meta"):
        model = getattr(models, name)()
    assert _count(model) == expected


def test_untied_gpt2_has_a_separate_head():
    """gpt2(tied=False) adds a vocab_size x n_embd head; tied, the head is the token embedding."""
    with torch.device("meta"):
        tied, untied = models.gpt2(), models.gpt2(tied=False)
    assert tied.lm_head.weight is tied.transformer.wte.weight
    assert _count(untied) == _count(tied) + 50257 * 768


@pytest.mark.parametrize("name,expected", [
    ("resnet18", (2, 10)), ("resnet50", (2, 10)), ("densenet", (2, 10)), ("vgg_bn", (1, 10)), ("gpt", (2, 16, 64)),
])
def test_output_shape(name, expected):
    """Small variants map their input to (batch, classes), or (batch, time, vocab) for GPT."""
    _, make, inp = next(row for row in SMALL if row[0] == name)
    torch.manual_seed(0)
    assert make()(inp()).shape == expected


def test_full_size_models_run_small_inputs():
    """resnet18, vgg11 and densenet121 at full width accept a 32x32 image (the pools adapt)."""
    torch.manual_seed(0)
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        for make in (models.resnet18, models.vgg11, models.densenet121):
            assert make(num_classes=7).eval()(x).shape == (1, 7)


@pytest.mark.parametrize("name,count,keys", [
    ("resnet18", 122, ["conv1.weight", "bn1.running_mean", "layer2.0.downsample.0.weight",
                       "layer4.1.bn2.num_batches_tracked", "fc.bias"]),
    ("resnet50", 320, ["layer1.0.conv3.weight", "layer3.5.bn3.running_var", "fc.weight"]),
    ("densenet121", 727, ["features.conv0.weight", "features.denseblock1.denselayer1.norm1.weight",
                          "features.denseblock4.denselayer16.conv2.weight", "features.transition3.conv.weight",
                          "features.norm5.running_var", "classifier.weight"]),
    ("vgg16_bn", 97, ["features.0.conv.weight", "features.0.bn.running_mean", "features.12.conv.bias",
                      "classifier.0.weight", "classifier.6.bias"]),
    ("gpt2", 149, ["transformer.wte.weight", "transformer.wpe.weight", "transformer.h.11.attn.c_attn.weight",
                   "transformer.h.0.mlp.c_proj.bias", "transformer.ln_f.weight", "lm_head.weight"]),
])
def test_state_dict_keys_are_stable(name, count, keys):
    """State dict keys follow the published layout and do not depend on the budget."""
    with torch.device("meta"):
        plain = getattr(models, name)()
        budgeted = getattr(models, name)(budget="1GiB")
    assert list(plain.state_dict()) == list(budgeted.state_dict())
    assert len(plain.state_dict()) == count
    assert set(keys) <= set(plain.state_dict())


def test_vgg_loads_the_flat_layout():
    """A state dict whose features are one flat sequence (conv, bn, relu, pool) loads into VGG and computes the same."""
    torch.manual_seed(0)
    layers, c = [], 3
    for v in [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(c, v, 3, padding=1), nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
            c = v
    flat = nn.Sequential(*layers)
    for m in flat:
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
            m.weight.data.uniform_(0.5, 2)
    model = models.VGG(11, batch_norm=True, num_classes=10)
    state = {f"features.{k}": v for k, v in flat.state_dict().items()}
    state.update({k: v for k, v in model.state_dict().items() if k.startswith("classifier.")})
    model.load_state_dict(state)
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        y = x
        for s in model.eval().stages():
            y = s(y)
        torch.testing.assert_close(y, flat.eval()(x))


@pytest.mark.parametrize("name", [row[0] for row in SMALL])
def test_no_stage_modifies_its_input(name):
    """Running each stage once leaves its input tensor's version counter unchanged."""
    _, make, inp = next(row for row in SMALL if row[0] == name)
    torch.manual_seed(0)
    model = make()
    x = inp()
    if name == "gpt":
        x = model.transformer.wte(x).detach()
    for i, s in enumerate(model.stages()):
        version = x._version
        out = s(x)
        assert x._version == version, f"stage {i + 1} of {name} modified its input in place"
        assert out is not x
        x = out.detach()


def test_stage_list_covers_every_block():
    """stages() lists the stem and every block (ResNet-50: 1 + 16), dense layer and transition (DenseNet-121: 1 + 58 + 3)."""
    with torch.device("meta"):
        assert len(models.resnet50().stages()) == 17
        assert len(models.densenet121().stages()) == 62
        assert len(models.vgg16().stages()) == 13
        assert len(models.gpt2().stages()) == 12


@pytest.mark.parametrize("name", [row[0] for row in SMALL])
def test_runs_under_no_grad_with_a_budget(name):
    """Under torch.no_grad a model with a budget gives the plain model's output and builds no graph."""
    _, make, inp = next(row for row in SMALL if row[0] == name)
    torch.manual_seed(0)
    plain = make().eval()
    budgeted = make(budget="64MiB").eval()
    budgeted.load_state_dict(plain.state_dict())
    x = inp()
    with torch.no_grad():
        want, got = plain(x), budgeted(x)
    assert got.grad_fn is None
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", ["resnet18", "gpt"])
def test_recomputing_matches_plain_training(name):
    """Trained under a chain that keeps only stage inputs, a model gets plain PyTorch's loss, gradients and BatchNorm statistics."""
    _, make, inp = next(row for row in SMALL if row[0] == name)
    kw = {"dropout": 0.1} if name == "gpt" else {}
    torch.manual_seed(0)
    plain = make(**kw)
    budgeted = make(budget="64MiB", **kw)
    budgeted.algorithm = "min_memory"
    budgeted.load_state_dict(plain.state_dict())
    x = inp()
    for step in range(2):
        losses = []
        for model in (plain, budgeted):
            model.zero_grad()
            torch.manual_seed(10 + step)
            loss = model(x).float().pow(2).mean()
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0])
        for (n, p), q in zip(plain.named_parameters(), budgeted.parameters()):
            torch.testing.assert_close(q.grad, p.grad, msg=f"step {step}: gradient of {n}")
        for (n, b), c in zip(plain.named_buffers(), budgeted.buffers()):
            assert torch.equal(c, b), f"step {step}: buffer {n}"


def test_gpt_returns_the_loss_with_targets():
    """gpt(idx, targets) returns the logits and their cross-entropy, ignoring targets of -1."""
    torch.manual_seed(0)
    model = _tiny_gpt()
    idx = torch.randint(0, 64, (2, 16))
    targets = torch.randint(0, 64, (2, 16))
    targets[0, :5] = -1
    logits, loss = model(idx, targets)
    torch.testing.assert_close(logits, model(idx))
    keep = targets.view(-1) != -1
    torch.testing.assert_close(loss, F.cross_entropy(logits.view(-1, 64)[keep], targets.view(-1)[keep]))


def test_gpt_is_causal():
    """Changing a later token leaves the logits of earlier positions unchanged."""
    torch.manual_seed(0)
    model = _tiny_gpt().eval()
    idx = torch.randint(0, 64, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 64
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_gpt_attention_mask_hides_padding():
    """With an attention mask, real tokens' logits do not depend on padding, and an all-ones mask changes nothing."""
    torch.manual_seed(0)
    model = _tiny_gpt().eval()
    idx = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(idx, attention_mask=torch.ones(2, 16)), model(idx))
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[:, :4] = 0
        padded = idx.clone()
        padded[:, :4] = 0
        a = model(idx, attention_mask=mask)
        b = model(padded, attention_mask=mask)
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a[:, 4:], b[:, 4:])


def test_gpt_rejects_sequences_longer_than_block_size():
    """A sequence longer than block_size raises a ValueError naming both lengths."""
    model = _tiny_gpt()
    with pytest.raises(ValueError, match="17.*16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_initialisation_follows_the_references():
    """Convolutions are Kaiming-normal, BatchNorm starts at (1, 0), GPT weights are N(0, 0.02) with scaled residual projections."""
    torch.manual_seed(0)
    resnet = models.resnet50()
    conv = resnet.layer3[0].conv2  # 256 out channels, 3x3: fan_out 2304
    assert abs(conv.weight.std().item() - (2 / 2304) ** 0.5) < 0.002
    assert all(torch.equal(m.weight, torch.ones_like(m.weight)) and not m.bias.any()
               for m in resnet.modules() if isinstance(m, nn.BatchNorm2d))
    gpt = models.gpt2(n_layer=4, n_embd=256, n_head=4, vocab_size=1000, block_size=64)
    assert abs(gpt.transformer.h[0].attn.c_attn.weight.std().item() - 0.02) < 0.001
    assert abs(gpt.transformer.h[0].mlp.c_proj.weight.std().item() - 0.02 / 8 ** 0.5) < 0.001
    assert not gpt.transformer.h[0].mlp.c_fc.bias.any()
