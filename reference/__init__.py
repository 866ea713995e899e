"""Torch reference decode model for every model family (megakernel.models): the fp32 truth and a
bf16 mirror of the kernel. One model class (`ReferenceModel`, model.py) runs a config's blocks
with the layer implementations of reference/layers/."""

from .layers import LAYERS, ReferenceLayer, all_layers, layer_class, register_layer
from .layers.attention import KVLayerCache
from .layers.common import MODES, HybridError
from .layers.mla import MLACache
from .layers.replay import DEFAULT_WINDOW, RecurrentMixer, SSMLayerCache
from .model import (
    Cache,
    ReferenceConfigError,
    ReferenceError,
    ReferenceModel,
    ReferenceWeightError,
    generate,
    greedy,
)

__all__ = [
    "Cache",
    "DEFAULT_WINDOW",
    "HybridError",
    "KVLayerCache",
    "LAYERS",
    "MLACache",
    "MODES",
    "RecurrentMixer",
    "ReferenceConfigError",
    "ReferenceError",
    "ReferenceLayer",
    "ReferenceModel",
    "ReferenceWeightError",
    "SSMLayerCache",
    "all_layers",
    "generate",
    "greedy",
    "layer_class",
    "register_layer",
]
