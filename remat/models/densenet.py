"""DenseNet-121/169/201 (Huang et al., "Densely Connected Convolutional
Networks", 2016) with every dense layer and transition a remat stage.

A dense layer's stage takes the concatenation of all features so far and
returns it with the layer's new features appended (``torch.cat``), so the
activation flowing along the chain is always one tensor. The stem (conv0,
norm0, relu0, pool0) is stage 1; norm5, the final ReLU, pooling and the
classifier run after the chain. Parameter names follow the usual layout
(``features.conv0``, ``features.denseblock1.denselayer1.norm1``,
``features.transition1.conv``, ``features.norm5``, ``classifier``).
"""

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from ..stage import stage
from ._common import open_chain

__all__ = ["DenseNet", "densenet121", "densenet169", "densenet201"]


class _DenseLayer(nn.Module):
    """BN-ReLU-1x1 conv (bottleneck), BN-ReLU-3x3 conv; appends ``growth_rate`` channels. One stage."""

    def __init__(self, num_input_features, growth_rate, bn_size, drop_rate):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(num_input_features)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(num_input_features, bn_size * growth_rate, kernel_size=1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth_rate)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth_rate, growth_rate, kernel_size=3, padding=1, bias=False)
        self.drop_rate = float(drop_rate)

    @stage
    def forward(self, x):
        new = self.conv1(self.relu1(self.norm1(x)))
        new = self.conv2(self.relu2(self.norm2(new)))
        if self.drop_rate > 0:
            new = F.dropout(new, p=self.drop_rate, training=self.training)
        return torch.cat([x, new], 1)


class _DenseBlock(nn.ModuleDict):
    """``num_layers`` dense layers; called as a whole it runs them in order."""

    def __init__(self, num_layers, num_input_features, bn_size, growth_rate, drop_rate):
        super().__init__()
        for i in range(num_layers):
            layer = _DenseLayer(num_input_features + i * growth_rate, growth_rate, bn_size, drop_rate)
            self.add_module(f"denselayer{i + 1}", layer)

    def forward(self, x):
        for layer in self.values():
            x = layer(x)
        return x


class _Transition(nn.Module):
    """BN-ReLU-1x1 conv halving the channels, then 2x2 average pooling. One stage."""

    def __init__(self, num_input_features, num_output_features):
        super().__init__()
        self.norm = nn.BatchNorm2d(num_input_features)
        self.relu = nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(num_input_features, num_output_features, kernel_size=1, bias=False)
        self.pool = nn.AvgPool2d(kernel_size=2, stride=2)

    @stage
    def forward(self, x):
        return self.pool(self.conv(self.relu(self.norm(x))))


class DenseNet(nn.Module):
    """A DenseNet-BC whose stem, dense layers and transitions form one remat chain.

    Args:
        growth_rate: channels each dense layer adds.
        block_config: number of dense layers in each dense block.
        num_init_features: channels out of the stem.
        bn_size: bottleneck width, as a multiple of ``growth_rate``.
        drop_rate: dropout after each dense layer.
        num_classes: outputs of the classifier.
        budget: activation memory for the chain (see ``remat.chain``), or
            None to run as plain PyTorch. ``model.budget`` and
            ``model.algorithm`` (default "optimal") may be changed later.

    Example:
        >>> import torch
        >>> from remat.models import DenseNet
        >>> net = DenseNet(growth_rate=4, block_config=(2, 2), num_init_features=8, num_classes=3)
        >>> net(torch.randn(1, 3, 32, 32)).shape
        torch.Size([1, 3])
    """

    def __init__(self, growth_rate=32, block_config=(6, 12, 24, 16), num_init_features=64, bn_size=4,
                 drop_rate=0.0, num_classes=1000, budget=None):
        super().__init__()
        self.budget = budget
        self.algorithm = "optimal"
        self.features = nn.Sequential(OrderedDict([
            ("conv0", nn.Conv2d(3, num_init_features, kernel_size=7, stride=2, padding=3, bias=False)),
            ("norm0", nn.BatchNorm2d(num_init_features)),
            ("relu0", nn.ReLU(inplace=True)),
            ("pool0", nn.MaxPool2d(kernel_size=3, stride=2, padding=1)),
        ]))
        num_features = num_init_features
        for i, num_layers in enumerate(block_config):
            block = _DenseBlock(num_layers, num_features, bn_size, growth_rate, drop_rate)
            self.features.add_module(f"denseblock{i + 1}", block)
            num_features += num_layers * growth_rate
            if i != len(block_config) - 1:
                self.features.add_module(f"transition{i + 1}", _Transition(num_features, num_features // 2))
                num_features //= 2
        self.features.add_module("norm5", nn.BatchNorm2d(num_features))
        self.classifier = nn.Linear(num_features, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    @stage
    def _stem(self, x):
        f = self.features
        return f.pool0(f.relu0(f.norm0(f.conv0(x))))

    def stages(self):
        """The chain's stages in call order: the stem, then each dense layer and transition."""
        out = [self._stem]
        for module in self.features.children():
            if isinstance(module, _DenseBlock):
                out.extend(module.values())
            elif isinstance(module, _Transition):
                out.append(module)
        return out

    def forward(self, x):
        with open_chain(self):
            for s in self.stages():
                x = s(x)
        x = F.relu(self.features.norm5(x))
        x = torch.flatten(F.adaptive_avg_pool2d(x, (1, 1)), 1)
        return self.classifier(x)


def densenet121(num_classes=1000, budget=None):
    """DenseNet-121: growth 32, blocks (6, 12, 24, 16), 8.0M parameters."""
    return DenseNet(32, (6, 12, 24, 16), 64, num_classes=num_classes, budget=budget)


def densenet169(num_classes=1000, budget=None):
    """DenseNet-169: growth 32, blocks (6, 12, 32, 32), 14.1M parameters."""
    return DenseNet(32, (6, 12, 32, 32), 64, num_classes=num_classes, budget=budget)


def densenet201(num_classes=1000, budget=None):
    """DenseNet-201: growth 32, blocks (6, 12, 48, 32), 20.0M parameters."""
    return DenseNet(32, (6, 12, 48, 32), 64, num_classes=num_classes, budget=budget)
