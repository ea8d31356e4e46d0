"""Stand-in ``torchvision.transforms`` (see ``torchvision/__init__.py``): ``InterpolationMode`` and stubs."""

from enum import Enum

from torchvision import _stub_module_getattr
from torchvision.transforms import functional  # noqa: F401  (``from torchvision.transforms import functional``)


class InterpolationMode(Enum):  # sglang/srt/configs/deepseek_ocr.py, transformers/image_utils.py
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


__getattr__ = _stub_module_getattr("torchvision.transforms")
