"""Stand-in ``torchvision.transforms.v2`` (transformers/image_processing_backends.py imports ``v2.functional``)."""

from torchvision import _stub_module_getattr
from torchvision.transforms.v2 import functional  # noqa: F401

__getattr__ = _stub_module_getattr("torchvision.transforms.v2")
