# my_model.py: a model plugin (gleak check-plugin examples/my_model.py; a suite uses it with --plugin)
from torch import nn

from gleak import register_model


@register_model("tiny-cnn")
def tiny_cnn(input_shape: tuple[int, ...], num_classes: int, width: int = 8) -> nn.Module:
    """A small CNN: one 3x3 convolution of `width` channels, ReLU, global average pooling and a linear classifier.

    gleak passes input_shape (channels, height, width) and num_classes from the case's data set; every other
    parameter is the suite's (model_params = { width = 16 }). Weights come from torch's generator, which gleak seeds
    per trial, so the same seed builds the same model."""
    return nn.Sequential(
        nn.Conv2d(input_shape[0], width, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes),
    )
