"""Models used by gradient-inversion attacks and defenses, and a LightningModule to train them."""

from .classifier import ImageClassifier
from .cnn6 import CNN6
from .conv2 import Conv2
from .convnet import ConvNet
from .lenet import LeNetZhu
from .mlp import MLP
from .precode import PRECODE
from .resnet import ResNet18
from .vgg import VGG11

__all__ = ["CNN6", "MLP", "PRECODE", "VGG11", "Conv2", "ConvNet", "ImageClassifier", "LeNetZhu", "ResNet18"]
