"""Standard architectures whose blocks are remat stages.

Each model takes ``budget=`` (see ``remat.chain``); with ``budget=None`` it
runs as plain PyTorch. ``model.stages()`` lists the stages in chain order.

Example:
    >>> import torch
    >>> from remat.models import resnet18
    >>> model = resnet18(num_classes=10, budget="64MiB")
    >>> model(torch.randn(2, 3, 32, 32)).sum().backward()
"""

from .densenet import DenseNet, densenet121, densenet169, densenet201
from .gpt import GPT, Block, gpt2
from .resnet import BasicBlock, Bottleneck, ResNet, resnet18, resnet34, resnet50, resnet101, resnet152
from .vgg import VGG, vgg11, vgg11_bn, vgg13, vgg13_bn, vgg16, vgg16_bn, vgg19, vgg19_bn

__all__ = [
    "ResNet", "BasicBlock", "Bottleneck", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    "VGG", "vgg11", "vgg13", "vgg16", "vgg19", "vgg11_bn", "vgg13_bn", "vgg16_bn", "vgg19_bn",
    "DenseNet", "densenet121", "densenet169", "densenet201",
    "GPT", "Block", "gpt2",
]
