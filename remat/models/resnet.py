"""ResNet-18/34/50/101/152 (He et al., "Deep Residual Learning for Image
Recognition", 2015) with every residual block a remat stage.

The stem (conv1, bn1, relu, maxpool) is stage 1, each BasicBlock or
Bottleneck one stage after it; avgpool and fc run after the chain. Parameter
names follow the usual layout (``conv1``, ``bn1``, ``layer1.0.conv1``,
``layer2.0.downsample.0``, ``fc``), so state dicts in that layout load as is.
The stride of a Bottleneck sits on its 3x3 convolution ("ResNet v1.5").
"""

import torch
from torch import nn

from ..stage import stage
from ._common import open_chain

__all__ = ["ResNet", "BasicBlock", "Bottleneck", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152"]


def _conv3x3(inplanes, planes, stride=1):
    return nn.Conv2d(inplanes, planes, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(inplanes, planes, stride=1):
    return nn.Conv2d(inplanes, planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and a shortcut; one stage."""

    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = _conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    @stage
    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand by 4, and a shortcut; one stage."""

    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = _conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = _conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    @stage
    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """A ResNet whose stem and residual blocks form one remat chain.

    Args:
        block: ``BasicBlock`` or ``Bottleneck``.
        layers: number of blocks in each of the four groups.
        num_classes: outputs of the final linear layer.
        budget: activation memory for the chain (see ``remat.chain``), or
            None to run as plain PyTorch. ``model.budget`` and
            ``model.algorithm`` (default "optimal") may be changed later.

    Example:
        >>> import torch
        >>> from remat.models import resnet18
        >>> resnet18(num_classes=10)(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    def __init__(self, block, layers, num_classes=1000, budget=None):
        super().__init__()
        self.budget = budget
        self.algorithm = "optimal"
        self._inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _make_layer(self, block, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self._inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                _conv1x1(self._inplanes, planes * block.expansion, stride),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers = [block(self._inplanes, planes, stride, downsample)]
        self._inplanes = planes * block.expansion
        layers += [block(self._inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    @stage
    def _stem(self, x):
        return self.maxpool(self.relu(self.bn1(self.conv1(x))))

    def stages(self):
        """The chain's stages in call order: the stem, then every block."""
        return [self._stem] + [blk for layer in (self.layer1, self.layer2, self.layer3, self.layer4)
                               for blk in layer]

    def forward(self, x):
        with open_chain(self):
            for s in self.stages():
                x = s(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes=1000, budget=None):
    """ResNet-18: BasicBlocks [2, 2, 2, 2], 11.7M parameters."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, budget)


def resnet34(num_classes=1000, budget=None):
    """ResNet-34: BasicBlocks [3, 4, 6, 3], 21.8M parameters."""
    return ResNet(BasicBlock, [3, 4, 6, 3], num_classes, budget)


def resnet50(num_classes=1000, budget=None):
    """ResNet-50: Bottlenecks [3, 4, 6, 3], 25.6M parameters."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, budget)


def resnet101(num_classes=1000, budget=None):
    """ResNet-101: Bottlenecks [3, 4, 23, 3], 44.5M parameters."""
    return ResNet(Bottleneck, [3, 4, 23, 3], num_classes, budget)


def resnet152(num_classes=1000, budget=None):
    """ResNet-152: Bottlenecks [3, 8, 36, 3], 60.2M parameters."""
    return ResNet(Bottleneck, [3, 8, 36, 3], num_classes, budget)
