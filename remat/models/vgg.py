"""VGG-11/13/16/19, with and without BatchNorm (Simonyan and Zisserman,
"Very Deep Convolutional Networks for Large-Scale Image Recognition", 2014),
with the feature layers grouped into remat stages.

Each stage is one convolution with its BatchNorm and ReLU, and the max-pool
that follows it if any: a pool (or a ReLU) never starts a stage, so no stage
begins with an op that could touch its input in place. The classifier runs
after the chain.

Parameter names are ``features.<stage>.conv``, ``features.<stage>.bn`` and
``classifier.{0,3,6}``. State dicts in the flat layout where ``features`` is
one sequence of layers (``features.0.weight``, ``features.1.running_mean``,
...) load too: ``VGG`` renames their keys on load.
"""

import re

import torch
from torch import nn

from ..errors import UsageError
from ..stage import stage
from ._common import open_chain

__all__ = ["VGG", "vgg11", "vgg13", "vgg16", "vgg19", "vgg11_bn", "vgg13_bn", "vgg16_bn", "vgg19_bn"]

# Output channels of each convolution; "M" is a 2x2 max-pool.
_CONFIGS = {
    11: [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    13: [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    16: [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    19: [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"],
}
_FLAT_KEY = re.compile(r"features\.(\d+)\.(.+)")


class _ConvStage(nn.Module):
    """3x3 convolution, optional BatchNorm, ReLU, optional 2x2 max-pool; one stage."""

    def __init__(self, in_channels, out_channels, batch_norm, pool):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1)
        self.bn = nn.BatchNorm2d(out_channels) if batch_norm else None
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(kernel_size=2, stride=2) if pool else None

    @stage
    def forward(self, x):
        x = self.conv(x)
        if self.bn is not None:
            x = self.bn(x)
        x = self.relu(x)
        if self.pool is not None:
            x = self.pool(x)
        return x


class VGG(nn.Module):
    """A VGG whose convolutional stages form one remat chain.

    Args:
        depth: 11, 13, 16 or 19 weight layers.
        batch_norm: add BatchNorm after every convolution.
        num_classes: outputs of the final linear layer.
        dropout: dropout probability in the classifier.
        budget: activation memory for the chain (see ``remat.chain``), or
            None to run as plain PyTorch. ``model.budget`` and
            ``model.algorithm`` (default "optimal") may be changed later.

    Example:
        >>> import torch
        >>> from remat.models import vgg11
        >>> model = vgg11(num_classes=10, budget="64MiB")
        >>> model(torch.randn(1, 3, 32, 32)).shape
        torch.Size([1, 10])
    """

    def __init__(self, depth, batch_norm=False, num_classes=1000, dropout=0.5, budget=None):
        super().__init__()
        if depth not in _CONFIGS:
            raise UsageError(f"remat: VGG depth must be one of {sorted(_CONFIGS)}, got {depth!r}")
        self.budget = budget
        self.algorithm = "optimal"
        cfg = _CONFIGS[depth]
        # flat: index of each conv and bn in the flat layout -> (stage, name),
        # for loading state dicts in that layout (see the module docstring).
        stages, flat, index, in_channels = [], {}, 0, 3
        for i, v in enumerate(cfg):
            if v == "M":
                index += 1
                continue
            flat[index] = (len(stages), "conv")
            if batch_norm:
                flat[index + 1] = (len(stages), "bn")
            index += 3 if batch_norm else 2
            pool = i + 1 < len(cfg) and cfg[i + 1] == "M"
            stages.append(_ConvStage(in_channels, v, batch_norm, pool))
            in_channels = v
        self._flat = flat
        self.features = nn.Sequential(*stages)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, num_classes),
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)
        self.register_load_state_dict_pre_hook(_rename_flat_keys)

    def stages(self):
        """The chain's stages in call order."""
        return list(self.features)

    def forward(self, x):
        with open_chain(self):
            for s in self.stages():
                x = s(x)
        return self.classifier(torch.flatten(self.avgpool(x), 1))


def _rename_flat_keys(module, state_dict, prefix, *args):
    """Rename ``features.<i>.<name>`` of the flat layout to ``features.<stage>.<conv|bn>.<name>``."""
    flat_keys = []
    for key in state_dict:
        if not key.startswith(prefix):
            continue
        m = _FLAT_KEY.fullmatch(key[len(prefix):])
        if m is not None and m.group(2).partition(".")[0] not in ("conv", "bn"):
            flat_keys.append((key, int(m.group(1)), m.group(2)))
    for key, index, name in flat_keys:
        place = module._flat.get(index)
        if place is not None:
            state_dict[f"{prefix}features.{place[0]}.{place[1]}.{name}"] = state_dict.pop(key)


def _vgg(depth, batch_norm, num_classes, budget):
    return VGG(depth, batch_norm=batch_norm, num_classes=num_classes, budget=budget)


def vgg11(num_classes=1000, budget=None):
    """VGG-11 (configuration A), 132.9M parameters."""
    return _vgg(11, False, num_classes, budget)


def vgg13(num_classes=1000, budget=None):
    """VGG-13 (configuration B), 133.0M parameters."""
    return _vgg(13, False, num_classes, budget)


def vgg16(num_classes=1000, budget=None):
    """VGG-16 (configuration D), 138.4M parameters."""
    return _vgg(16, False, num_classes, budget)


def vgg19(num_classes=1000, budget=None):
    """VGG-19 (configuration E), 143.7M parameters."""
    return _vgg(19, False, num_classes, budget)


def vgg11_bn(num_classes=1000, budget=None):
    """VGG-11 with BatchNorm."""
    return _vgg(11, True, num_classes, budget)


def vgg13_bn(num_classes=1000, budget=None):
    """VGG-13 with BatchNorm."""
    return _vgg(13, True, num_classes, budget)


def vgg16_bn(num_classes=1000, budget=None):
    """VGG-16 with BatchNorm."""
    return _vgg(16, True, num_classes, budget)


def vgg19_bn(num_classes=1000, budget=None):
    """VGG-19 with BatchNorm."""
    return _vgg(19, True, num_classes, budget)
