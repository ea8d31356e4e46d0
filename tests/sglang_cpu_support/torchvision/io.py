"""Stand-in ``torchvision.io`` (transformers/video_utils.py: ``from torchvision import io``): stubs that raise."""

from torchvision import _stub_module_getattr

__getattr__ = _stub_module_getattr("torchvision.io")
